"""Operations never strand, duplicate or resurrect a job (issue 15): Redis outages, a
rebuild that fails half-way, the reconciler, tenants and shards moved or renamed in the
admin, workers started the way Celery users start them, and every status change raced.

Real Redis servers (a private one where the test stops or breaks it), real worker
processes, a real web server where the client's view matters.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

from django.contrib.auth.models import User
from django.test import Client, override_settings

from fairqueue.bench.stack import WebServer
from fairqueue.jobs.admission import shard_tag, tenant_key
from fairqueue.jobs.broker import BATCH_QUEUE, JOBS_QUEUE, delivery_publish, delivery_route
from fairqueue.jobs.cancellation import job_cancel
from fairqueue.jobs.dispatch import jobs_admit
from fairqueue.jobs.duties import batch_promote
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.models import Job, JobStatus, LedgerEntry
from fairqueue.jobs.recovery import REBUILD_LOCK_PREFIX, reconcile, releases_pending, state_ensure, tag_rebuild
from fairqueue.jobs.runtime import engine, redis_client
from fairqueue.jobs.submission import JobRequest, job_submit, job_submit_bulk
from tenants.models import LatencyClass, Shard, Tenant
from tenants.policy import policy_invalidate, policy_snapshot
from tests.base import RedisTestCase
from tests.factories import make_tenant
from tests.redis_server import RedisServer
from tests.test_jobs_e2e import E2EBase, max_overlap
from tests.workers import LOG_DIR, ROOT, WorkerProcess, wait_for, worker_env

DEAD_REDIS = "redis://127.0.0.1:1/15"  # nothing listens on port 1: a real connection failure
OUTAGE_SUBMIT_EVERY_SECONDS = 1.5
OUTAGE_SECONDS = 10.0
UNACKED_KEY = "fq:celery:unacked"  # kombu's Redis transport: delivered, not yet acknowledged
QUICK = {"seconds": 0.05}
JOB = {"task": "demo.sleep", "args": QUICK}
REBUILD_JOBS = 1500
REBUILD_MEMORY_MARGIN_BYTES = 150_000  # room for the lock and some admissions, not for all


def http_post(base_url: str, path: str, key: str, body: object) -> tuple[int, dict[str, object] | list[object]]:
    request = urllib.request.Request(
        base_url + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


class RedisOutageTests(E2EBase):
    def test_submits_while_redis_is_down_are_all_accepted_and_each_runs_once_when_it_is_back(self) -> None:
        _, key = make_tenant("outage")
        with RedisServer() as private:
            env = worker_env(REDIS_URL=private.url)
            web = WebServer(env=env, log_dir=LOG_DIR).start()
            try:
                with WorkerProcess(slots=2, name="outage", REDIS_URL=private.url):
                    status, first = http_post(web.base_url, "/api/v1/jobs", key, JOB)
                    self.assertEqual(status, 202, first)
                    accepted = [first["id"]]  # type: ignore[call-overload,index]
                    wait_for(lambda: Job.objects.get(id=accepted[0]).status == JobStatus.SUCCEEDED, timeout=30)
                    # ...and acknowledged: kombu cannot restore an unacknowledged message once the
                    # broker is gone and ends the worker (README, Running in production).
                    wait_for(lambda: not private.client().hlen(UNACKED_KEY), timeout=30, message="the ack")
                    private.stop()
                    began = time.monotonic()
                    answers = []
                    while time.monotonic() - began < OUTAGE_SECONDS:
                        sent = time.monotonic()
                        if len(answers) == 2:  # one bulk submit among the single ones
                            status, body = http_post(
                                web.base_url,
                                "/api/v1/jobs/bulk",
                                key,
                                {"jobs": [JOB] * 3},
                            )
                            accepted += [j["id"] for j in body]  # type: ignore[index,union-attr]
                        else:
                            status, body = http_post(
                                web.base_url, "/api/v1/jobs", key, {"task": "demo.sleep", "args": QUICK}
                            )
                            accepted.append(body["id"])  # type: ignore[call-overload,index]
                        answers.append(status)
                        time.sleep(max(0.0, OUTAGE_SUBMIT_EVERY_SECONDS - (time.monotonic() - sent)))
                    self.assertEqual(set(answers), {202}, answers)
                    self.assertGreaterEqual(len(answers), 6)
                    private.start()  # back, and empty
                    self.wait_all_finished(accepted, timeout=120)
            finally:
                web.stop()
        jobs = Job.objects.filter(tenant__slug="outage")
        self.assertEqual(jobs.count(), len(accepted), "rows written = answers that said accepted")
        self.assertEqual(set(jobs.values_list("status", flat=True)), {JobStatus.SUCCEEDED})
        self.assertEqual(sorted(LedgerEntry.objects.values_list("writes", flat=True)), [1] * len(accepted))

    def test_a_cancel_whose_release_cannot_reach_redis_still_cancels_and_frees_the_slot_later(self) -> None:
        tenant, _ = make_tenant("cancelled", max_concurrency=1)
        holder = job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args=QUICK)).job
        waiter = job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args=QUICK)).job
        self.assertEqual((holder.status, waiter.status), (JobStatus.QUEUED, JobStatus.PARKED))
        with override_settings(REDIS_URL=DEAD_REDIS):
            resp = self.client.post(f"/api/v1/jobs/{holder.id}/cancel", HTTP_AUTHORIZATION=f"Bearer {_}")
        self.assertEqual(resp.status_code, 200, resp.content)
        self.assertEqual(resp.json()["status"], "cancelled")
        holder.refresh_from_db()
        self.assertTrue(holder.release_pending)
        self.assertEqual(releases_pending(), 1)  # the tick's reconciler, Redis back
        self.assertEqual(engine().inspect_job(tag=holder.engine_tag, job_id=holder.engine_id).status, "unknown")
        waiter.refresh_from_db()
        self.assertEqual(waiter.status, JobStatus.QUEUED, "the freed slot went to the waiter at once")
        self.assertFalse(Job.objects.get(id=holder.id).release_pending)


class RebuildTests(E2EBase):
    def test_a_rebuild_that_fails_half_way_leaves_the_tag_not_ready_and_the_next_restores_every_job(self) -> None:
        with RedisServer() as private, override_settings(REDIS_URL=private.url):
            policy_invalidate()
            tenant, _ = make_tenant("rebuilt", max_concurrency=2)
            tag = shard_tag(tenant.shard.name)
            jobs = [
                r.job
                for r in job_submit_bulk(tenant=tenant, reqs=[JobRequest(task="demo.sleep", args=QUICK)] * REBUILD_JOBS)
            ]
            Job.objects.filter(id=jobs[0].id).update(status=JobStatus.RUNNING)  # as if a worker had claimed it
            client = private.client()
            client.flushall()  # Redis restarted empty
            policy_invalidate()
            policy_snapshot()  # the policy comes back from the database first
            engine().inspect_key(tag=tag, key=tenant_key("rebuilt"))  # the engine's functions loaded,
            redis_client().ping()  # and every connection the rebuild uses open
            # Writes start failing part of the way through the re-entry of the jobs.
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + REBUILD_MEMORY_MARGIN_BYTES)
            self.assertEqual(state_ensure(), [])
            partly = sum(engine().inspect_job(tag=tag, job_id=j.engine_id).status != "unknown" for j in jobs)
            client.config_set("maxmemory", 0)
            self.assertGreater(partly, 0, "the failure must come part of the way through")
            self.assertLess(partly, REBUILD_JOBS)
            self.assertEqual(engine().ready_tags([tag]), set(), "a failed rebuild must not mark the tag ready")
            self.assertIsNone(client.get(REBUILD_LOCK_PREFIX + tag), "the failed rebuild released its lock")
            self.assertEqual(state_ensure(), [tag])
            self.assertEqual(engine().ready_tags([tag]), {tag})
            states = [engine().inspect_job(tag=tag, job_id=j.engine_id).status for j in jobs]
            self.assertEqual(states, ["admitted", "admitted"] + ["parked"] * (REBUILD_JOBS - 2))
            self.assertEqual(engine().check_invariants(tag=tag), [])

    def test_the_rebuild_lock_is_released_only_by_its_owner(self) -> None:
        tenant, _ = make_tenant("locked")
        tag = shard_tag(tenant.shard.name)
        self.redis.set(REBUILD_LOCK_PREFIX + tag, "someone-else", ex=60)
        self.assertFalse(tag_rebuild(tag=tag, shard=tenant.shard.name))
        self.assertEqual(self.redis.get(REBUILD_LOCK_PREFIX + tag), b"someone-else")
        self.redis.delete(REBUILD_LOCK_PREFIX + tag)
        self.assertTrue(tag_rebuild(tag=tag, shard=tenant.shard.name))
        self.assertIsNone(self.redis.get(REBUILD_LOCK_PREFIX + tag))

    def test_the_reconciler_re_enters_a_parked_job_the_engine_lost(self) -> None:
        tenant, _key = make_tenant("reconciled", max_concurrency=1)
        first = job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args=QUICK)).job
        lost = job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args=QUICK)).job
        self.assertEqual(lost.status, JobStatus.PARKED)
        engine().cancel(tag=lost.engine_tag, job_id=lost.engine_id)  # the engine forgets it; the row does not
        reconcile()  # first sighting: a handoff could be in flight, so nothing yet
        self.assertEqual(engine().inspect_job(tag=lost.engine_tag, job_id=lost.engine_id).status, "unknown")
        for _ in range(3):  # the cursor walks the table; the job is seen missing again
            reconcile()
        self.assertEqual(engine().inspect_job(tag=lost.engine_tag, job_id=lost.engine_id).status, "parked")
        with WorkerProcess(slots=2):
            self.wait_all_finished([first.id, lost.id], timeout=60)
        self.assertEqual(Job.objects.get(id=lost.id).status, JobStatus.SUCCEEDED)


class MoveTests(E2EBase):
    def admin(self) -> Client:
        staff = User.objects.create_superuser(f"ops{uuid.uuid4().hex[:6]}", "ops@example.com", "pw")
        client = Client()
        client.force_login(staff)
        return client

    def tenant_form(self, tenant: Tenant, **changes: object) -> dict[str, object]:
        form: dict[str, object] = {
            "slug": tenant.slug,
            "name": tenant.name,
            "active": "on",
            "shard": tenant.shard_id,
            "floor": tenant.floor,
            "burst_floor": tenant.burst_floor,
            "burst_pct": tenant.burst_pct,
            "max_concurrency": tenant.max_concurrency or "",
            "dedicated": tenant.dedicated,
            "sub_tenant_share": tenant.sub_tenant_share,
            "max_fan_out": tenant.max_fan_out,
            "default_latency_class": tenant.default_latency_class_id or "",
            "sub_tenants-TOTAL_FORMS": 0,
            "sub_tenants-INITIAL_FORMS": 0,
            "sub_tenants-MIN_NUM_FORMS": 0,
            "sub_tenants-MAX_NUM_FORMS": 1000,
        }
        form.update(changes)
        return form

    def test_moving_a_tenant_to_another_shard_runs_every_waiting_job_and_never_two_at_once(self) -> None:
        tenant, key = make_tenant("mover", max_concurrency=1, shard_name="east")
        west = Shard.objects.create(name="west", capacity=10)
        with WorkerProcess(slots=4):
            ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.6}})["id"] for _ in range(6)]
            wait_for(lambda: Job.objects.filter(status=JobStatus.RUNNING).exists(), message="the first job to start")
            admin = self.admin()
            url = f"/admin/tenants/tenant/{tenant.pk}/change/"
            refused = admin.post(url, self.tenant_form(tenant, shard=west.pk))
            self.assertEqual(refused.status_code, 200, "the admin asks before moving")
            self.assertContains(refused, "waiting job(s) will be re-admitted at the new place")
            self.assertEqual(Tenant.objects.get(pk=tenant.pk).shard.name, "east")
            saved = admin.post(url, self.tenant_form(tenant, shard=west.pk, confirm_move="on"))
            self.assertEqual(saved.status_code, 302, saved.content[:2000])
            jobs = self.wait_all_finished(ids, timeout=90)
        self.assertEqual({j.status for j in jobs}, {JobStatus.SUCCEEDED})
        self.assertEqual(max_overlap([(j.started_at, j.finished_at) for j in jobs]), 1)
        self.assertIn(shard_tag("west"), {j.engine_tag for j in jobs}, "waiting jobs moved to the new shard")
        self.assertEqual(sorted(LedgerEntry.objects.values_list("writes", flat=True)), [1] * 6)
        late = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0}})
        self.assertEqual(Job.objects.get(id=late["id"]).engine_tag, shard_tag("west"))

    def test_renaming_a_shard_and_a_tenant_while_jobs_wait_strands_none(self) -> None:
        tenant, key = make_tenant("renamed", max_concurrency=2, shard_name="north")
        ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.3}})["id"] for _ in range(6)]
        shard = tenant.shard
        shard.name = "polar"
        shard.save()
        tenant.refresh_from_db()
        tenant.slug = "renamed-again"
        tenant.save()
        waiting = Job.objects.filter(id__in=ids, status=JobStatus.PARKED)
        self.assertEqual({j.engine_tag for j in waiting}, {shard_tag("polar")})
        self.assertTrue(all(tenant_key("renamed-again") in j.engine_key_names for j in waiting))
        with WorkerProcess(slots=4):
            jobs = self.wait_all_finished(ids, timeout=90)
        self.assertEqual({j.status for j in jobs}, {JobStatus.SUCCEEDED})
        self.assertLessEqual(max_overlap([(j.started_at, j.finished_at) for j in jobs]), 2)


class WorkerCommandTests(E2EBase):
    def test_celery_dash_a_fairqueue_worker_is_a_fairqueue_worker(self) -> None:
        _, key = make_tenant("celery-cli")
        hostname = f"cli-{uuid.uuid4().hex[:6]}@localhost"
        log = (LOG_DIR / f"{hostname.split('@')[0]}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "fairqueue", "worker", "-n", hostname, "-l", "info"],
            cwd=ROOT,
            env=worker_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: self.redis.hget("fq:workers:slots", hostname), timeout=60, message="registration")
            self.assertEqual(int(self.redis.hget("fq:workers:slots", hostname)), 4)  # settings' default slots
            urgent = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0}, "priority": "critical"})
            batch_off = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0}})
            self.wait_all_finished([urgent["id"], batch_off["id"]], timeout=60)
            self.assertEqual(Job.objects.get(id=urgent["id"]).worker, hostname)
        finally:
            proc.terminate()
            proc.wait(30)

    def test_a_worker_of_the_projects_own_queue_is_no_fairqueue_worker(self) -> None:
        """`celery -A <project> worker -Q <its own queue>` consumes none of FairQueue's queues:
        it offers no slots to the fleet and never takes the duty lease."""
        hostname = f"own-{uuid.uuid4().hex[:6]}@localhost"
        log_path = LOG_DIR / f"{hostname.split('@')[0]}.log"
        log = log_path.open("wb")
        argv = ["-m", "celery", "-A", "fairqueue", "worker", "-Q", "project.own", "-n", hostname, "-P", "threads"]
        proc = subprocess.Popen(
            [sys.executable, *argv, "-l", "info"],
            cwd=ROOT,
            env=worker_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: "not a FairQueue worker" in log_path.read_text(), timeout=60, message="worker ready")
            with WorkerProcess(slots=2) as fairqueue_worker:
                wait_for(lambda: self.redis.hget("fq:workers:slots", fairqueue_worker.hostname), message="registered")
                self.assertIsNone(self.redis.hget("fq:workers:slots", hostname))
        finally:
            proc.terminate()
            proc.wait(30)

    def test_a_latency_class_added_or_renamed_in_the_admin_is_run_by_a_running_worker(self) -> None:
        _tenant, key = make_tenant("classy", max_concurrency=1)
        with WorkerProcess(slots=2):
            LatencyClass.objects.create(name="urgent", rank=250, objective_seconds=30)
            wait_for(lambda: "urgent" in policy_snapshot().classes, message="the new class in the policy")
            blocker = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 1.0}})
            new = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0}, "priority": "urgent"})
            self.assertEqual(new["status"], "parked")
            renamed = LatencyClass.objects.get(name="urgent")
            renamed.name = "asap"
            renamed.save()
            jobs = self.wait_all_finished([blocker["id"], new["id"]], timeout=60)
        self.assertEqual({j.status for j in jobs}, {JobStatus.SUCCEEDED})
        self.assertEqual(Job.objects.get(id=new["id"]).latency_class, "asap")


class RaceTests(E2EBase):
    """Every status change is a compare-and-set: both orders of each race, forced."""

    def parked_batch_job(self) -> tuple[Tenant, str, Job]:
        tenant, key = make_tenant("lane", batch_enabled=True)
        job = job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args=QUICK, batch=True)).job
        self.assertEqual(job.status, JobStatus.PARKED)  # no worker: no idle capacity, so it waits
        return tenant, key, job

    def test_cancel_then_promote_the_promotion_loses_and_the_job_never_runs(self) -> None:
        _, _key, job = self.parked_batch_job()
        stale = Job.objects.select_related("tenant").get(id=job.id)  # what the promoter read
        job_cancel(job=Job.objects.get(id=job.id))
        self.assertFalse(batch_promote(stale, policy=policy_snapshot()))
        self.assertEqual(Job.objects.get(id=job.id).status, JobStatus.CANCELLED)
        self.assertEqual(engine().inspect_job(tag=job.engine_tag, job_id=job.engine_id).status, "unknown")

    def test_promote_then_cancel_the_cancel_wins_and_the_job_never_runs(self) -> None:
        _, _key, job = self.parked_batch_job()
        stale = Job.objects.select_related("tenant").get(id=job.id)
        self.assertTrue(batch_promote(stale, policy=policy_snapshot()))
        promoted = Job.objects.get(id=job.id)
        cancelled = job_cancel(job=Job.objects.get(id=job.id))  # holds the old generation's view
        self.assertEqual(cancelled.status, JobStatus.CANCELLED)
        jobs_admit([stale])  # the promoter's admission (its view: queued) arrives after the cancel
        with WorkerProcess(slots=1):
            tag = promoted.engine_tag
            wait_for(
                lambda: engine().inspect_job(tag=tag, job_id=promoted.engine_id).status == "unknown",
                timeout=30,
                message="the cancelled job's slot to be given back",
            )
        self.assertEqual(Job.objects.get(id=job.id).status, JobStatus.CANCELLED)
        self.assertFalse(LedgerEntry.objects.filter(job_id=job.id).exists(), "a cancelled job never runs")


class BulkIntegrityTests(E2EBase):
    def test_a_bulk_submit_the_database_refuses_ends_with_a_clear_error_and_writes_nothing(self) -> None:
        tenant, _ = make_tenant("vanishing")
        Tenant.objects.filter(pk=tenant.pk).delete()  # deleted after the request authenticated
        with self.assertRaises(JobError) as caught:
            job_submit_bulk(tenant=tenant, reqs=[JobRequest(task="demo.sleep", args=QUICK, idempotency_key="k1")])
        self.assertEqual(caught.exception.status, 409)
        self.assertFalse(Job.objects.exists())


class BrokerRoutingTests(RedisTestCase):
    def queued(self, queue: str) -> int:
        """Messages waiting in `queue`, across kombu's per-priority lists."""
        return sum(self.redis.llen(k) for k in self.redis.scan_iter(match=f"fq:celery:{queue}*"))

    def test_a_delivery_lands_in_exactly_one_queue_by_its_route(self) -> None:
        delivery_publish(f"{uuid.uuid4()}.0", delivery_route(level=2, batch=False))
        self.assertEqual((self.queued(JOBS_QUEUE), self.queued(BATCH_QUEUE)), (1, 0))
        delivery_publish(f"{uuid.uuid4()}.0", delivery_route(level=0, batch=True))
        self.assertEqual((self.queued(JOBS_QUEUE), self.queued(BATCH_QUEUE)), (1, 1))
