"""End to end on the real stack: HTTP submit -> engine -> Celery queue -> real worker process."""

from __future__ import annotations

import json
import time
from datetime import datetime

from django.test import Client, override_settings

from fairqueue.jobs import timeline as tl
from fairqueue.jobs.models import Job, JobStatus, LedgerEntry
from fairqueue.jobs.recovery import state_ensure
from tenants.models import Shard, Tenant
from tenants.policy import policy_invalidate
from tests.base import RedisTransactionTestCase
from tests.factories import quarantine_lane_off
from tests.workers import WorkerProcess, kill_all_workers, wait_for


def _tenant(slug: str, **fields: object) -> tuple[Tenant, str]:
    shard, _ = Shard.objects.get_or_create(name="default", defaults={"capacity": 100})
    tenant = Tenant(slug=slug, name=slug.title(), shard=shard, **fields)
    key = tenant.rotate_api_key()
    tenant.save()
    return tenant, key


class E2EBase(RedisTransactionTestCase):
    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        self.client = Client()

    def tearDown(self) -> None:
        kill_all_workers()
        super().tearDown()

    def submit(self, key: str, body: dict[str, object]) -> dict[str, object]:
        resp = self.client.post(
            "/api/v1/jobs", json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
        )
        self.assertIn(resp.status_code, (200, 202), resp.content)
        return resp.json()

    def get(self, key: str, job_id: object) -> dict[str, object]:
        resp = self.client.get(f"/api/v1/jobs/{job_id}", HTTP_AUTHORIZATION=f"Bearer {key}")
        self.assertEqual(resp.status_code, 200, resp.content)
        return resp.json()

    def wait_all_finished(self, ids: list[object], timeout: float = 60) -> list[Job]:
        def done() -> list[Job] | None:
            jobs = list(Job.objects.filter(id__in=ids))
            return jobs if len(jobs) == len(ids) and all(j.finished_at for j in jobs) else None

        return wait_for(done, timeout=timeout, message=f"{len(ids)} jobs to finish")  # type: ignore[no-any-return]


def max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


