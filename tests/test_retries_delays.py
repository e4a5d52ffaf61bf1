"""Retries with backoff and delayed jobs (issue 23, parts 1 and 2), on a real Redis: the
submit checks, the due promotion and the cancel in process, then real workers for the
whole loop (a transient error retried until success, no barging on re-admission, a delayed
job run on time, a Redis flush while jobs are delayed)."""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from django.contrib.auth import get_user_model
from django.db import connection
from django.test import SimpleTestCase
from django.urls import reverse

from dashboard.snapshot import snapshot_build
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.admission import shard_tag
from fairqueue.jobs.due import due_rows, jobs_promote_due
from fairqueue.jobs.execution import job_execute
from fairqueue.jobs.models import Job, JobStatus, LedgerEntry
from fairqueue.jobs.retry_policy import DEFAULT_RETRY, RetryPolicy
from fairqueue.jobs.runtime import engine
from fairqueue.jobs.stats import stats_read
from tests import lifecycle_tasks
from tests.factories import make_tenant
from tests.lifecycle_tasks import FLAKY_POLICY, TransientError
from tests.test_jobs_api import BULK, JOBS, ApiTestCase
from tests.test_jobs_e2e import E2EBase
from tests.workers import WorkerProcess, wait_for

TASKS = {"FAIRQUEUE_TASK_MODULES": lifecycle_tasks.__name__}
TAG = shard_tag("default")


def _iso(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text)


class RetryPolicyTests(SimpleTestCase):
    def test_backoff_is_full_jitter_under_a_capped_exponential(self) -> None:
        policy = RetryPolicy(max_attempts=10, backoff_base_s=0.5, backoff_cap_s=6.0)
        self.assertEqual([policy.backoff_bound(n) for n in range(1, 7)], [0.5, 1.0, 2.0, 4.0, 6.0, 6.0])
        rng = random.Random(23)
        for failures in range(1, 8):
            bound = policy.backoff_bound(failures)
            draws = [policy.backoff(failures, rng) for _ in range(400)]
            self.assertTrue(all(0.0 <= d <= bound for d in draws), (failures, min(draws), max(draws)))
            # Full jitter spreads over the whole range, not a band near the bound.
            self.assertLess(min(draws), bound * 0.1)
            self.assertGreater(max(draws), bound * 0.9)
        self.assertLessEqual(policy.backoff_bound(10_000), 6.0)  # no overflow far out

    def test_a_policy_retries_only_its_errors(self) -> None:
        self.assertTrue(FLAKY_POLICY.retries(TransientError("x")))
        self.assertFalse(FLAKY_POLICY.retries(ValueError("x")))
        self.assertTrue(RetryPolicy().retries(ValueError("x")))  # default: any Exception

    def test_nonsense_policies_are_refused_at_registration(self) -> None:
        for bad in (
            {"max_attempts": 0},
            {"max_attempts": 101},
            {"backoff_base_s": -1},
            {"backoff_base_s": 10, "backoff_cap_s": 1},
            {"retry_on": ("ValueError",)},
        ):
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                RetryPolicy(**bad)  # type: ignore[arg-type]


