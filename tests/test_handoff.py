"""Slot handoff (issue 19): the worker whose release freed a slot runs the woken job in it,
with no broker message, unless something waits in the broker first, the worker does not
read that job's queue, or it is shutting down; and a fault on the way strands nothing.
When the release wakes nothing, the slot pulls the broker's next delivery itself, the one
the worker's fetch would take, under the same conditions.

Real Redis, real worker processes; the Redis fault is a real connection failure.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.test import override_settings
from kombu import Message

from fairqueue.celery import app
from fairqueue.engine import Woken
from fairqueue.jobs import execution
from fairqueue.jobs.admission import PRIORITY_LEVELS, tenant_key
from fairqueue.jobs.broker import (
    BATCH_QUEUE,
    BATCH_ROUTE,
    JOBS_QUEUE,
    RUN_TASK_NAME,
    deliveries_ahead,
    delivery_publish,
    delivery_route,
    delivery_unpull,
    run_job_target,
)
from fairqueue.jobs.handoff import handoff_disable, handoff_enable, handoff_stop, inline_pick, next_delivery
from fairqueue.jobs.models import Job, JobStatus, LedgerEntry
from fairqueue.jobs.recovery import jobs_admit_pending, state_ensure
from fairqueue.jobs.runtime import engine
from fairqueue.jobs.stats import stats_read
from fairqueue.jobs.submission import JobRequest, job_submit
from tests.base import RedisTestCase
from tests.factories import make_tenant, quarantine_lane_off
from tests.test_jobs_e2e import E2EBase, max_overlap
from tests.workers import WorkerProcess, wait_for

DEAD_REDIS = "redis://127.0.0.1:1/15"  # nothing listens on port 1: a real connection failure
BOTH_QUEUES = [JOBS_QUEUE, BATCH_QUEUE]
CHAIN_JOBS = 5
INSPECT_TIMEOUT_SECONDS = 5.0
PULLED_JOBS = 12
OTHER_TASK = "tests.not_a_job"  # a task name no worker here registers: only its message matters


def broker_messages() -> int:
    """Deliveries waiting in the broker, across both queues and kombu's priority lists."""
    client = engine().client
    return sum(client.llen(k) for k in client.scan_iter(match="fq:celery:fq.*"))


def deliveries_received(hostname: str) -> int:
    """How many broker deliveries of the job task the worker has taken (Celery's own count)."""
    replies = app.control.inspect([hostname], timeout=INSPECT_TIMEOUT_SECONDS).stats() or {}
    return int(replies.get(hostname, {}).get("total", {}).get("fairqueue.run_job", 0))


class BrokerBacklogTests(RedisTestCase):
    """What a worker would fetch before a delivery published now, on the real broker."""

    def test_a_class_waits_behind_itself_and_higher_classes_only(self) -> None:
        self.assertFalse(deliveries_ahead(delivery_route(level=3, batch=False), BOTH_QUEUES))
        delivery_publish("00000000-0000-0000-0000-000000000001.0", delivery_route(level=3, batch=False))
        self.assertTrue(deliveries_ahead("3", BOTH_QUEUES), "the same class, published earlier")
        self.assertTrue(deliveries_ahead("7", BOTH_QUEUES), "a lower class")
        self.assertFalse(deliveries_ahead("2", BOTH_QUEUES), "a higher class goes first")
        self.assertTrue(deliveries_ahead(BATCH_ROUTE, BOTH_QUEUES), "the batch lane goes after every class")

    def test_a_worker_fetches_every_class_before_the_batch_lane(self) -> None:
        batch_job, low_class_job = "00000000-0000-0000-0000-000000000003", "00000000-0000-0000-0000-000000000004"
        delivery_publish(f"{batch_job}.0", BATCH_ROUTE)
        delivery_publish(f"{low_class_job}.0", delivery_route(level=PRIORITY_LEVELS - 1, batch=False))
        fetched: list[str] = []

        def take(body: list[list[object]], message: Message) -> None:
            fetched.append(str(body[0][0]))
            message.ack()

        # The fetch a worker makes: one BRPOP over every (queue, level) list.
        conn = app.connection_for_read()
        with conn, conn.Consumer(list(app.amqp.queues.values()), callbacks=[take], accept=["json"]):
            while len(fetched) < 2:
                conn.drain_events(timeout=5)
        self.assertEqual(fetched, [low_class_job, batch_job])

    def test_a_waiting_batch_delivery_is_ahead_of_a_batch_job_only_for_a_worker_reading_the_lane(self) -> None:
        delivery_publish("00000000-0000-0000-0000-000000000002.0", BATCH_ROUTE)
        self.assertTrue(deliveries_ahead(BATCH_ROUTE, BOTH_QUEUES))
        self.assertFalse(deliveries_ahead("0", BOTH_QUEUES), "the highest class goes before the lane")
        self.assertFalse(deliveries_ahead("0", [JOBS_QUEUE]))


