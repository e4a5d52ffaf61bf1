"""Faults on the real stack: Redis loses its data or is unreachable, workers are stopped
gracefully or killed repeatedly. Every accepted job still ends in one terminal state."""

from __future__ import annotations

import time

from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client, override_settings

from fairqueue.jobs.admission import shard_tag
from fairqueue.jobs.models import Job, JobStatus, LedgerEntry
from fairqueue.jobs.runtime import engine
from tests.factories import make_tenant, quarantine_lane_off
from tests.test_jobs_e2e import E2EBase, max_overlap
from tests.workers import WorkerProcess, wait_for

DEAD_REDIS = "redis://127.0.0.1:1/15"
TAG = shard_tag("default")  # make_tenant's shard  # nothing listens on port 1: a real connection failure


def fq(**overrides: object) -> dict[str, object]:
    return {**settings.FAIRQUEUE, **overrides}


class RedisLossTests(E2EBase):
    def test_a_flushed_redis_is_rebuilt_and_every_job_runs_once_in_order(self) -> None:
        _, key = make_tenant("survivor", max_concurrency=1)
        with WorkerProcess(slots=2):
            ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.4}})["id"] for _ in range(6)]
            wait_for(lambda: Job.objects.filter(status=JobStatus.RUNNING).exists(), message="first job running")
            wait_for(lambda: engine().ready_tags([TAG]), message="the worker to mark the state built")
            self.redis.flushdb()  # Redis restarted with nothing on disk
            jobs = self.wait_all_finished(ids, timeout=60)
            wait_for(lambda: engine().ready_tags([TAG]), message="state rebuilt marker")
        self.assertTrue(all(j.status == JobStatus.SUCCEEDED for j in jobs), [j.status for j in jobs])
        self.assertEqual(sorted(LedgerEntry.objects.values_list("writes", flat=True)), [1] * 6)
        by_id = {str(j.id): j for j in jobs}
        starts = [by_id[str(i)].started_at for i in ids]
        self.assertEqual(starts, sorted(starts), "parked jobs must be re-entered in submission order")

    def test_a_newcomer_after_a_flush_waits_for_the_job_the_engine_forgot(self) -> None:
        # Redis loses its data while a job holds the tenant's only slot: the web process must
        # not admit a newcomer into the empty engine state before a worker has rebuilt it.
        _, key = make_tenant("forgotten", max_concurrency=1)
        with WorkerProcess(slots=2):
            first = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 3.0}})["id"]
            wait_for(lambda: Job.objects.get(id=first).status == JobStatus.RUNNING, message="first job running")
            wait_for(lambda: engine().ready_tags([TAG]), message="the worker to mark the state built")
            self.redis.flushdb()
            second = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.5}})
            self.assertEqual(second["status"], "queued")
            self.assertIsNone(Job.objects.get(id=second["id"]).admitted_at)
            jobs = self.wait_all_finished([first, second["id"]], timeout=60)
        self.assertTrue(all(j.status == JobStatus.SUCCEEDED for j in jobs), [j.status for j in jobs])
        by_id = {str(j.id): j for j in jobs}
        a, b = by_id[str(first)], by_id[str(second["id"])]
        self.assertEqual(max_overlap([(a.started_at, a.finished_at), (b.started_at, b.finished_at)]), 1)
        self.assertGreaterEqual(b.started_at, a.finished_at)

    def test_jobs_accepted_while_redis_is_unreachable_run_when_it_is_back(self) -> None:
        _, key = make_tenant("patient")
        self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0}})  # this process now knows the policy
        with override_settings(REDIS_URL=DEAD_REDIS):
            started = time.monotonic()
            job = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0, "echo": "later"}})
            self.assertLess(time.monotonic() - started, 10)
        self.assertEqual(job["status"], "queued")
        self.assertIsNone(Job.objects.get(id=job["id"]).admitted_at)
        with WorkerProcess(slots=1):
            wait_for(lambda: self.get(key, job["id"])["status"] == "succeeded", timeout=30, message="late job")
        self.assertEqual(self.get(key, job["id"])["result"]["echo"], "later")

    def test_without_any_known_policy_an_unreachable_redis_is_a_503_that_writes_nothing(self) -> None:
        from tenants.policy import policy_invalidate

        _, key = make_tenant("unlucky")
        policy_invalidate()
        with override_settings(REDIS_URL=DEAD_REDIS):
            resp = Client().post(
                "/api/v1/jobs",
                {"task": "demo.sleep", "args": {"seconds": 0}},
                content_type="application/json",
                HTTP_AUTHORIZATION=f"Bearer {key}",
            )
        self.assertEqual(resp.status_code, 503)
        self.assertEqual(resp["Retry-After"], "5")
        self.assertEqual(resp.json()["error"]["code"], "unavailable")
        self.assertFalse(Job.objects.exists())


