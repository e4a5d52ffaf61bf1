"""Isolated tasks and timeouts (fairqueue/jobs/isolation.py, JobContext.check_deadline).

On real workers: a task that spins forever and one that allocates without bound are killed
at their limits, in their child processes, while quick jobs on the same worker go on and
succeed; the failed jobs say why (`timeout`, `memory_limit`) in the API. A task that is
not isolated is stopped cooperatively at its timeout. A job may lower its task's timeout
at submit, never raise it. The pool itself, driven directly: a child told its hold is lost
stops (or is killed), and is replaced after a kill.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import datetime
from typing import Any

from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from dashboard.metrics import collector_register
from fairqueue.jobs.api import api
from fairqueue.jobs.demo_tasks import PARSE_TIMEOUT_SECONDS
from fairqueue.jobs.isolation import IsolatedPool
from fairqueue.jobs.models import Job, JobStatus, LedgerEntry
from fairqueue.jobs.registry import HoldLost, JobContext
from fairqueue.jobs.task_limits import TaskTimeout
from tenants.policy import policy_invalidate
from tests import worker_tasks  # noqa: F401  (the test process submits the workers' tasks)
from tests.base import RedisTestCase, RedisTransactionTestCase
from tests.factories import make_tenant
from tests.worker_tasks import GROW_MEMORY_LIMIT_MB, SPIN_TIMEOUT_SECONDS
from tests.workers import WorkerProcess, wait_for

JOBS = "/api/v1/jobs"
TASKS = "tests.worker_tasks"
FINISHED = {JobStatus.SUCCEEDED, JobStatus.FAILED}


class _Api:
    """Submit and read jobs through the REST API with the tenant's key."""

    client: Client
    key: str

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(
            JOBS, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {self.key}"
        )
        assert response.status_code == 202, response.content
        return response.json()  # type: ignore[no-any-return]

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.client.get(f"{JOBS}/{job_id}", HTTP_AUTHORIZATION=f"Bearer {self.key}")
        assert response.status_code == 200, response.content
        return response.json()  # type: ignore[no-any-return]

    def attempts_failed(self) -> dict[str, float]:
        """fairqueue_task_attempts_failed_total by reason, as /metrics shows it."""
        collector_register().invalidate()
        text = self.client.get("/metrics").content.decode()
        family = next(f for f in text_string_to_metric_families(text) if f.name == "fairqueue_task_attempts_failed")
        return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}

    def finished(self, job_id: str) -> dict[str, Any] | None:
        job = self.job(job_id)
        return job if job["status"] in FINISHED else None