class InlinePickTests(RedisTestCase):
    """The pick itself, in this process, against the real broker."""

    def tearDown(self) -> None:
        handoff_disable()
        super().tearDown()

    def woken(self, *routes: str) -> list[Woken]:
        return [Woken(job_id=f"00000000-0000-0000-0000-00000000000{i}.0", data=r) for i, r in enumerate(routes)]

    def test_outside_a_worker_nothing_runs_inline(self) -> None:
        self.assertIsNone(inline_pick(self.woken("2")))

    def test_the_highest_class_woken_is_the_one_run_here(self) -> None:
        handoff_enable(lambda: BOTH_QUEUES)
        woken = self.woken("5", BATCH_ROUTE, "2")
        self.assertEqual(inline_pick(woken), woken[2])

    def test_a_batch_job_is_not_run_by_a_worker_that_leaves_the_lane_to_others(self) -> None:
        handoff_enable(lambda: [JOBS_QUEUE])
        self.assertIsNone(inline_pick(self.woken(BATCH_ROUTE)))
        handoff_enable(lambda: BOTH_QUEUES)
        self.assertIsNotNone(inline_pick(self.woken(BATCH_ROUTE)))

    def test_a_delivery_waiting_in_the_broker_goes_first(self) -> None:
        handoff_enable(lambda: BOTH_QUEUES)
        delivery_publish("00000000-0000-0000-0000-0000000000ff.0", "4")
        self.assertIsNone(inline_pick(self.woken("4")), "published earlier, same class")
        self.assertIsNotNone(inline_pick(self.woken("3")), "a higher class than what waits")

    def test_a_worker_shutting_down_starts_nothing_inline(self) -> None:
        handoff_enable(lambda: BOTH_QUEUES)
        handoff_stop()
        self.assertIsNone(inline_pick(self.woken("2")))


def third_running(ids: list[object]) -> bool:
    """Two of the jobs done and the third running (a worker's chain, one slot)."""
    return (
        Job.objects.filter(id__in=ids, status=JobStatus.SUCCEEDED).count() == 2
        and Job.objects.filter(id__in=ids, status=JobStatus.RUNNING).exists()
    )


def assert_each_ran_once_one_lost(case: E2EBase, jobs: list[Job]) -> None:
    """After a worker was killed under one of the jobs: all succeeded, each side effect
    written once, one job counted a worker loss, never two running at once."""
    case.assertEqual({j.status for j in jobs}, {JobStatus.SUCCEEDED})
    case.assertEqual(sorted(LedgerEntry.objects.values_list("writes", flat=True)), [1] * len(jobs))
    case.assertEqual(sorted(j.worker_losses for j in jobs), [0] * (len(jobs) - 1) + [1])
    case.assertEqual(max_overlap([(j.started_at, j.finished_at) for j in jobs]), 1)


def job_engine_id(n: int) -> str:
    return f"00000000-0000-0000-0000-{n:012d}.0"