class SubmitInputTests(ApiTestCase):
    def test_bad_delays_and_attempt_budgets_are_400s_that_write_nothing(self) -> None:
        soon = _iso(datetime.now(UTC) + timedelta(minutes=5))
        flaky = {"task": "test.flaky", "args": {}}
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"run_at": soon, "delay_seconds": 5}, "invalid_delay", "run_at"),
            ({"run_at": "tomorrow"}, "invalid_run_at", "run_at"),
            ({"run_at": "2030-01-31T09:00:00"}, "invalid_run_at", "run_at"),  # no offset: ambiguous
            ({"run_at": "2999-01-01T00:00:00Z"}, "invalid_run_at", "run_at"),  # past the horizon
            ({"run_at": 1893456000}, "invalid_request", "run_at"),
            ({"delay_seconds": -1}, "invalid_request", "delay_seconds"),
            ({"delay_seconds": "5"}, "invalid_request", "delay_seconds"),
            ({"delay_seconds": True}, "invalid_request", "delay_seconds"),
            ({"delay_seconds": 10**9}, "invalid_request", "delay_seconds"),
            ({"max_attempts": 0}, "invalid_request", "max_attempts"),
            ({"max_attempts": 2.5}, "invalid_request", "max_attempts"),
            # A submit may lower the task's budget, never raise it.
            ({**flaky, "max_attempts": FLAKY_POLICY.max_attempts + 1}, "invalid_max_attempts", "max_attempts"),
            # demo.sleep declares no policy: the default's attempts (transient errors only).
            ({"max_attempts": DEFAULT_RETRY.max_attempts + 1}, "invalid_max_attempts", "max_attempts"),
        ]
        for extra, code, field in cases:
            with self.subTest(extra=extra):
                body = {"task": "demo.sleep", "args": {"seconds": 0}, **extra}
                error = self.assert_error(self.post(JOBS, body), 400, code, field)
                self.assertGreater(len(error["message"]), 10)
        self.assertIn("never raise", self.post(JOBS, {**flaky, "max_attempts": 9}).json()["error"]["message"])
        self.assertEqual(Job.objects.count(), 0)

    def test_a_bulk_with_one_bad_delay_names_it_and_writes_nothing(self) -> None:
        good = {"task": "demo.sleep", "args": {"seconds": 0}, "delay_seconds": 30}
        bad = {"task": "demo.sleep", "args": {"seconds": 0}, "run_at": "31/01/2030"}
        self.assert_error(self.post(BULK, {"jobs": [good, bad]}), 400, "invalid_run_at", "jobs[1].run_at")
        self.assertEqual(Job.objects.count(), 0)

    def test_a_whole_number_with_a_point_is_an_integer_and_any_offset_is_a_time(self) -> None:
        # JSON Schema's integer includes 2.0; RFC 3339 allows offsets PostgreSQL refuses (-19:54).
        job = self.submit({"task": "demo.sleep", "args": {"seconds": 0}, "max_attempts": 2.0})
        self.assertEqual(job["max_attempts"], 2)
        later = datetime.now(UTC) + timedelta(hours=2)
        far_west = later.astimezone(timezone(timedelta(hours=-19, minutes=-54)))
        job = self.submit({"task": "demo.sleep", "args": {"seconds": 0}, "run_at": far_west.isoformat()})
        self.assertEqual(job["status"], "scheduled")
        self.assertLess(abs((_time(job["run_at"]) - later).total_seconds()), 0.001)

    def test_a_run_at_in_the_past_runs_now(self) -> None:
        past = datetime.now(UTC) - timedelta(hours=1)
        job = self.submit({"task": "demo.sleep", "args": {"seconds": 0}, "run_at": _iso(past)})
        self.assertEqual(job["status"], "queued")
        self.assertLess(abs((_time(job["run_at"]) - past).total_seconds()), 0.001)  # JSON keeps milliseconds
        self.assertIsNone(job["next_attempt_at"])
        row = Job.objects.get(id=job["id"])
        self.assertIsNotNone(row.admitted_at)
        self.assertEqual(engine().inspect_job(tag=TAG, job_id=row.engine_id).status, "admitted")
        zero = self.submit({"task": "demo.sleep", "args": {"seconds": 0}, "delay_seconds": 0})
        self.assertEqual(zero["status"], "queued")

    def test_the_openapi_schema_documents_the_new_fields(self) -> None:
        schemas = self.get("/api/v1/openapi.json").json()["components"]["schemas"]
        # A submit's body: each registered task's member of the union (tests/test_api_schema.py).
        job_in, job_out = schemas["DemoSleepJob"]["properties"], schemas["JobOut"]["properties"]
        self.assertIn("date-time", str(job_in["run_at"]))
        for name in ("run_at", "delay_seconds", "max_attempts"):
            self.assertIn("description", job_in[name], name)
        for name in ("max_attempts", "attempt_history", "run_at", "next_attempt_at"):
            self.assertIn(name, job_out)
        self.assertIn("retrying", job_out["status"]["description"])
        self.assertEqual(
            set(schemas["AttemptOut"]["properties"]),
            {"attempt", "worker", "started_at", "finished_at", "duration_s", "status", "error", "error_reason"}
            | {"retry_at"},
        )


