"""The quarantine lane on the real stack: real workers, real SIGKILLs and SIGTERMs.

A job whose worker died under it moves to the lane (`fq.quarantine`), where only
quarantine workers run it, under the lane's own cap; a further death there fails it as a
poison pill; a scale-down (SIGTERM) counts no death; operators send it back or fail it."""

from __future__ import annotations

import time
from datetime import datetime

from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client, SimpleTestCase, override_settings
from django.utils import timezone
from kombu import Connection, Queue

from dashboard.metrics import collector_register
from dashboard.snapshot import snapshot_build
from fairqueue.celery import app
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.admission import POOL_MARGIN, QUARANTINE_KEY, lane_limits, lane_room, shard_tag
from fairqueue.jobs.fleet import fleet_read, fleet_workers
from fairqueue.jobs.live import fleet_state
from fairqueue.jobs.models import Job, JobStatus, LedgerEntry
from fairqueue.jobs.quarantine import Death, death_outcome
from fairqueue.jobs.quarantine_actions import OPERATOR_FAILED
from fairqueue.jobs.recovery import state_ensure
from fairqueue.queues import QUARANTINE_QUEUE, broker_is_amqp
from tenants.policy import PoolPolicy
from tests.factories import make_tenant, pool_set
from tests.rabbitmq import RabbitMQBrokerMixin
from tests.test_jobs_e2e import E2EBase, max_overlap
from tests.workers import WorkerProcess, wait_for

# Short, so a death shows soon; not shorter: on a busy machine a renewal held up past a
# 1 s lease fences a job that then counts a death of its own, and moves (or fails) it
# where a test did not expect it.
LEASE_SECONDS = 3.0
LEASE = {"FAIRQUEUE_LEASE_SECONDS": str(LEASE_SECONDS)}
# Long enough that a job is surely still running when its worker is killed or stopped.
LONG_JOB_SECONDS = 30.0
# The demo task's peak, past the lean worker's limit (a worker process is about 100 MB).
HUNGRY_MB = 400
LEAN_WORKER_MB = 300


def fq(**overrides: object) -> dict[str, object]:
    return {**settings.FAIRQUEUE, **overrides}


@override_settings(FAIRQUEUE=fq(LEASE_SECONDS=LEASE_SECONDS))
class QuarantineBase(E2EBase):
    def setUp(self) -> None:
        super().setUp()
        # Before any submit: a worker's first tick that found the state not ready would
        # rebuild it under a job (tests.test_jobs_e2e's WorkerLossTests says why).
        state_ensure()

    def lane_backlog(self) -> int:
        """Deliveries waiting in the lane's queue, on either broker."""
        if not broker_is_amqp(str(app.conf.broker_url)):
            return int(self.redis.llen(f"fq:celery:{QUARANTINE_QUEUE}"))
        with Connection(str(app.conf.broker_url)) as conn:
            _, count, _ = Queue(QUARANTINE_QUEUE)(conn.default_channel).queue_declare(passive=True)
            return int(count)

    def row(self, job: dict[str, object]) -> Job:
        return Job.objects.get(id=job["id"])

    def quarantine_by_kill(
        self, key: str, count: int = 1, seconds: float = LONG_JOB_SECONDS
    ) -> list[dict[str, object]]:
        """Submit `count` jobs, run them on a normal worker and SIGKILL it; a second normal
        worker's lease sweep finds them dead and moves them to the lane. Leaves the
        second worker running (returned jobs are quarantined and waiting)."""
        victim = WorkerProcess(slots=count, name="victim", **LEASE).start()
        jobs = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": seconds}}) for _ in range(count)]
        wait_for(
            lambda: Job.objects.filter(id__in=[j["id"] for j in jobs], status=JobStatus.RUNNING).count() == count,
            timeout=30,
            message="the jobs to start on the victim",
        )
        victim.kill()
        self.sweeper = WorkerProcess(slots=2, name="normal", **LEASE).start()
        wait_for(
            lambda: Job.objects.filter(id__in=[j["id"] for j in jobs], quarantined_at__isnull=False).count() == count,
            timeout=30,
            message="the jobs to move to quarantine",
        )
        return jobs