class IsolatedOnWorkerTests(_Api, RedisTransactionTestCase):
    serialized_rollback = True  # the latency classes the migrations seed survive the flush

    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        self.tenant, self.key = make_tenant("acme", floor=8, max_concurrency=8)
        policy_invalidate()
        self.client = Client(raise_request_exception=False)

    def test_runaway_tasks_are_killed_at_their_limits_while_quick_jobs_on_the_worker_succeed(self) -> None:
        with WorkerProcess(
            slots=4, name="iso", FAIRQUEUE_TASK_MODULES=TASKS, FAIRQUEUE_ISOLATED_POOL_SIZE="3"
        ) as worker:
            spin = self.submit({"task": "test.spin", "args": {"seconds": 600}})
            grow = self.submit({"task": "test.grow", "args": {"chunk_mb": 8}})
            # One that lifts its own address-space cap: the worker's watch on its memory stops it.
            uncapped = self.submit({"task": "test.grow", "args": {"chunk_mb": 8, "lift_cap": True}})
            wait_for(lambda: self.job(spin["id"])["status"] == "running", timeout=60, message="the spin to start")
            # While the runaway spins in its child, the worker's other slots run quick jobs.
            quick = [self.submit({"task": "demo.sleep", "args": {"seconds": 0.2}})["id"] for _ in range(3)]
            for job_id in quick:
                wait_for(lambda job_id=job_id: self.finished(job_id), timeout=60, message="a quick job")

            spun = wait_for(lambda: self.finished(spin["id"]), timeout=120, message="the spin to be killed")
            grown = wait_for(lambda: self.finished(grow["id"]), timeout=120, message="the growth to be stopped")
            watched = wait_for(lambda: self.finished(uncapped["id"]), timeout=120, message="the growth to be killed")

            self.assertEqual((spun["status"], spun["error_reason"]), ("failed", "timeout"), spun["error"])
            self.assertIn("timeout", spun["error"])
            self.assertIn("killed", spun["error"])
            self.assertEqual(spun["timeout_seconds"], SPIN_TIMEOUT_SECONDS)
            ran = _seconds(spun["started_at"], spun["finished_at"])
            self.assertGreaterEqual(ran, SPIN_TIMEOUT_SECONDS)
            self.assertLess(ran, SPIN_TIMEOUT_SECONDS + 60, "killed at its limit, not after the 600 s it asked for")

            self.assertEqual((grown["status"], grown["error_reason"]), ("failed", "memory_limit"), grown["error"])
            self.assertIn(f"{GROW_MEMORY_LIMIT_MB:g} MiB", grown["error"])
            self.assertIn("needed more than its limit", grown["error"], "the address-space cap refused it")
            self.assertEqual((watched["status"], watched["error_reason"]), ("failed", "memory_limit"), watched["error"])
            self.assertIn("its process was killed", watched["error"], "the worker's memory watch killed it")

            for job_id in quick:
                done = self.job(job_id)
                self.assertEqual(done["status"], "succeeded", done["error"])
                # They finished while the spin was still running: nothing waited for it.
                self.assertGreater(_seconds(done["finished_at"], spun["finished_at"]), 0)
            self.assertIsNone(worker.proc.poll() if worker.proc else None, "the worker itself lives on")
            for row in Job.objects.filter(id__in=[spin["id"], grow["id"], uncapped["id"], *quick]):
                self.assertEqual((row.worker, row.attempts, row.worker_losses), (worker.hostname, 1, 0))

            # The pool replaced the killed children: isolated work goes on on the same worker.
            parse = self.submit({"task": "demo.parse", "args": {"pages": 3, "io_ms_per_page": 1}})
            parsed = wait_for(lambda: self.finished(parse["id"]), timeout=120, message="a parse after the kills")
            self.assertEqual(parsed["status"], "succeeded", parsed["error"])
            self.assertEqual(parsed["timeout_seconds"], PARSE_TIMEOUT_SECONDS)
            self.assertEqual(LedgerEntry.objects.get(job_id=parse["id"]).writes, 1, "the child wrote its ledger once")
            # /metrics counts the failed attempts by reason (the worker folds its counts in each heartbeat).
            counted = wait_for(
                lambda: (c := self.attempts_failed())["timeout"] and c["memory_limit"] == 2 and c,
                timeout=60,
                message="the failures counted in /metrics",
            )
            self.assertEqual((counted["timeout"], counted["memory_limit"], counted["crashed"]), (1, 2, 0))

    def test_an_isolated_task_runs_in_a_child_and_its_result_or_error_comes_back(self) -> None:
        with WorkerProcess(slots=2, name="iso", FAIRQUEUE_TASK_MODULES=TASKS) as worker:
            ok = self.submit({"task": "test.isolated_info", "args": {}, "timeout_seconds": 30})
            bad = self.submit({"task": "test.isolated_info", "args": {"fail": True}})
            done = wait_for(lambda: self.finished(ok["id"]), timeout=120, message="the isolated job")
            failed = wait_for(lambda: self.finished(bad["id"]), timeout=120, message="the failing isolated job")
            self.assertEqual(done["status"], "succeeded", done["error"])
            assert worker.proc is not None
            self.assertNotEqual(done["result"]["pid"], worker.proc.pid, "it ran in a child process")
            self.assertEqual((done["result"]["attempt"], done["result"]["timeout"]), (1, 30))
            self.assertEqual(done["timeout_seconds"], 30)
            self.assertEqual((failed["status"], failed["error_reason"]), ("failed", "exception"))
            self.assertIn("ValueError: asked to fail on attempt 1", failed["error"])
            self.assertIn("Raised in the isolated process", failed["error"])

    def test_a_task_that_is_not_isolated_is_stopped_at_its_timeout(self) -> None:
        with WorkerProcess(slots=2, name="coop"):
            late = self.submit({"task": "demo.sleep", "args": {"seconds": 600}, "timeout_seconds": 1})
            in_time = self.submit({"task": "demo.sleep", "args": {"seconds": 0.1}, "timeout_seconds": 30})
            stopped = wait_for(lambda: self.finished(late["id"]), timeout=120, message="the timeout")
            self.assertEqual((stopped["status"], stopped["error_reason"]), ("failed", "timeout"), stopped["error"])
            self.assertIn("TaskTimeout: timeout", stopped["error"])
            self.assertLess(_seconds(stopped["started_at"], stopped["finished_at"]), 60)
            self.assertFalse(LedgerEntry.objects.filter(job_id=late["id"]).exists(), "stopped before its side effect")
            done = wait_for(lambda: self.finished(in_time["id"]), timeout=120, message="the job within its limit")
            self.assertEqual(done["status"], "succeeded", done["error"])