class DuePromotionTests(ApiTestCase):
    """The due promotion and the cancel, run in this process (no worker: deliveries of
    admitted jobs sit unconsumed in the broker, and `job_execute` runs one by hand)."""

    def later(self, seconds: float) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=seconds)

    def test_a_delayed_job_holds_nothing_until_due_then_is_admitted(self) -> None:
        job = self.submit({"task": "demo.sleep", "args": {"seconds": 0}, "delay_seconds": 60})
        self.assertEqual(job["status"], "scheduled")
        self.assertIsNotNone(job["next_attempt_at"])
        row = Job.objects.get(id=job["id"])
        self.assertIsNone(row.admitted_at)
        self.assertEqual(engine().inspect_job(tag=TAG, job_id=row.engine_id).status, "unknown")
        self.assertEqual(jobs_promote_due(), 0)  # not due yet
        self.assertEqual(self.job(job["id"])["status"], "scheduled")
        self.assertEqual(jobs_promote_due(now=self.later(61)), 1)
        row.refresh_from_db()
        self.assertEqual((row.status, row.generation), (JobStatus.QUEUED, 0))
        self.assertEqual(engine().inspect_job(tag=TAG, job_id=row.engine_id).status, "admitted")

    def test_due_jobs_enter_admission_in_due_order_behind_those_already_waiting(self) -> None:
        _, key = self.tenant_with("single", max_concurrency=1)
        body = {"task": "demo.sleep", "args": {"seconds": 0}}
        holder = self.submit(body, key=key)
        waiting = self.submit(body, key=key)
        self.assertEqual((holder["status"], waiting["status"]), ("queued", "parked"))
        base = datetime.now(UTC) + timedelta(seconds=30)
        # Submitted latest-due first: the promotion must order them by due time.
        delayed = [
            self.submit({**body, "run_at": _iso(base + timedelta(milliseconds=ms))}, key=key)["id"]
            for ms in (30, 20, 10)
        ]
        self.assertEqual(jobs_promote_due(now=base + timedelta(seconds=1)), 3)
        positions = [self.job(i, key=key)["waiting_on"]["position"] for i in [waiting["id"], *reversed(delayed)]]
        self.assertEqual(positions, [1, 2, 3, 4])

    def test_a_delayed_job_waits_on_the_dashboard_from_its_due_time_not_its_submission(self) -> None:
        _, key = self.tenant_with("late", max_concurrency=1)
        self.submit({"task": "demo.sleep", "args": {"seconds": 0}}, key=key)  # holds the only slot
        job = self.submit({"task": "demo.sleep", "args": {"seconds": 0}, "delay_seconds": 60}, key=key)
        # Submitted two hours ago for a time that came a second ago.
        now = datetime.now(UTC)
        Job.objects.filter(id=job["id"]).update(
            submitted_at=now - timedelta(hours=2), due_at=now - timedelta(seconds=1)
        )
        self.assertEqual(jobs_promote_due(), 1)
        self.assertEqual(self.job(job["id"], key=key)["status"], "parked")
        late = next(t for t in snapshot_build(with_history=False)["tenants"] if t["slug"] == "late")
        self.assertLess(late["oldest_wait_s"], 600)

    def test_cancelling_a_delayed_job(self) -> None:
        job = self.submit({"task": "demo.sleep", "args": {"seconds": 0}, "delay_seconds": 60})
        response = self.post(f"{JOBS}/{job['id']}/cancel")
        self.assertEqual(response.status_code, 200, response.content)
        self.assertEqual(response.json()["status"], "cancelled")
        self.assertEqual(jobs_promote_due(now=self.later(120)), 0)
        row = Job.objects.get(id=job["id"])
        self.assertEqual(row.status, JobStatus.CANCELLED)
        self.assertEqual(engine().inspect_job(tag=TAG, job_id=row.engine_id).status, "unknown")
        self.assertEqual(self.post(f"{JOBS}/{job['id']}/cancel").status_code, 409)

    def run_delivery(self, job_id: str) -> str:
        row = Job.objects.get(id=job_id)
        return job_execute(job_id=job_id, generation=row.generation, worker="in-process")

    def test_a_retry_is_a_new_delivery_and_an_exhausted_budget_ends_failed(self) -> None:
        job = self.submit({"task": "test.flaky", "args": {"fail_times": 9}, "max_attempts": 2})
        self.assertEqual(job["max_attempts"], 2)
        self.assertEqual(self.run_delivery(job["id"]), "retrying")
        row = Job.objects.get(id=job["id"])
        self.assertEqual((row.status, row.finished_at, row.attempt_failures), (JobStatus.RETRYING, None, 1))
        self.assertIn("TransientError", row.error)
        # Its slot was given back on failure; it waits for its time outside the engine.
        self.assertEqual(engine().inspect_job(tag=TAG, job_id=row.engine_id).status, "unknown")
        self.assertEqual(jobs_promote_due(now=row.due_at + timedelta(milliseconds=1)), 1)
        row.refresh_from_db()
        self.assertEqual((row.status, row.generation), (JobStatus.QUEUED, 1))
        self.assertEqual(self.run_delivery(job["id"]), "failed")
        done = self.job(job["id"])
        self.assertEqual(done["status"], "failed")
        self.assertEqual([a["status"] for a in done["attempt_history"]], ["failed", "failed"])
        self.assertIn("attempt 2", done["attempt_history"][-1]["error"])
        self.assertIn("attempt 2", done["error"])
        self.assertIsNone(done["attempt_history"][-1]["retry_at"])
        self.assertIsNotNone(done["finished_at"])
        # Its timeline: the failed attempt and the retry it scheduled, the re-admission when
        # due, and `finished` only once, for the terminal failure.
        steps = tl.steps(Job.objects.get(id=job["id"]).timeline)
        self.assertEqual(
            [s.event for s in steps],
            [
                tl.SUBMITTED,
                tl.ADMITTED,
                tl.STARTED,
                tl.ATTEMPT_FAILED,
                tl.RETRY_SCHEDULED,
                tl.ADMITTED,
                tl.STARTED,
                tl.FINISHED,
            ],
        )
        self.assertEqual(steps[3].detail, "1 exception")
        due_ms = row.due_at.replace(microsecond=row.due_at.microsecond // 1000 * 1000)  # the line's precision
        self.assertEqual(datetime.fromisoformat(steps[4].detail), due_ms)
        self.assertEqual(steps[-1].detail, "failed")

    def test_cancelling_a_retrying_job(self) -> None:
        job = self.submit({"task": "test.flaky_patient", "args": {"fail_times": 9}})
        self.assertEqual(self.run_delivery(job["id"]), "retrying")
        retrying = self.job(job["id"])
        self.assertEqual(retrying["status"], "retrying")
        self.assertGreater(_time(retrying["next_attempt_at"]), datetime.now(UTC))
        self.assertEqual(self.post(f"{JOBS}/{job['id']}/cancel").json()["status"], "cancelled")
        self.assertEqual(jobs_promote_due(now=self.later(7200)), 0)
        self.assertEqual(Job.objects.get(id=job["id"]).status, JobStatus.CANCELLED)

    def test_the_admin_job_page_lists_each_attempt(self) -> None:
        job = self.submit({"task": "test.flaky_patient", "args": {"fail_times": 9}})
        self.run_delivery(job["id"])
        staff = get_user_model().objects.create_superuser("ops", "ops@example.com", "pw-not-used-123")
        self.client.force_login(staff)
        page = self.client.get(reverse("admin:jobs_job_change", args=[job["id"]]))
        self.assertContains(page, "attempt 1: the dependency timed out")
        self.assertContains(page, '<table class="attempts">')
        self.assertContains(
            self.client.get(reverse("admin:jobs_job_changelist"), {"status__exact": "retrying"}), job["id"]
        )

    def test_the_due_read_is_a_range_of_the_due_index(self) -> None:
        sql, params = due_rows(datetime.now(UTC)).query.sql_with_params()
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SET LOCAL enable_seqscan = off")  # an empty table: force the plan a big one gets
                cursor.execute(f"EXPLAIN {sql}", params)
            else:
                cursor.execute(f"EXPLAIN QUERY PLAN {sql}", params)
            plan = " ".join(str(row) for row in cursor.fetchall())
        self.assertIn("job_deferred_due", plan)


class RetryEndToEndTests(E2EBase):
    def test_transient_errors_are_retried_with_backoff_and_others_fail_at_once(self) -> None:
        _, key = make_tenant("retrier")
        with WorkerProcess(slots=3, name="retry", **TASKS):
            flaky = self.submit(key, {"task": "test.flaky", "args": {"fail_times": 2}})["id"]
            broken = self.submit(key, {"task": "test.flaky", "args": {"permanent": True}})["id"]
            lowered = self.submit(key, {"task": "test.flaky", "args": {"fail_times": 9}, "max_attempts": 2})["id"]
            jobs = {str(j.id): j for j in self.wait_all_finished([flaky, broken, lowered], timeout=60)}
            api = self.get(key, flaky)
        ok = jobs[flaky]
        self.assertEqual(ok.status, JobStatus.SUCCEEDED)
        self.assertEqual((ok.attempts, ok.worker_losses, ok.error), (3, 0, ""))
        self.assertEqual(ok.result["attempt"], 3)
        history = api["attempt_history"]
        self.assertEqual([a["status"] for a in history], ["failed", "failed", "succeeded"])
        self.assertEqual([a["attempt"] for a in history], [1, 2, 3])
        self.assertTrue(all(a["duration_s"] >= 0 for a in history))
        for n, (attempt, following) in enumerate(itertools.pairwise(history), start=1):
            self.assertIn("TransientError", attempt["error"])
            wait = (_time(attempt["retry_at"]) - _time(attempt["finished_at"])).total_seconds()
            self.assertGreaterEqual(wait, 0)
            self.assertLessEqual(wait, FLAKY_POLICY.backoff_bound(n) + 1e-3)
            self.assertGreaterEqual(_time(following["started_at"]), _time(attempt["retry_at"]))
        self.assertIsNone(history[-1]["error"])

        self.assertEqual(jobs[broken].status, JobStatus.FAILED)
        self.assertEqual(len(jobs[broken].attempt_history), 1)
        self.assertIn("PermanentError", jobs[broken].error)

        self.assertEqual(jobs[lowered].status, JobStatus.FAILED)
        self.assertEqual([a["status"] for a in jobs[lowered].attempt_history], ["failed", "failed"])

    def test_an_attempt_past_its_timeout_is_retried_per_the_policy(self) -> None:
        _, key = make_tenant("timed")
        with WorkerProcess(slots=2, name="timed", **TASKS):
            job_id = self.submit(key, {"task": "test.slow_first", "args": {}})["id"]
            (job,) = self.wait_all_finished([job_id], timeout=60)
        self.assertEqual(job.status, JobStatus.SUCCEEDED, job.error)
        self.assertEqual(job.result, {"attempt": 2})
        self.assertEqual([a["status"] for a in job.attempt_history], ["failed", "succeeded"])
        self.assertIn("TaskTimeout", job.attempt_history[0]["error"])

    def test_a_retry_waits_its_turn_behind_jobs_already_parked(self) -> None:
        _, key = make_tenant("narrow", max_concurrency=1)
        with WorkerProcess(slots=3, name="turn", **TASKS):
            # Fails once after half a second; its retry is due within 0.2 s of that.
            flaky = self.submit(key, {"task": "test.flaky", "args": {"fail_times": 1, "seconds": 0.5}})["id"]
            wait_for(lambda: Job.objects.get(id=flaky).status == JobStatus.RUNNING, message="the flaky job to start")
            others = [
                self.submit(key, {"task": "test.flaky", "args": {"seconds": 1.0}})["id"] for _ in range(3)
            ]  # parked behind it at the limit of 1
            # Back in admission, it parks behind the three: it does not barge.
            wait_for(
                lambda: Job.objects.filter(id=flaky, status=JobStatus.PARKED, generation=1).exists(),
                interval=0.01,
                message="the retry to park",
            )
            jobs = {str(j.id): j for j in self.wait_all_finished([flaky, *others], timeout=60)}
        self.assertTrue(all(j.status == JobStatus.SUCCEEDED for j in jobs.values()), jobs)
        retry_start = _time(jobs[flaky].attempt_history[1]["started_at"])
        self.assertGreater(retry_start, max(jobs[i].started_at for i in others))
        intervals = [
            (_time(a["started_at"]), _time(a["finished_at"])) for j in jobs.values() for a in j.attempt_history
        ]
        intervals.sort()
        for (_, end), (start, _) in itertools.pairwise(intervals):
            self.assertLessEqual(end, start, "two attempts ran at once at a limit of 1")


class DelayEndToEndTests(E2EBase):
    def test_a_delayed_job_runs_not_before_its_time_and_soon_after(self) -> None:
        _, key = make_tenant("patient")
        with WorkerProcess(slots=2, name="delay"):
            run_at = datetime.now(UTC) + timedelta(seconds=3)
            by_time = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0}, "run_at": _iso(run_at)})
            by_delay = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0}, "delay_seconds": 2})
            self.assertEqual((by_time["status"], by_delay["status"]), ("scheduled", "scheduled"))
            jobs = self.wait_all_finished([by_time["id"], by_delay["id"]], timeout=60)
            # Each promotion observes how late it was (/metrics), folded into Redis within a heartbeat.
            wait_for(lambda: stats_read().get("due_lateness:count") == 2.0, message="the lateness histogram")
        for job in jobs:
            self.assertEqual(job.status, JobStatus.SUCCEEDED)
            self.assertGreaterEqual(job.started_at, job.run_at)
            self.assertLess((job.started_at - job.run_at).total_seconds(), 15, "started long after its time")
            self.assertEqual(LedgerEntry.objects.get(job_id=job.id).writes, 1)

    def test_a_redis_flush_while_jobs_are_delayed_loses_none(self) -> None:
        _, key = make_tenant("flushed")
        with WorkerProcess(slots=2, name="flush"):
            ids = [
                self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0}, "delay_seconds": 3})["id"]
                for _ in range(5)
            ]
            self.assertEqual(Job.objects.filter(id__in=ids, status=JobStatus.SCHEDULED).count(), 5)
            self.redis.flushdb()  # Redis restarted with nothing on disk
            jobs = self.wait_all_finished(ids, timeout=60)
        self.assertTrue(all(j.status == JobStatus.SUCCEEDED for j in jobs), [j.status for j in jobs])
        self.assertEqual(sorted(LedgerEntry.objects.filter(job_id__in=ids).values_list("writes", flat=True)), [1] * 5)