class MoveTests(QuarantineBase):
    def test_a_job_its_worker_died_under_runs_again_only_on_a_quarantine_worker(self) -> None:
        _, key = make_tenant("crashy")
        (job,) = self.quarantine_by_kill(key, seconds=3.0)
        row = self.row(job)
        self.assertEqual((row.worker_losses, row.quarantine_losses, row.attempts), (1, 0, 1))
        self.assertIn("worker died 1 time", row.quarantine_reason)
        self.assertIn(tl.QUARANTINED, [s.event for s in tl.steps(row.timeline)])
        answer = self.get(key, job["id"])
        self.assertTrue(answer["quarantined"])
        self.assertIn("worker died", str(answer["quarantine_reason"]))
        # A normal worker with free slots never receives it again.
        time.sleep(3)
        row = self.row(job)
        self.assertEqual((row.status in (JobStatus.QUEUED, JobStatus.PARKED), row.attempts), (True, 1), row.status)
        self.assertEqual(self.lane_backlog(), 1, "its delivery waits in the lane's queue")
        # The dashboard's snapshot and /metrics show it waiting in the lane.
        lane = snapshot_build(with_history=False)["quarantine"]
        self.assertEqual((lane["slots"], lane["waiting"]), (1, 1), lane)
        self.assertGreater(lane["oldest_wait_s"], 0)
        metrics = Client().get("/metrics").content.decode()
        self.assertIn("fairqueue_quarantine_waiting 1.0", metrics)
        with WorkerProcess(slots=1, name="quarantine", quarantine=True, **LEASE) as quarantine:
            wait_for(lambda: self.row(job).status == JobStatus.SUCCEEDED, timeout=30, message="run in quarantine")
        row = self.row(job)
        self.assertEqual((row.worker, row.attempts, row.worker_losses), (quarantine.hostname, 2, 1))
        self.assertEqual(LedgerEntry.objects.get(job_id=row.id).writes, 1)
        self.assertTrue(self.get(key, job["id"])["quarantined"])

    def test_a_further_death_in_quarantine_fails_it_as_a_poison_pill(self) -> None:
        pool_set(quarantine_poison_losses=1)
        _, key = make_tenant("poison")
        (job,) = self.quarantine_by_kill(key)
        q1 = WorkerProcess(slots=1, name="quarantine1", quarantine=True, **LEASE).start()
        wait_for(
            lambda: self.row(job).status == JobStatus.RUNNING and self.row(job).attempts == 2,
            timeout=30,
            message="the job to start in quarantine",
        )
        q1.kill()
        wait_for(lambda: self.row(job).status == JobStatus.FAILED, timeout=30, message="the poison pill to fail")
        row = self.row(job)
        self.assertEqual(
            (row.error_reason, row.worker_losses, row.quarantine_losses, row.attempts), ("worker_lost", 2, 1, 2)
        )
        self.assertIn("1 of them in quarantine", row.error)
        with WorkerProcess(slots=1, name="quarantine2", quarantine=True, **LEASE):
            time.sleep(2)  # not re-delivered again
        self.assertEqual(self.row(job).attempts, 2)

    def test_the_lane_runs_at_most_its_cap_and_a_job_waiting_for_it_names_the_lane(self) -> None:
        pool_set(quarantine_slots=1)
        _, key = make_tenant("crowded")
        limits = self.client.get("/api/v1/limits", HTTP_AUTHORIZATION=f"Bearer {key}")
        self.assertEqual(limits.json()["pool"]["quarantine_slots"], 1, limits.content)
        jobs = self.quarantine_by_kill(key, count=2, seconds=2.0)
        with WorkerProcess(slots=2, name="quarantine", quarantine=True, **LEASE):

            def one_runs_one_waits() -> bool:
                statuses = sorted(self.row(j).status for j in jobs)
                return statuses == [JobStatus.PARKED, JobStatus.RUNNING]

            wait_for(one_runs_one_waits, timeout=30, message="one job running, one parked on the lane's key")
            waiting = next(j for j in jobs if self.row(j).status == JobStatus.PARKED)
            answer = self.get(key, waiting["id"])
            self.assertEqual(answer["waiting_on"]["lane"], "quarantine", answer)
            self.assertEqual((answer["waiting_on"]["key"], answer["waiting_on"]["limit"]), (QUARANTINE_KEY, 1))
            done = self.wait_all_finished([j["id"] for j in jobs], timeout=60)
        self.assertEqual([r.status for r in done], [JobStatus.SUCCEEDED] * 2)
        self.assertEqual(max_overlap([(r.started_at, r.finished_at) for r in done]), 1, "the cap is one")


class MoveOnRabbitMQTests(RabbitMQBrokerMixin, QuarantineBase):
    """The move and the lane's own queue with RabbitMQ as the broker: there the lane's
    queue is declared by its first publish and by the quarantine worker, not by every worker."""

    test_a_job_its_worker_died_under_runs_again_only_on_a_quarantine_worker = (
        MoveTests.test_a_job_its_worker_died_under_runs_again_only_on_a_quarantine_worker
    )