class JobsEndToEndTests(E2EBase):
    def test_jobs_run_on_a_real_worker_and_report_their_result(self) -> None:
        _, key = _tenant("acme")
        with WorkerProcess(slots=2):
            job = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.05, "echo": "hi"}})
            self.assertEqual(job["status"], "queued")
            wait_for(lambda: self.get(key, job["id"])["status"] == "succeeded", message="job to succeed")
            done = self.get(key, job["id"])
        self.assertEqual(done["result"]["echo"], "hi")
        self.assertTrue(done["result"]["worker"].startswith("test-"))
        for stamp in ("submitted_at", "started_at", "finished_at"):
            datetime.fromisoformat(done[stamp])
        self.assertEqual(LedgerEntry.objects.get(job_id=job["id"]).writes, 1)

    def test_a_tenant_capped_at_two_never_runs_more_than_two(self) -> None:
        _, key = _tenant("capped", max_concurrency=2)
        with WorkerProcess(slots=6):
            ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.3}})["id"] for _ in range(20)]
            self.assertGreaterEqual(Job.objects.filter(status=JobStatus.PARKED).count(), 15)
            jobs = self.wait_all_finished(ids)
        self.assertTrue(all(j.status == JobStatus.SUCCEEDED for j in jobs))
        # The jobs' own clocks, from the task results, not the scheduler's bookkeeping.
        intervals = [
            (datetime.fromisoformat(j.result["started"]), datetime.fromisoformat(j.result["finished"])) for j in jobs
        ]
        self.assertEqual(max_overlap(intervals), 2)

    def test_a_parked_job_takes_no_worker_slot(self) -> None:
        _, key_a = _tenant("flooder", max_concurrency=1)
        _, key_b = _tenant("quiet")
        with WorkerProcess(slots=4):
            flood = [self.submit(key_a, {"task": "demo.sleep", "args": {"seconds": 1.0}})["id"] for _ in range(10)]
            time.sleep(0.3)
            quiet = [self.submit(key_b, {"task": "demo.sleep", "args": {"seconds": 0.5}})["id"] for _ in range(3)]
            jobs = self.wait_all_finished(quiet, timeout=20)
            # All three of B's jobs ran side by side on the three slots A's parked jobs left free.
            self.assertEqual(max_overlap([(j.started_at, j.finished_at) for j in jobs]), 3)
            self.assertLess(
                max(j.finished_at for j in jobs).timestamp() - min(j.submitted_at for j in jobs).timestamp(), 3.0
            )
            self.assertGreaterEqual(Job.objects.filter(id__in=flood, status=JobStatus.PARKED).count(), 5)

    def test_cancelling_a_parked_job_frees_its_place(self) -> None:
        _, key = _tenant("canceller", max_concurrency=1)
        with WorkerProcess(slots=2):
            first = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 1.0}})
            second = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.1}})
            third = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.1}})
            self.assertEqual(self.get(key, third["id"])["waiting_on"]["position"], 2)
            resp = self.client.post(f"/api/v1/jobs/{second['id']}/cancel", HTTP_AUTHORIZATION=f"Bearer {key}")
            self.assertEqual(resp.json()["status"], "cancelled")
            self.assertEqual(self.get(key, third["id"])["waiting_on"]["position"], 1)
            self.wait_all_finished([first["id"], third["id"]])
        self.assertEqual(Job.objects.get(id=second["id"]).status, JobStatus.CANCELLED)
        self.assertFalse(LedgerEntry.objects.filter(job_id=second["id"]).exists())

    def test_higher_latency_classes_run_first(self) -> None:
        _, key = _tenant("ranked")
        with WorkerProcess(slots=1):
            blocker = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 1.0}})
            time.sleep(0.5)  # the single slot is busy: the rest wait in their class queues
            low = [
                self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0}, "priority": "low"})["id"]
                for _ in range(3)
            ]
            crit = [
                self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0}, "priority": "critical"})["id"]
                for _ in range(3)
            ]
            jobs = {j.id: j for j in self.wait_all_finished([blocker["id"], *low, *crit])}
        self.assertLess(
            max(jobs[i].started_at for i in map(_uuid, crit)), min(jobs[i].started_at for i in map(_uuid, low))
        )

    @override_settings(FAIRQUEUE={**__import__("django.conf").conf.settings.FAIRQUEUE, "PAYLOAD_THRESHOLD_BYTES": 2048})
    def test_large_payloads_travel_by_reference(self) -> None:
        _, key = _tenant("bulky")
        big = "x" * 10_000
        with WorkerProcess(slots=1, FAIRQUEUE_PAYLOAD_THRESHOLD_BYTES="2048"):
            job = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0, "echo": big}})
            row = Job.objects.get(id=job["id"])
            self.assertTrue(row.args_ref)
            self.assertEqual(row.args, {})
            wait_for(lambda: self.get(key, job["id"])["status"] == "succeeded", message="big job")
        row.refresh_from_db()
        self.assertTrue(row.result_ref)
        self.assertIsNone(row.result)
        self.assertEqual(self.get(key, job["id"])["result"]["echo"], big)


def _uuid(value: object) -> object:
    import uuid

    return uuid.UUID(str(value))


class WorkerLossTests(E2EBase):
    def test_a_worker_killed_mid_job_still_ends_succeeded_exactly_once(self) -> None:
        _, key = _tenant("fragile")
        quarantine_lane_off()  # this test is about re-delivery to a normal survivor
        lease = {"FAIRQUEUE_LEASE_SECONDS": "2"}
        # The engine's state ready before any submit: a worker's first tick that found it not
        # ready would rebuild it under the job and admit it a second time (its timeline below).
        state_ensure()
        with override_settings(FAIRQUEUE={**__import__("django.conf").conf.settings.FAIRQUEUE, "LEASE_SECONDS": 2.0}):
            victim = WorkerProcess(slots=1, name="victim", **lease).start()
            job = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 1.5}})
            wait_for(lambda: Job.objects.get(id=job["id"]).status == JobStatus.RUNNING, message="job to start")
            victim.kill()
            with WorkerProcess(slots=1, name="survivor", **lease):
                wait_for(
                    lambda: Job.objects.get(id=job["id"]).status == JobStatus.SUCCEEDED, timeout=30, message="re-run"
                )
        row = Job.objects.get(id=job["id"])
        self.assertEqual(row.attempts, 2)
        self.assertEqual(row.worker_losses, 1)
        self.assertTrue(row.worker.startswith("survivor"))
        self.assertEqual(LedgerEntry.objects.get(job_id=row.id).writes, 1)
        # Its timeline on the row tells the story (fairqueue.jobs.timeline).
        self.assertEqual(
            [step.event for step in tl.steps(row.timeline)],
            ["submitted", "admitted", "started", "reclaimed", "admitted", "started", "finished"],
            row.timeline,
        )