class TimeoutSubmitTests(_Api, RedisTestCase):
    """A job may lower its task's timeout at submit, never raise it (no workers here)."""

    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, self.key = make_tenant("acme")
        policy_invalidate()
        self.client = Client(raise_request_exception=False)

    def post(self, body: dict[str, Any]) -> Any:
        return self.client.post(JOBS, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {self.key}")

    def test_a_lower_timeout_is_kept_and_shown(self) -> None:
        job = self.submit({"task": "demo.parse", "args": {"pages": 1}, "timeout_seconds": 5})
        self.assertEqual(job["timeout_seconds"], 5)
        self.assertEqual(Job.objects.get(id=job["id"]).timeout_seconds, 5)
        default = self.submit({"task": "demo.parse", "args": {"pages": 1}})
        self.assertEqual(default["timeout_seconds"], PARSE_TIMEOUT_SECONDS)
        self.assertIsNone(Job.objects.get(id=default["id"]).timeout_seconds)
        # A task without a limit of its own takes any limit the job asks for.
        self.assertEqual(
            self.submit({"task": "demo.sleep", "args": {"seconds": 1}, "timeout_seconds": 7200})["timeout_seconds"],
            7200,
        )
        self.assertIsNone(self.submit({"task": "demo.sleep", "args": {"seconds": 1}})["timeout_seconds"])

    def test_raising_the_task_timeout_or_a_bad_value_is_a_400_and_writes_nothing(self) -> None:
        response = self.post({"task": "demo.parse", "args": {"pages": 1}, "timeout_seconds": PARSE_TIMEOUT_SECONDS + 1})
        self.assertEqual(response.status_code, 400, response.content)
        error = response.json()["error"]
        self.assertEqual((error["code"], error["field"]), ("invalid_timeout", "timeout_seconds"))
        self.assertIn(f"at most {PARSE_TIMEOUT_SECONDS:g} s", error["message"])
        bulk = self.client.post(
            f"{JOBS}/bulk",
            {
                "jobs": [
                    {"task": "demo.sleep", "args": {"seconds": 1}},
                    {"task": "demo.parse", "args": {"pages": 1}, "timeout_seconds": 1e6},
                ]
            },
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {self.key}",
        )
        self.assertEqual(bulk.status_code, 400, bulk.content)
        self.assertEqual(bulk.json()["error"]["field"], "jobs[1].timeout_seconds")
        for bad in (0, -1, "soon", True):
            response = self.post({"task": "demo.sleep", "args": {"seconds": 1}, "timeout_seconds": bad})
            self.assertEqual(response.status_code, 400, (bad, response.content))
            self.assertIn("timeout_seconds", response.json()["error"]["message"])
        self.assertFalse(Job.objects.exists(), "nothing written")

    def test_the_openapi_schema_documents_the_fields(self) -> None:
        schemas = api.get_openapi_schema()["components"]["schemas"]
        # Each registered task's submit body says it (the union's members: tests/test_api_schema.py).
        submit = schemas["DemoSleepJob"]["properties"]
        self.assertIn("lower the task's own limit", submit["timeout_seconds"]["description"])
        self.assertIn("memory_limit", schemas["JobOut"]["properties"]["error_reason"]["description"])
        self.assertIn("timeout_seconds", schemas["JobOut"]["properties"])


class IsolatedPoolTests(RedisTestCase):
    """The pool driven directly from this process, with real child processes (they set
    Django up from this process's settings; the tasks used write nothing to a database)."""

    def setUp(self) -> None:
        super().setUp()
        # The children import the test tasks too (they read the setting from the environment).
        modules = os.environ.get("FAIRQUEUE_TASK_MODULES")
        os.environ["FAIRQUEUE_TASK_MODULES"] = TASKS
        self.addCleanup(_env_restore, "FAIRQUEUE_TASK_MODULES", modules)
        self.pool = IsolatedPool(1)
        self.addCleanup(self.pool.stop)
        self.lost = threading.Event()

    def ctx(self, timeout: float | None = None) -> JobContext:
        return JobContext(job_id="j", attempt=1, worker="w", generation=1, timeout_seconds=timeout).bind_hold(
            self.lost.is_set
        )

    def test_a_child_told_its_hold_is_lost_stops_and_is_kept(self) -> None:
        self.assertIsNone(self.pool.run(task="demo.noop", raw_args={}, ctx=self.ctx(), memory_limit_mb=None))
        first = self.children()  # started: the hold is lost while the task runs, not while it starts
        threading.Timer(1.0, self.lost.set).start()
        started = time.monotonic()
        with self.assertRaises(HoldLost):
            # demo.sleep checks its hold every 0.1 s.
            self.pool.run(task="demo.sleep", raw_args={"seconds": 600}, ctx=self.ctx(), memory_limit_mb=None)
        self.assertLess(time.monotonic() - started, 60)
        self.assertEqual(self.children(), first, "the child stopped by itself and went back to the pool")
        self.lost.clear()
        value = self.pool.run(task="demo.noop", raw_args={}, ctx=self.ctx(), memory_limit_mb=None)
        self.assertIsNone(value)
        self.assertEqual(self.children(), first, "the same child ran the next task")

    def test_a_child_that_ignores_the_stop_is_killed_after_the_grace_and_replaced(self) -> None:
        self.assertIsNone(self.pool.run(task="demo.noop", raw_args={}, ctx=self.ctx(), memory_limit_mb=None))
        first = self.children()
        threading.Timer(1.0, self.lost.set).start()
        with self.assertRaises(HoldLost):
            # One page every 10 s: the task does not look at its hold within the grace.
            self.pool.run(
                task="demo.parse",
                raw_args={"pages": 2, "io_ms_per_page": 10_000},
                ctx=self.ctx(),
                memory_limit_mb=None,
            )
        self.assertEqual(self.children(), [], "killed, not returned to the pool")
        self.lost.clear()
        self.assertIsNone(self.pool.run(task="demo.noop", raw_args={}, ctx=self.ctx(), memory_limit_mb=None))
        self.assertEqual(len(self.children()), 1, "a new child took its place")
        self.assertNotEqual(self.children(), first)

    def test_a_cooperative_task_stops_itself_at_its_deadline_before_the_kill(self) -> None:
        started = time.monotonic()
        with self.assertRaises(TaskTimeout) as caught:
            self.pool.run(task="demo.sleep", raw_args={"seconds": 600}, ctx=self.ctx(timeout=1.0), memory_limit_mb=None)
        self.assertLess(time.monotonic() - started, 60)
        self.assertIn("Raised in the isolated process", "".join(getattr(caught.exception, "__notes__", [])))
        self.assertEqual(len(self.children()), 1, "it stopped by itself: the child is kept")

    def test_a_sigterm_to_the_child_does_not_end_its_task(self) -> None:
        """A service manager stopping a worker signals its whole group: the worker drains,
        and its children must not die under their tasks meanwhile."""
        self.assertIsNone(self.pool.run(task="demo.noop", raw_args={}, ctx=self.ctx(), memory_limit_mb=None))
        (pid,) = self.children()
        threading.Timer(1.0, os.kill, args=(pid, signal.SIGTERM)).start()
        value = self.pool.run(task="test.spin", raw_args={"seconds": 3}, ctx=self.ctx(), memory_limit_mb=None)
        self.assertGreater(value["turns"], 0)
        self.assertEqual(self.children(), [pid], "the same child, still serving")

    def children(self) -> list[int]:
        return self.pool.idle_pids()


def _env_restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _seconds(start: str, end: str) -> float:
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
