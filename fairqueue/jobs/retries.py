"""Retry policies: which errors a task retries, how many attempts it gets, how long it waits.

A task declares its policy when registered (`@fairqueue_task(..., retry=RetryPolicy(...))`).
A failed attempt whose error is one the policy retries, with attempts left, puts the job in
`retrying` until `due_at`; the due promotion (fairqueue.jobs.due) then admits it again
through the throttle like any new job. The wait is exponential with a cap and full jitter
(a uniform draw between 0 and the capped exponential): many jobs failing together, say on
one overloaded dependency, come back spread out instead of in a wave.

Only errors the task itself raises are retried; a worker that dies under a job is counted
apart (`worker_losses`, the poison-pill limit) and costs no attempt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from fairqueue.jobs.models import Job, JobStatus

MAX_ATTEMPTS_LIMIT = 100  # attempt_history keeps one entry per attempt: bounded
ATTEMPT_ERROR_CHARS = 2000


@dataclass(frozen=True)
class RetryPolicy:
    """`max_attempts` counts every attempt, the first included (1: never retried). The wait
    before attempt n+1 is uniform in [0, min(backoff_cap_s, backoff_base_s * 2**(n-1))]."""

    max_attempts: int = 3
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 300.0
    retry_on: tuple[type[BaseException], ...] = field(default=(Exception,))

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= MAX_ATTEMPTS_LIMIT:
            raise ValueError(f"max_attempts must be 1-{MAX_ATTEMPTS_LIMIT}")
        if not (0 <= self.backoff_base_s <= self.backoff_cap_s):
            raise ValueError("backoff needs 0 <= backoff_base_s <= backoff_cap_s")
        if not all(isinstance(t, type) and issubclass(t, BaseException) for t in self.retry_on):
            raise ValueError("retry_on must be a tuple of exception classes")

    def retries(self, exc: BaseException) -> bool:
        return isinstance(exc, self.retry_on)

    def backoff_bound(self, failures: int) -> float:
        """The longest wait after the `failures`-th failed attempt (1 after the first)."""
        exponent = min(max(failures - 1, 0), 64)  # 2**64 s is past any cap; avoids huge floats
        return min(self.backoff_cap_s, self.backoff_base_s * 2.0**exponent)

    def backoff(self, failures: int, rng: random.Random | None = None) -> float:
        """Full jitter: uniform between 0 and the bound."""
        return (rng or _rng).uniform(0.0, self.backoff_bound(failures))


NO_RETRY = RetryPolicy(max_attempts=1, backoff_base_s=0.0, backoff_cap_s=0.0)

_rng = random.SystemRandom()


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
