"""What Celery's own tools (Flower, `celery events`, celery-exporter, `celery inspect`) see
of FairQueue jobs: every run of a job, under the job's own task name.

A worker runs jobs under one Celery task, `fairqueue.run_job`, and a slot runs a chain of
jobs under one broker delivery (handoffs and pulls: fairqueue.jobs.execution). Left to
Celery, its events and `inspect active` would show that wrapper, once per delivery. Instead:

- the wrapper sends no task events of its own (`send_events=False` on the task); each run
  of a job sends task-received, task-started, then task-succeeded, task-failed or
  task-retried, through the worker's own event dispatcher, with the job's task name, the
  job id as the task id (a retry keeps it, as Celery's own retries keep theirs), the number
  of earlier attempts as `retries`, and job id, tenant and attempt in `kwargs` (a run
  whose outcome was not recorded, the job cancelled meanwhile, ends in task-revoked). They go
  out only while the worker's task events are on (`-E`, or `celery control enable_events`
  as Flower sends it), buffered and flushed by Celery's consumer like Celery's own; none
  touches the engine's Redis.
- the delivery's request in Celery's worker state, which `inspect active` lists, reports
  the job its slot runs now (SlotRequest.info).

Imports: Celery only; fairqueue.jobs.execution calls in, the worker wiring
(fairqueue.jobs.worker) enables it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from celery.utils.saferepr import saferepr
from celery.worker.request import Request

log = logging.getLogger("fairqueue.jobs.task_events")

TASK_GROUP = "task"  # the event group of task-* events, which `-E` and enable_events turn on
# Celery's own cap on the argument reprs a message carries (celery.app.amqp's argsrepr_maxsize).
REPR_MAXSIZE = 1024


@dataclass(frozen=True)
class JobRun:
    """One run of a job as Celery's tools are told it."""

    job_id: str
    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    started: float  # wall clock, as Celery's Request.time_start

    @property
    def argsrepr(self) -> str:
        return saferepr(self.args, REPR_MAXSIZE)

    @property
    def kwargsrepr(self) -> str:
        return saferepr(self.kwargs, REPR_MAXSIZE)


# The worker's consumer, not its event dispatcher: the consumer makes a new dispatcher each
# time it reconnects to the broker (and has none once it has closed it, shutting down).
_consumer: Any = None
# The Celery request id of each slot's delivery -> the job that slot runs now.
_running: dict[str, JobRun] = {}
_slot = threading.local()


def task_events_enable(consumer: Any) -> None:
    """Send job runs' events through this worker consumer's event dispatcher."""
    global _consumer
    _consumer = consumer


@contextmanager
def slot(request_id: str | None) -> Iterator[None]:
    """This thread runs the jobs of the Celery delivery `request_id` (the wrapper task's)."""
    _slot.request_id = request_id
    try:
        yield
    finally:
        _slot.request_id = None
        if request_id is not None:
            _running.pop(request_id, None)


def _dispatcher() -> Any:
    """The worker's event dispatcher while it sends task events, else None (then a run
    costs no repr and no event: Celery drops them the same way, by group)."""
    dispatcher = getattr(_consumer, "event_dispatcher", None)
    if dispatcher is None or not dispatcher.enabled:
        return None
    groups = dispatcher.groups
    return dispatcher if not groups or TASK_GROUP in groups else None


def _send(event_type: str, **fields: Any) -> None:
    dispatcher = _dispatcher()
    if dispatcher is None:
        return
    try:
        dispatcher.send(event_type, **fields)
    except Exception:  # monitoring: never the job's failure
        log.warning("could not send the %s event of job %s", event_type, fields.get("uuid"), exc_info=True)


def run_started(*, job_id: str, task: str, tenant: str, sub_tenant: str, attempt: int, args: Any) -> None:
    """A job's run began (its claim won): received and started, as Celery's tools read them.
    `args`: the job's arguments, or the reference to them when they are offloaded."""
    kwargs: dict[str, Any] = {"job_id": job_id, "tenant": tenant, "attempt": attempt}
    if sub_tenant:
        kwargs["sub_tenant"] = sub_tenant
    run = JobRun(job_id=job_id, name=task, args=[args], kwargs=kwargs, started=time.time())
    request_id = getattr(_slot, "request_id", None)
    if request_id is not None:
        _running[request_id] = run
    if _dispatcher() is None:
        return
    _send(
        "task-received",
        uuid=job_id,
        name=task,
        args=run.argsrepr,
        kwargs=run.kwargsrepr,
        root_id=job_id,
        parent_id=None,
        retries=attempt - 1,
        eta=None,
        expires=None,
    )
    _send("task-started", uuid=job_id)


def _run_ended() -> None:
    request_id = getattr(_slot, "request_id", None)
    if request_id is not None:
        _running.pop(request_id, None)


def run_succeeded(*, job_id: str, result: Any, runtime: float) -> None:
    _run_ended()
    if _dispatcher() is None:
        return
    _send("task-succeeded", uuid=job_id, result=saferepr(result, REPR_MAXSIZE), runtime=runtime)


def run_failed(*, job_id: str, exception: str, traceback: str) -> None:
    _run_ended()
    _send("task-failed", uuid=job_id, exception=exception, traceback=traceback)


def run_retried(*, job_id: str, exception: str, traceback: str = "") -> None:
    """The run ended and the job runs again (a retry, a back-off, a lost hold)."""
    _run_ended()
    _send("task-retried", uuid=job_id, exception=exception, traceback=traceback)


def run_revoked(*, job_id: str) -> None:
    """The run ended but its outcome was not the job's to record: it was cancelled, or
    another delivery owns it now."""
    _run_ended()
    _send("task-revoked", uuid=job_id, terminated=False, signum=None, expired=False)


class SlotRequest(Request):  # type: ignore[misc]
    """The worker's request for a `fairqueue.run_job` delivery: while its slot runs a job,
    Celery's inspect (`active`) sees that job, by its task name and id."""

    def info(self, safe: bool = False) -> dict[str, Any]:
        info: dict[str, Any] = super().info(safe=safe)
        run = _running.get(self.id)
        if run is not None:
            info.update(
                id=run.job_id,
                name=run.name,
                type=run.name,
                args=run.argsrepr if safe else run.args,
                kwargs=run.kwargsrepr if safe else run.kwargs,
                time_start=run.started,
            )
        return info