def first_fetched() -> str:
    """The task of the message a worker's fetch (one BRPOP over every list) takes next;
    the message is acknowledged and gone."""
    fetched: list[str] = []

    def take(body: object, message: Message) -> None:
        fetched.append(str(message.headers["task"]))
        message.ack()

    conn = app.connection_for_read()
    with conn, conn.Consumer(list(app.amqp.queues.values()), callbacks=[take], accept=["json"]):
        conn.drain_events(timeout=5)
    return fetched[0]


class PullTests(RedisTestCase):
    """The pull itself, in this process, against the real broker."""

    def tearDown(self) -> None:
        handoff_disable()
        super().tearDown()

    def test_outside_a_worker_nothing_is_pulled(self) -> None:
        delivery_publish(job_engine_id(1), "3")
        self.assertIsNone(next_delivery())
        self.assertEqual(broker_messages(), 1)

    def test_a_slot_pulls_what_the_worker_would_fetch_next_class_by_class_then_the_lane(self) -> None:
        handoff_enable(lambda: BOTH_QUEUES)
        delivery_publish(job_engine_id(1), BATCH_ROUTE)
        delivery_publish(job_engine_id(2), "5")
        delivery_publish(job_engine_id(3), "2")
        delivery_publish(job_engine_id(4), "5")
        pulled = [next_delivery() for _ in range(4)]
        self.assertEqual(
            [(p.job_id, p.generation) if p else None for p in pulled],
            [(job_engine_id(n)[:-2], 0) for n in (3, 2, 4, 1)],
            "the highest class first, in publishing order within a class, the batch lane last",
        )
        self.assertIsNone(next_delivery(), "nothing left")
        self.assertEqual(broker_messages(), 0)
        self.assertEqual(self.redis.hlen("fq:celery:unacked"), 0, "a pulled delivery is not kombu's to restore")

    def test_a_worker_that_leaves_the_batch_lane_to_others_pulls_nothing_from_it(self) -> None:
        handoff_enable(lambda: [JOBS_QUEUE])
        delivery_publish(job_engine_id(1), BATCH_ROUTE)
        self.assertIsNone(next_delivery())
        self.assertEqual(broker_messages(), 1)

    def test_a_worker_shutting_down_or_running_all_it_offers_pulls_nothing(self) -> None:
        delivery_publish(job_engine_id(1), "1")
        handoff_enable(lambda: BOTH_QUEUES, may_start=lambda: False)
        self.assertIsNone(next_delivery(), "the worker runs as many jobs as it offers")
        handoff_enable(lambda: BOTH_QUEUES)
        handoff_stop()
        self.assertIsNone(next_delivery(), "warm shutdown")
        self.assertEqual(broker_messages(), 1)

    def test_another_task_s_message_goes_back_where_the_worker_s_fetch_takes_it_next(self) -> None:
        handoff_enable(lambda: BOTH_QUEUES)
        app.send_task(OTHER_TASK, queue=JOBS_QUEUE, priority=1)
        delivery_publish(job_engine_id(1), "1")  # the same list, behind it
        self.assertIsNone(next_delivery(), "not a job's delivery: left to Celery's consumer")
        self.assertEqual(broker_messages(), 2)
        self.assertEqual(first_fetched(), OTHER_TASK)
        pulled = next_delivery()
        self.assertEqual(pulled.job_id if pulled else None, job_engine_id(1)[:-2])

    def test_a_delivery_with_an_eta_is_left_to_celery_s_consumer(self) -> None:
        handoff_enable(lambda: BOTH_QUEUES)
        app.send_task(RUN_TASK_NAME, args=[job_engine_id(1)[:-2], 0], queue=JOBS_QUEUE, priority=1, countdown=60)
        self.assertIsNone(next_delivery())
        self.assertEqual(broker_messages(), 1)

    def test_a_pulled_delivery_put_back_is_the_next_one_fetched(self) -> None:
        handoff_enable(lambda: BOTH_QUEUES)
        delivery_publish(job_engine_id(1), "4")
        delivery_publish(job_engine_id(2), "4")
        pulled = next_delivery()
        self.assertIsNotNone(pulled)
        assert pulled is not None
        delivery_unpull(pulled)
        again = next_delivery()
        self.assertEqual(again.job_id if again else None, job_engine_id(1)[:-2])

    def test_a_pull_after_the_broker_dropped_every_connection_still_takes_the_next_delivery(self) -> None:
        handoff_enable(lambda: BOTH_QUEUES)
        delivery_publish(job_engine_id(1), "3")
        self.assertIsNotNone(next_delivery())
        self.redis.client_kill_filter(_type="normal", skipme=True)  # the pull's kept connections too
        delivery_publish(job_engine_id(2), "3")
        pulled = next_delivery()
        self.assertEqual(pulled.job_id if pulled else None, job_engine_id(2)[:-2])

    def test_the_job_is_read_from_every_way_celery_may_write_the_message(self) -> None:
        job_id = job_engine_id(7)[:-2]
        handoff_enable(lambda: BOTH_QUEUES)
        app.send_task(RUN_TASK_NAME, args=[job_id, 3], queue=JOBS_QUEUE, priority=2)
        app.send_task(RUN_TASK_NAME, kwargs={"job_id": job_id, "generation": 4}, queue=JOBS_QUEUE, priority=2)
        first, second = next_delivery(), next_delivery()
        self.assertEqual((first.job_id, first.generation) if first else None, (job_id, 3))
        self.assertEqual((second.job_id, second.generation) if second else None, (job_id, 4))
        self.assertIsNone(run_job_target(b"not json"))
        self.assertIsNone(run_job_target(b'{"headers": {"task": "fairqueue.run_job"}, "body": "[]"}'))


