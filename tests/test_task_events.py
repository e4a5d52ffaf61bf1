"""Celery's own tools see every job by its name (issue 35): Celery's event stream, which
Flower and celery-exporter read, carries each run of a job once, under the job's task
name, whichever way it reached its slot (a broker delivery, a handoff, a pull); `celery
inspect active` lists the job a slot runs, handed-off ones included.

Real worker processes; the listener is Celery's own `app.events.Receiver` on the test broker.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from typing import Any

from fairqueue.celery import app
from fairqueue.jobs.broker import RUN_TASK_NAME
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.stats import stats_read
from tests import lifecycle_tasks
from tests.factories import make_tenant
from tests.test_handoff import deliveries_received
from tests.test_jobs_e2e import E2EBase
from tests.workers import WorkerProcess, wait_for

TASKS = {"FAIRQUEUE_TASK_MODULES": lifecycle_tasks.__name__}
TASK = "test.flaky"
PULLED_JOBS = 4
CHAIN_JOBS = 4
EVENT_TIMEOUT_SECONDS = 60.0
INSPECT_TIMEOUT_SECONDS = 5.0
PROBE_EVENT = "fairqueue-probe"
RECEIVER_JOIN_SECONDS = 10.0
# Worker heartbeats (every 2 s) heard after a job's last event: a duplicate event of it,
# buffered by the worker, would have been flushed by then.
SETTLE_HEARTBEATS = 2


class CeleryEvents:
    """Celery's event receiver on the test broker, in a thread: every event it hears."""

    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, name="celery-events", daemon=True)

    def _on_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)

    def _run(self) -> None:
        with app.connection_for_read() as conn:
            self._receiver = app.events.Receiver(conn, handlers={"*": self._on_event})
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def start(self) -> CeleryEvents:
        """Listen, and return once the receiver hears events (its queue is bound)."""
        self._thread.start()
        probe = uuid.uuid4().hex
        with app.connection_for_write() as conn, app.events.Dispatcher(conn) as dispatcher:

            def heard() -> bool:
                dispatcher.send(PROBE_EVENT, probe=probe)
                return any(e.get("probe") == probe for e in self.all())

            wait_for(heard, timeout=EVENT_TIMEOUT_SECONDS, interval=0.2, message="the receiver to hear a probe")
        return self

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(RECEIVER_JOIN_SECONDS)

    def all(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def tasks(self) -> list[dict[str, Any]]:
        """Task events, in the order the worker sent them (its logical clock)."""
        return sorted((e for e in self.all() if e["type"].startswith("task-")), key=lambda e: e["clock"])

    def of(self, job_id: object) -> list[dict[str, Any]]:
        return [e for e in self.tasks() if e["uuid"] == str(job_id)]

    def settle(self, hostname: str) -> None:
        """Wait for more of the worker's heartbeats than it has sent so far."""
        beats = self.heartbeats(hostname)
        wait_for(
            lambda: self.heartbeats(hostname) >= beats + SETTLE_HEARTBEATS,
            timeout=EVENT_TIMEOUT_SECONDS,
            message="the worker's next heartbeats",
        )

    def state(self) -> Any:
        """Celery's own picture of the cluster built from these events, the one Flower keeps."""
        state = app.events.State()
        for event in self.all():
            state.event(event)
        return state

    def heartbeats(self, hostname: str) -> int:
        return sum(1 for e in self.all() if e["type"] == "worker-heartbeat" and e.get("hostname") == hostname)


class CeleryEventsTests(E2EBase):
    def setUp(self) -> None:
        super().setUp()
        self.events = CeleryEvents().start()
        self.addCleanup(self.events.stop)

    def flaky(self, key: str, **args: object) -> str:
        return str(self.submit(key, {"task": TASK, "args": args})["id"])

    def wait_for_ends(self, ids: list[str], ends: int = 1) -> None:
        terminal = {"task-succeeded", "task-failed"}

        def ended() -> bool:
            return all(sum(e["type"] in terminal for e in self.events.of(i)) >= ends for i in ids)

        wait_for(ended, timeout=EVENT_TIMEOUT_SECONDS, message=f"the last events of {len(ids)} jobs")

    def assert_one_run(self, job_id: str, *, tenant: str, hostname: str, end: str = "task-succeeded") -> None:
        events = self.events.of(job_id)
        self.assertEqual([e["type"] for e in events], ["task-received", "task-started", end], job_id)
        received = events[0]
        self.assertEqual(received["name"], TASK)
        self.assertEqual(received["hostname"], hostname)
        self.assertEqual(received["retries"], 0)
        for shown in (job_id, f"'tenant': '{tenant}'", "'attempt': 1"):
            self.assertIn(shown, received["kwargs"])

    def test_every_job_appears_once_under_its_name_by_delivery_pull_and_handoff(self) -> None:
        _, pulled_key = make_tenant("evpulled", floor=PULLED_JOBS)  # none waits on a limit
        _, chain_key = make_tenant("evchain", max_concurrency=1)
        # Waiting in the broker before the worker starts: its one slot takes the first
        # through Celery's consumer and pulls the rest itself.
        pulled = [self.flaky(pulled_key, seconds=0.05) for _ in range(PULLED_JOBS)]
        with WorkerProcess(slots=1, name="events", options=["--events"], **TASKS) as worker:
            self.wait_all_finished(pulled)
            # One at a time on the tenant's limit: each release hands the slot the next.
            chain = [self.flaky(chain_key, seconds=0.2) for _ in range(CHAIN_JOBS)]
            jobs = self.wait_all_finished(chain)
            self.wait_for_ends(pulled + chain)
            self.events.settle(worker.hostname)
            # The worker's counters reach Redis with its heartbeat.
            wait_for(
                lambda: stats_read().get("delivery:pulled") == PULLED_JOBS - 1, message="every job but the first pulled"
            )
            wait_for(
                lambda: stats_read().get("handoff:inline") == CHAIN_JOBS - 1,
                message="every chained job but the first handed off",
            )
            self.assertEqual(deliveries_received(worker.hostname), 2, "one broker delivery per tenant's first job")
        self.assertEqual({j.status for j in jobs}, {JobStatus.SUCCEEDED})
        for job_id in pulled:
            self.assert_one_run(job_id, tenant="evpulled", hostname=worker.hostname)
        for job_id in chain:
            self.assert_one_run(job_id, tenant="evchain", hostname=worker.hostname)
        seen = self.events.tasks()
        self.assertEqual({e["uuid"] for e in seen}, set(pulled + chain), "no event but the jobs' own")
        self.assertNotIn(RUN_TASK_NAME, {e.get("name") for e in seen})
        succeeded = [e for e in seen if e["type"] == "task-succeeded"]
        self.assertTrue(all(e["runtime"] > 0 and "'attempt': 1" in e["result"] for e in succeeded))
        state = self.events.state()
        self.assertEqual(state.task_types(), [TASK], "Flower's task names")
        self.assertEqual(state.task_count, len(pulled + chain))
        for job_id in pulled + chain:
            task = state.tasks[job_id]
            self.assertEqual((task.name, task.state, task.worker.hostname), (TASK, "SUCCESS", worker.hostname))

    def test_a_retried_job_appears_once_per_run_and_a_failed_one_as_failed(self) -> None:
        _, key = make_tenant("evflaky", floor=2)
        with WorkerProcess(slots=2, name="evretry", options=["--events"], **TASKS) as worker:
            retried = self.flaky(key, fail_times=1)
            failed = self.flaky(key, permanent=True)
            self.wait_all_finished([retried, failed])
            self.wait_for_ends([retried, failed])
            self.events.settle(worker.hostname)
        runs = self.events.of(retried)
        self.assertEqual(
            [e["type"] for e in runs],
            ["task-received", "task-started", "task-retried", "task-received", "task-started", "task-succeeded"],
        )
        self.assertIn("TransientError", runs[2]["exception"])
        self.assertEqual([runs[0]["retries"], runs[3]["retries"]], [0, 1])
        self.assertIn("'attempt': 1", runs[0]["kwargs"])
        self.assertIn("'attempt': 2", runs[3]["kwargs"])
        self.assertEqual({runs[0]["name"], runs[3]["name"]}, {TASK})
        self.assertEqual(Job.objects.get(id=retried).attempts, 2)
        self.assert_one_run(failed, tenant="evflaky", hostname=worker.hostname, end="task-failed")
        self.assertIn("PermanentError", self.events.of(failed)[-1]["exception"])
        self.assertIn("Traceback", self.events.of(failed)[-1]["traceback"])
        state = self.events.state()
        self.assertEqual((state.tasks[retried].state, state.tasks[retried].retries), ("SUCCESS", 1))
        self.assertEqual((state.tasks[failed].state, state.tasks[failed].name), ("FAILURE", TASK))

    def test_task_events_turned_on_by_remote_control_as_flower_does(self) -> None:
        _, key = make_tenant("evremote", floor=2)
        with WorkerProcess(slots=1, name="evremote", **TASKS) as worker:
            unseen = self.flaky(key)
            self.wait_all_finished([unseen])
            replies = app.control.enable_events(
                destination=[worker.hostname], reply=True, timeout=INSPECT_TIMEOUT_SECONDS
            )
            self.assertEqual(len(replies), 1, replies)
            seen = self.flaky(key)
            self.wait_all_finished([seen])
            self.wait_for_ends([seen])
            self.events.settle(worker.hostname)
        self.assertEqual(self.events.of(unseen), [], "no task events before they were turned on")
        self.assert_one_run(seen, tenant="evremote", hostname=worker.hostname)

    def test_inspect_active_lists_a_handed_off_job_by_its_name(self) -> None:
        _, key = make_tenant("evactive", max_concurrency=1)
        with WorkerProcess(slots=2, name="evactive", **TASKS) as worker:
            ids = [self.flaky(key, seconds=3.0) for _ in range(2)]

            def active() -> list[dict[str, Any]]:
                replies = app.control.inspect([worker.hostname], timeout=INSPECT_TIMEOUT_SECONDS).active() or {}
                return list(replies.get(worker.hostname, []))

            def running(job_id: str) -> dict[str, Any] | None:
                return next((r for r in active() if r["id"] == job_id), None)

            first = wait_for(lambda: running(ids[0]), timeout=EVENT_TIMEOUT_SECONDS, message="the first job active")
            handed = wait_for(lambda: running(ids[1]), timeout=EVENT_TIMEOUT_SECONDS, message="the second job active")
            self.wait_all_finished(ids)
            # The worker's counters reach Redis with its heartbeat.
            wait_for(lambda: stats_read().get("handoff:inline") == 1, message="the second job handed the first's slot")
            self.assertEqual(deliveries_received(worker.hostname), 1)
        for request, job_id in ((first, ids[0]), (handed, ids[1])):
            self.assertEqual(request["name"], TASK)
            self.assertEqual(request["hostname"], worker.hostname)
            self.assertEqual(request["kwargs"], {"job_id": job_id, "tenant": "evactive", "attempt": 1})
            self.assertEqual(request["args"], [{"seconds": 3.0}])
        self.assertEqual(Counter(j.status for j in Job.objects.filter(id__in=ids)), {JobStatus.SUCCEEDED: 2})