class WorkerShutdownTests(E2EBase):
    def test_sigterm_lets_a_short_job_finish_on_the_same_worker(self) -> None:
        _, key = make_tenant("graceful")
        worker = WorkerProcess(slots=1, name="leaving", FAIRQUEUE_SHUTDOWN_GRACE_SECONDS="10").start()
        try:
            job = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 1.0}})
            wait_for(lambda: Job.objects.get(id=job["id"]).status == JobStatus.RUNNING, message="start")
            self.assertEqual(worker.terminate(timeout=20), 0)
        finally:
            worker.kill()
        row = Job.objects.get(id=job["id"])
        self.assertEqual((row.status, row.attempts, row.worker_losses), (JobStatus.SUCCEEDED, 1, 0))
        self.assertEqual(self.redis.hlen("fq:workers:slots"), 0, "a stopped worker leaves the fleet")

    def test_sigterm_hands_back_a_job_that_outlives_the_grace_period_without_counting_a_loss(self) -> None:
        _, key = make_tenant("handback")
        worker = WorkerProcess(slots=1, name="leaving", FAIRQUEUE_SHUTDOWN_GRACE_SECONDS="1").start()
        try:
            job = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 4.0}})
            wait_for(lambda: Job.objects.get(id=job["id"]).status == JobStatus.RUNNING, message="start")
            began = time.monotonic()
            worker.terminate(timeout=20)
            self.assertLess(time.monotonic() - began, 10)
        finally:
            worker.kill()
        self.assertEqual(Job.objects.get(id=job["id"]).status, JobStatus.QUEUED)
        with WorkerProcess(slots=1, name="next"):
            wait_for(lambda: Job.objects.get(id=job["id"]).status == JobStatus.SUCCEEDED, timeout=30, message="rerun")
        row = Job.objects.get(id=job["id"])
        self.assertEqual((row.attempts, row.worker_losses), (2, 0))
        self.assertTrue(row.worker.startswith("next"))
        self.assertEqual(LedgerEntry.objects.get(job_id=row.id).writes, 1)


class PoisonPillTests(E2EBase):
    def test_a_job_that_kills_its_workers_fails_as_worker_lost_and_can_be_retried(self) -> None:
        _, key = make_tenant("poison")
        quarantine_lane_off()  # the poison-pill limit without the lane (tests.test_quarantine has the lane's)
        env = {"FAIRQUEUE_LEASE_SECONDS": "1", "FAIRQUEUE_POISON_PILL_LIMIT": "2"}
        with override_settings(FAIRQUEUE=fq(LEASE_SECONDS=1.0, POISON_PILL_LIMIT=2)):
            job = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 30}})
            for attempt in (1, 2):
                victim = WorkerProcess(slots=1, name=f"victim{attempt}", **env).start()
                wait_for(
                    lambda a=attempt: Job.objects.filter(id=job["id"], status=JobStatus.RUNNING, attempts=a).exists(),
                    timeout=30,
                    message=f"attempt {attempt} to start",
                )
                victim.kill()
            with WorkerProcess(slots=1, name="sweeper", **env):  # its sweep reclaims the second loss
                wait_for(lambda: Job.objects.get(id=job["id"]).status == JobStatus.FAILED, timeout=30, message="fail")
                row = Job.objects.get(id=job["id"])
                self.assertEqual((row.error_reason, row.worker_losses), ("worker_lost", 2))
                time.sleep(2)  # not re-delivered again
                self.assertEqual(Job.objects.get(id=job["id"]).attempts, 2)
                # An operator shortens the job and retries it from the admin.
                Job.objects.filter(id=job["id"]).update(args={"seconds": 0})
                staff = User.objects.create_superuser("ops", "ops@example.com", "pw")
                admin = Client()
                admin.force_login(staff)
                self.assertContains(admin.get("/admin/jobs/job/?error_reason=worker_lost"), job["id"])
                resp = admin.post("/admin/jobs/job/", {"action": "retry_jobs", "_selected_action": [job["id"]]})
                self.assertEqual(resp.status_code, 302)
                wait_for(
                    lambda: Job.objects.get(id=job["id"]).status == JobStatus.SUCCEEDED, timeout=30, message="retry"
                )