class PullEndToEndTests(E2EBase):
    def test_a_slot_runs_the_broker_s_deliveries_one_after_another_under_one_consumer_delivery(self) -> None:
        _, key = make_tenant("pulled", floor=PULLED_JOBS)  # none waits on a limit
        ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.05}})["id"] for _ in range(PULLED_JOBS)]
        self.assertEqual(broker_messages(), PULLED_JOBS, "every job waits in the broker before a worker starts")
        with WorkerProcess(slots=1, name="puller") as worker:
            jobs = self.wait_all_finished(ids)
            self.assertEqual(deliveries_received(worker.hostname), 1, "the others were pulled by the slot")
            wait_for(lambda: stats_read().get("delivery:pulled") == PULLED_JOBS - 1, message="the pulls counted")
            wait_for(lambda: not self.redis.hlen("fq:celery:unacked"), message="the one delivery acknowledged")
        self.assertEqual({j.status for j in jobs}, {JobStatus.SUCCEEDED})
        self.assertEqual([j.attempts for j in jobs], [1] * PULLED_JOBS)
        starts = [j.started_at for j in sorted(jobs, key=lambda j: j.submitted_at)]
        self.assertEqual(starts, sorted(starts), "run in the order they were published")
        self.assertEqual(sorted(LedgerEntry.objects.values_list("writes", flat=True)), [1] * PULLED_JOBS)
        self.assertEqual(broker_messages(), 0)

    def test_with_pulls_off_every_delivery_goes_through_celery_s_consumer(self) -> None:
        _, key = make_tenant("unpulled", floor=CHAIN_JOBS)
        ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.05}})["id"] for _ in range(CHAIN_JOBS)]
        with WorkerProcess(slots=1, name="nopull", FAIRQUEUE_PULL_DELIVERIES="0") as worker:
            jobs = self.wait_all_finished(ids)
            self.assertEqual(deliveries_received(worker.hostname), CHAIN_JOBS)
        self.assertEqual({j.status for j in jobs}, {JobStatus.SUCCEEDED})
        self.assertNotIn("delivery:pulled", stats_read())

    def test_a_worker_killed_while_running_a_pulled_job_runs_no_job_twice_and_strands_none(self) -> None:
        _, key = make_tenant("pullkill", floor=CHAIN_JOBS)
        quarantine_lane_off()  # this test is about re-delivery to a normal survivor
        env = {"FAIRQUEUE_LEASE_SECONDS": "1", "FAIRQUEUE_VISIBILITY_TIMEOUT": "2"}
        ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.6}})["id"] for _ in range(CHAIN_JOBS)]
        with override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "LEASE_SECONDS": 1.0}):
            victim = WorkerProcess(slots=1, name="pvictim", **env).start()
            wait_for(lambda: third_running(ids), message="the third job, pulled, running")
            self.assertEqual(deliveries_received(victim.hostname), 1, "the second and third were pulled")
            victim.kill()
            time.sleep(3)  # past the visibility timeout: the next worker restores the first job's message
            with WorkerProcess(slots=1, name="prescuer", **env):
                jobs = self.wait_all_finished(ids)
                wait_for(lambda: not self.redis.hlen("fq:celery:unacked"), message="every delivery acknowledged")
        assert_each_ran_once_one_lost(self, jobs)
        self.assertEqual(broker_messages(), 0)