class ScaleDownTests(QuarantineBase):
    def test_sigterm_through_running_jobs_counts_no_death(self) -> None:
        # A scale-down: the worker is stopped with SIGTERM while its jobs run; the short one
        # ends within the grace period, the long ones are handed back when it ends.
        _, key = make_tenant("scaled")
        # The grace period outlasts a lease, so the leases are renewed through the drain;
        # both leave room for a busy machine (a renewal held up too long fences a job, and
        # that would count as the death this test says never happens).
        lease = {"FAIRQUEUE_LEASE_SECONDS": "2"}
        leaving = WorkerProcess(slots=3, name="leaving", FAIRQUEUE_SHUTDOWN_GRACE_SECONDS="3", **lease).start()
        short = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 1.0}})
        long = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 8.0}}) for _ in range(2)]
        ids = [short["id"], *(j["id"] for j in long)]
        wait_for(
            lambda: Job.objects.filter(id__in=ids, status=JobStatus.RUNNING).count() == 3,
            timeout=30,
            message="the three jobs to run",
        )
        self.assertEqual(leaving.terminate(timeout=30), 0)
        # Past the dead worker's lease: any death would have been counted by now.
        with WorkerProcess(slots=3, name="staying", **lease):
            done = self.wait_all_finished(ids, timeout=60)
        by_id = {str(r.id): r for r in done}
        self.assertEqual([r.status for r in done], [JobStatus.SUCCEEDED] * 3)
        self.assertEqual([(r.worker_losses, r.quarantined) for r in done], [(0, False)] * 3)
        self.assertTrue(by_id[short["id"]].worker.startswith("leaving"))
        for job in long:
            row = by_id[job["id"]]
            self.assertTrue(row.worker.startswith("staying"), row.worker)
            self.assertIn("worker shutting down", row.timeline)


class OperatorTests(QuarantineBase):
    def admin(self) -> Client:
        staff = User.objects.create_superuser("ops", "ops@example.com", "pw")
        client = Client()
        client.force_login(staff)
        return client

    def test_an_operator_lists_the_lane_and_sends_a_job_back_or_fails_it(self) -> None:
        _, key = make_tenant("operated")
        back, failing = self.quarantine_by_kill(key, count=2, seconds=1.0)
        admin = self.admin()
        page = admin.get("/admin/jobs/job/?quarantined=yes")
        self.assertContains(page, back["id"])
        self.assertContains(page, failing["id"])
        resp = admin.post(
            "/admin/jobs/job/", {"action": "quarantine_fail", "_selected_action": [failing["id"]]}, follow=True
        )
        self.assertContains(resp, "Failed 1 quarantined job")
        resp = admin.post(
            "/admin/jobs/job/", {"action": "quarantine_send_back", "_selected_action": [back["id"]]}, follow=True
        )
        self.assertContains(resp, "Sent 1 job")
        # Back in the normal lane: the normal worker left running runs it.
        wait_for(lambda: self.row(back).status == JobStatus.SUCCEEDED, timeout=30, message="run in the normal lane")
        row = self.row(back)
        self.assertEqual((row.quarantined, row.worker_losses, row.attempts), (False, 0, 2))
        self.assertEqual(row.worker, self.sweeper.hostname)
        failed = self.row(failing)
        self.assertEqual((failed.status, failed.error_reason, failed.attempts), (JobStatus.FAILED, OPERATOR_FAILED, 1))
        # A quarantine worker started now finds nothing to run: the failed job's slot was freed.
        with WorkerProcess(slots=1, name="quarantine", quarantine=True, **LEASE):
            time.sleep(2)
        self.assertEqual(self.row(failing).attempts, 1)
        # The actions are compare-and-set: acting on a finished job changes nothing.
        resp = admin.post(
            "/admin/jobs/job/", {"action": "quarantine_send_back", "_selected_action": [failing["id"]]}, follow=True
        )
        self.assertContains(resp, "Sent 0 job")
        self.assertEqual(self.row(failing).status, JobStatus.FAILED)


