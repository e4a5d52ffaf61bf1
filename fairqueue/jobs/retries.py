"""Retry policies: which errors a task retries, how many attempts it gets, how long it waits.

A task declares its policy when registered (fairqueue.jobs.retry_policy).
A failed attempt whose error is one the policy retries, with attempts left, puts the job in
`retrying` until `due_at`; the due promotion (fairqueue.jobs.due) then admits it again
through the throttle like any new job. The wait is exponential with a cap and full jitter
(a uniform draw between 0 and the capped exponential): many jobs failing together, say on
one overloaded dependency, come back spread out instead of in a wave.

Only errors the task itself raises are retried; a worker that dies under a job is counted
apart (`worker_losses`, the poison-pill limit) and costs no attempt.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.retry_policy import RetryPolicy

ATTEMPT_ERROR_CHARS = 2000


def attempt_record(
    *,
    attempt: int,
    worker: str,
    started: datetime,
    finished: datetime,
    error: str | None,
    error_reason: str = "",
    retry_at: datetime | None = None,
) -> dict[str, Any]:
    """One entry of a job's attempt_history (JSON)."""
    return {
        "attempt": attempt,
        "worker": worker,
        "started_at": started.isoformat(),
        "finished_at": finished.isoformat(),
        "duration_s": round((finished - started).total_seconds(), 6),
        "status": "failed" if error is not None else "succeeded",
        "error": error[:ATTEMPT_ERROR_CHARS] if error is not None else None,
        "error_reason": error_reason or None,
        "retry_at": retry_at.isoformat() if retry_at is not None else None,
    }


def failure_fields(
    *,
    policy: RetryPolicy,
    max_attempts: int,
    failures_before: int,
    exc: BaseException | None,
    finished: datetime,
) -> dict[str, Any]:
    """The row's fields after a failed attempt: `retrying` until a backoff if the policy
    retries `exc` (None: an error outside the task, never retried) and attempts are left,
    else nothing beyond the failure itself (the job ends `failed`)."""
    failures = failures_before + 1
    fields: dict[str, Any] = {"attempt_failures": failures}
    if exc is None or not policy.retries(exc) or failures >= max_attempts:
        return fields
    due = finished + timedelta(seconds=policy.backoff(failures))
    fields.update(status=JobStatus.RETRYING, due_at=due, finished_at=None)
    return fields


def attempt_end_fields(
    *,
    job: Job,
    policy: RetryPolicy,
    worker: str,
    started: datetime,
    finished: datetime,
    failed: bool,
    task_error: BaseException | None,
    error: str = "",
    error_reason: str = "",
) -> dict[str, Any]:
    """`error` is the failure in one line (`Type: message`; the row's `error` keeps the
    last traceback). What the end of one attempt adds to the row's final update: its attempt_history
    entry and, for a failure, the retry decision (failure_fields). `task_error` is the
    error the task raised; None for a failure outside it (unknown task, bad arguments),
    which is never retried. The caller's update is conditional on the running generation,
    which only this delivery holds, so the history is appended without a lost write."""
    fields: dict[str, Any] = {}
    if failed:
        fields = failure_fields(
            policy=policy,
            max_attempts=job.max_attempts,
            failures_before=job.attempt_failures,
            exc=task_error,
            finished=finished,
        )
    entry = attempt_record(
        attempt=job.attempts,
        worker=worker,
        started=started,
        finished=finished,
        error=(error or "error") if failed else None,
        error_reason=error_reason if failed else "",
        retry_at=fields.get("due_at"),
    )
    fields["attempt_history"] = [*(job.attempt_history or []), entry]
    return fields