class HandoffEndToEndTests(E2EBase):
    def test_jobs_woken_by_releases_run_in_the_releasing_slot_under_one_broker_delivery(self) -> None:
        _, key = make_tenant("chain", max_concurrency=1)
        with WorkerProcess(slots=2, name="chain") as worker:
            ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.3}})["id"] for _ in range(CHAIN_JOBS)]
            self.assertEqual(Job.objects.filter(id__in=ids, status=JobStatus.PARKED).count(), CHAIN_JOBS - 1)
            jobs = self.wait_all_finished(ids)
            self.assertEqual(deliveries_received(worker.hostname), 1, "the woken jobs never went through the broker")
            wait_for(
                lambda: stats_read().get("handoff:inline") == CHAIN_JOBS - 1,
                message="the inline handoffs counted",
            )
        by_id = {str(j.id): j for j in jobs}
        ordered = [by_id[str(i)] for i in ids]
        self.assertEqual([j.status for j in ordered], [JobStatus.SUCCEEDED] * CHAIN_JOBS)
        self.assertEqual({j.worker for j in ordered}, {worker.hostname})
        self.assertEqual([j.attempts for j in ordered], [1] * CHAIN_JOBS)
        starts = [j.started_at for j in ordered]
        self.assertEqual(starts, sorted(starts), "woken in submission order")
        self.assertEqual(max_overlap([(j.started_at, j.finished_at) for j in ordered]), 1)
        for job in ordered[1:]:
            self.assertIsNotNone(job.admitted_at)
            self.assertGreaterEqual(job.started_at, job.admitted_at)
        self.assertEqual(sorted(LedgerEntry.objects.values_list("writes", flat=True)), [1] * CHAIN_JOBS)

    def test_a_worker_in_warm_shutdown_publishes_the_job_its_last_release_wakes(self) -> None:
        _, key = make_tenant("leaving", max_concurrency=1)
        # The engine's state ready before any submit: a worker's first tick that found it not
        # ready would rebuild it under the jobs and publish the first a second time.
        state_ensure()
        worker = WorkerProcess(slots=1, name="leaving", FAIRQUEUE_SHUTDOWN_GRACE_SECONDS="10").start()
        try:
            first = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 1.5}})["id"]
            second = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.1}})["id"]
            wait_for(lambda: Job.objects.get(id=first).status == JobStatus.RUNNING, message="first start")
            self.assertEqual(worker.terminate(timeout=20), 0)
        finally:
            worker.kill()
        row = Job.objects.get(id=second)
        self.assertEqual((row.status, row.attempts, row.worker), (JobStatus.QUEUED, 0, ""))
        self.assertIsNotNone(row.admitted_at, "handed its slot and published")
        self.assertEqual(broker_messages(), 1)
        with WorkerProcess(slots=1, name="next"):
            jobs = self.wait_all_finished([first, second])
        by_id = {str(j.id): j for j in jobs}
        self.assertEqual(by_id[str(first)].status, JobStatus.SUCCEEDED)
        self.assertTrue(by_id[str(first)].worker.startswith("leaving"))
        self.assertEqual(by_id[str(second)].status, JobStatus.SUCCEEDED)
        self.assertTrue(by_id[str(second)].worker.startswith("next"))

    def test_a_redis_error_between_the_release_and_the_inline_start_leaves_the_job_to_the_pending_sweep(self) -> None:
        tenant, _ = make_tenant("fault", max_concurrency=1)
        first = job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args={"seconds": 0.05})).job
        second = job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args={"seconds": 0.05})).job
        self.assertEqual((first.status, second.status), (JobStatus.QUEUED, JobStatus.PARKED))
        self.assertEqual(app.control.purge(), 1)  # this process takes the first job's delivery
        handoff_enable(lambda: BOTH_QUEUES)
        try:
            outcome, kept = execution._delivery_run(
                job_id=str(first.id), generation=first.generation, worker="here", keep=inline_pick
            )
            self.assertEqual(outcome, "succeeded")
            self.assertEqual(kept.job_id if kept else None, second.engine_id)
            self.assertEqual(Job.objects.get(id=second.id).status, JobStatus.PARKED, "not marked queued: run here")
            self.assertEqual(broker_messages(), 0, "and not published")
            with override_settings(REDIS_URL=DEAD_REDIS):
                outcome, kept = execution._delivery_run(
                    job_id=str(second.id), generation=second.generation, worker="here", keep=inline_pick
                )
        finally:
            handoff_disable()
        self.assertEqual((outcome, kept), ("engine_unreachable", None))
        row = Job.objects.get(id=second.id)
        self.assertEqual((row.status, row.admitted_at, row.attempts), (JobStatus.QUEUED, None, 0))
        self.assertEqual(jobs_admit_pending(older_than=0), 1)  # the next tick, Redis back
        self.assertEqual(broker_messages(), 1, "the engine still held its slot: published at once")
        with WorkerProcess(slots=1, name="after"):
            wait_for(lambda: Job.objects.get(id=second.id).status == JobStatus.SUCCEEDED, message="second runs")
            row = Job.objects.get(id=second.id)
            # The worker releases the slot just after it records the outcome: poll, don't race
            # it, and keep the worker alive meanwhile (killed first, it would leave the hold to
            # its lease's expiry).
            wait_for(
                lambda: (
                    engine().counts(tag=row.engine_tag, keys=[tenant_key("fault")]).get(tenant_key("fault"), 0) == 0
                ),
                timeout=30,
                message="no hold left behind",
            )
        self.assertEqual((row.attempts, row.worker_losses), (1, 0))
        self.assertEqual(LedgerEntry.objects.get(job_id=second.id).writes, 1)

    def test_a_worker_killed_mid_chain_runs_no_job_twice_and_its_redelivered_message_is_skipped(self) -> None:
        _, key = make_tenant("killed", max_concurrency=1)
        quarantine_lane_off()  # this test is about re-delivery to a normal survivor
        env = {"FAIRQUEUE_LEASE_SECONDS": "1", "FAIRQUEUE_VISIBILITY_TIMEOUT": "2"}
        with override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "LEASE_SECONDS": 1.0}):
            victim = WorkerProcess(slots=1, name="victim", **env).start()
            ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.6}})["id"] for _ in range(CHAIN_JOBS)]
            wait_for(lambda: third_running(ids), message="the third job of the chain running")
            self.assertEqual(deliveries_received(victim.hostname), 1, "the whole chain under one delivery")
            self.assertEqual(self.redis.hlen("fq:celery:unacked"), 1, "not acknowledged until the chain ends")
            victim.kill()
            time.sleep(3)  # past the visibility timeout: the next worker restores the chain's message
            with WorkerProcess(slots=1, name="rescuer", **env) as rescuer:
                jobs = self.wait_all_finished(ids)
                wait_for(lambda: "'skipped'" in rescuer.log_path.read_text(), message="the old delivery skipped")
                wait_for(lambda: not self.redis.hlen("fq:celery:unacked"), message="every delivery acknowledged")
        assert_each_ran_once_one_lost(self, jobs)