class DemoTests(QuarantineBase):
    def test_the_hungry_demo_task_is_oom_killed_on_a_lean_worker_and_succeeds_in_quarantine(self) -> None:
        # The demo's deployment: lean normal workers (a memory limit the task passes), a
        # quarantine worker with room. The normal worker dies for real (SIGKILL, as the OOM
        # killer does); a replacement (the deployment's restart) finds it dead and moves it.
        _, key = make_tenant("hungry")
        # A longer lease than the other tests': growing by hundreds of MB on a busy machine
        # can hold up the renewals of a 1 s lease, and a job fenced that way moves without
        # the kill this test is about.
        lease = {"FAIRQUEUE_LEASE_SECONDS": "5"}
        lean = {**lease, "FAIRQUEUE_DEMO_WORKER_MEMORY_MB": str(LEAN_WORKER_MB)}
        with WorkerProcess(slots=1, name="lean", **lean) as first:
            job = self.submit(key, {"task": "demo.hungry", "args": {"mb": HUNGRY_MB}})
            wait_for(
                lambda: first.proc is not None and first.proc.poll() is not None, timeout=60, message="the OOM kill"
            )
        with WorkerProcess(slots=1, name="lean2", **lean):
            wait_for(lambda: self.row(job).quarantined, timeout=30, message="the move to quarantine")
            with WorkerProcess(slots=1, name="roomy", quarantine=True, **lease) as roomy:
                wait_for(lambda: self.row(job).status == JobStatus.SUCCEEDED, timeout=60, message="run in quarantine")
        row = self.row(job)
        self.assertEqual((row.worker, row.attempts, row.worker_losses), (roomy.hostname, 2, 1))
        self.assertGreaterEqual(row.result["peak_rss_mb"], HUNGRY_MB)
        self.assertEqual(LedgerEntry.objects.get(job_id=row.id).writes, 1)


class LaneRoomTests(SimpleTestCase):
    def test_a_shard_may_hold_the_lanes_slots_less_what_the_others_hold(self) -> None:
        held = {"a": 1, "b": 2, "c": 0}
        self.assertEqual(lane_room(slots=4, held_by_shard=held, shard="a"), 2)
        self.assertEqual(lane_room(slots=4, held_by_shard=held, shard="c"), 1)
        self.assertEqual(lane_room(slots=2, held_by_shard=held, shard="a"), 0)  # never below 0
        self.assertEqual(lane_room(slots=2, held_by_shard={}, shard="new"), 2)

    def test_a_tick_gives_the_free_slots_to_one_shard_in_turn(self) -> None:
        shards = ["b", "a", "c"]
        held = {"a": 1, "b": 0, "c": 0}
        turns = [lane_limits(slots=2, held_by_shard=held, shards=shards, turn=t) for t in range(3)]
        self.assertEqual(turns[0], {"a": 2, "b": 0, "c": 0})  # sorted: a's turn first
        self.assertEqual(turns[1], {"a": 1, "b": 1, "c": 0})
        self.assertEqual(turns[2], {"a": 1, "b": 0, "c": 1})
        self.assertTrue(all(sum(t.values()) == 2 for t in turns), "never more than the lane's slots")
        full = {"a": 1, "b": 1}
        self.assertEqual(lane_limits(slots=2, held_by_shard=full, shards=shards, turn=1), {"a": 1, "b": 1, "c": 0})
        # An idle lane: nobody waits there, every shard may take every slot, and nothing moves.
        idle = [lane_limits(slots=2, held_by_shard={}, shards=shards, turn=t) for t in range(3)]
        self.assertEqual(idle, [{"a": 2, "b": 2, "c": 2}] * 3)


class DeathRuleTests(SimpleTestCase):
    """death_outcome, the rule the lease recovery applies to a death it has just counted."""

    def outcome(self, pool: PoolPolicy, *, losses: int, quarantined: bool = False, in_lane: int = 0) -> Death:
        job = Job(worker_losses=losses, quarantine_losses=in_lane, worker="w1@host")
        if quarantined:
            job.quarantined_at = timezone.now()
        return death_outcome(job, pool).death

    def test_the_lane_takes_a_job_after_its_deaths_and_fails_it_after_further_ones_there(self) -> None:
        pool = PoolPolicy(quarantine_after_losses=2, quarantine_poison_losses=2)
        self.assertEqual(self.outcome(pool, losses=1), Death.RETRY)
        self.assertEqual(self.outcome(pool, losses=2), Death.QUARANTINE)
        self.assertEqual(self.outcome(pool, losses=3, quarantined=True, in_lane=1), Death.RETRY)
        self.assertEqual(self.outcome(pool, losses=4, quarantined=True, in_lane=2), Death.POISON)

    def test_a_long_hostname_still_fits_the_reason(self) -> None:
        job = Job(worker_losses=1, worker="w" * 200)
        reason = death_outcome(job, PoolPolicy()).reason
        self.assertEqual(len(reason), Job._meta.get_field("quarantine_reason").max_length)

    @override_settings(FAIRQUEUE=fq(POISON_PILL_LIMIT=3))
    def test_without_the_lane_the_poison_pill_limit_applies(self) -> None:
        pool = PoolPolicy(quarantine_after_losses=0)
        self.assertEqual(self.outcome(pool, losses=2), Death.RETRY)
        self.assertEqual(self.outcome(pool, losses=3), Death.POISON)


class LaneSlotsTests(QuarantineBase):
    def test_a_quarantine_workers_slots_are_the_lanes_and_never_the_pools_room(self) -> None:
        _, key = make_tenant("roomy")
        with (
            WorkerProcess(slots=3, name="normal", **LEASE),
            WorkerProcess(slots=2, name="lane", quarantine=True, **LEASE),
        ):
            wait_for(
                lambda: (fleet_read()["workers"], fleet_read()["quarantine_workers"]) == (1, 1),
                timeout=30,
                message="a normal and a quarantine worker registered",
            )
            fleet = fleet_read()
            self.assertEqual((fleet["slots"], fleet["quarantine_slots"]), (3, 2), fleet)
            lanes = {w["hostname"].split("-")[0]: w["lane"] for w in fleet_workers()}
            self.assertEqual(lanes, {"normal": "", "lane": "quarantine"})
            # The shard's key may hold what the pool's slots run (plus the margin), not the lane's.
            limits = self.client.get("/api/v1/limits", HTTP_AUTHORIZATION=f"Bearer {key}").json()
            self.assertEqual(limits["pool"]["slots"], 3, limits["pool"])
            self.assertEqual(limits["pool"]["room"], 3 + POOL_MARGIN, limits["pool"])
            lane = snapshot_build(with_history=False)["quarantine"]
            self.assertEqual((lane["workers"], lane["worker_slots"]), (1, 2), lane)
            collector_register().invalidate()
            metrics = Client().get("/metrics").content.decode()
            self.assertIn("fairqueue_quarantine_workers 1.0", metrics)
            self.assertIn("fairqueue_worker_slots 3.0", metrics)

    def test_a_quarantined_job_running_in_the_lane_takes_no_room_from_the_pool(self) -> None:
        # Its shard key holds it too (the shard's capacity protects the shard's database),
        # but it runs on the lane's worker: the pool's room stays whole.
        _, key = make_tenant("lanejob")
        (job,) = self.quarantine_by_kill(key, seconds=30.0)
        with WorkerProcess(slots=1, name="lane", quarantine=True, **LEASE):
            wait_for(lambda: self.row(job).status == JobStatus.RUNNING, timeout=30, message="run in quarantine")
            fleet = fleet_state(max_age=0)
            self.assertEqual(fleet.lane_by_shard.get("default"), 1)
            # The shard key's limit: the pool's room whole, the lane's holder on top of it.
            self.assertEqual(fleet.pool_room("default"), fleet.slots + POOL_MARGIN + 1)
            self.assertEqual(fleet.in_flight, 0, "the pool's slots run none of it")

    def test_the_lanes_slots_are_shared_over_the_shards(self) -> None:
        pool_set(quarantine_slots=1)
        _, here = make_tenant("here")
        _, there = make_tenant("there", shard_name="elsewhere")
        victim = WorkerProcess(slots=2, name="victim", **LEASE).start()
        jobs = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 2.0}}) for key in (here, there)]
        ids = [j["id"] for j in jobs]
        wait_for(
            lambda: Job.objects.filter(id__in=ids, status=JobStatus.RUNNING).count() == 2,
            timeout=30,
            message="both jobs to start on the victim",
        )
        victim.kill()
        with WorkerProcess(slots=2, name="normal", **LEASE):
            wait_for(
                lambda: Job.objects.filter(id__in=ids, quarantined_at__isnull=False).count() == 2,
                timeout=30,
                message="both jobs to move to quarantine",
            )
            self.assertEqual({self.row(j).engine_tag for j in jobs}, {shard_tag("default"), shard_tag("elsewhere")})
            with WorkerProcess(slots=2, name="quarantine", quarantine=True, **LEASE):
                done = self.wait_all_finished(ids, timeout=60)
        self.assertEqual([r.status for r in done], [JobStatus.SUCCEEDED] * 2)
        # The runs' own clocks: a release is recorded on the row a moment after the engine
        # has woken the next job, so the rows' times may overlap by that moment.
        runs = [
            (datetime.fromisoformat(r.result["started"]), datetime.fromisoformat(r.result["finished"])) for r in done
        ]
        self.assertEqual(max_overlap(runs), 1, f"one lane slot, two shards: {runs}")
