"""Tasks with retry policies, for the retry and delay tests (FAIRQUEUE_TASK_MODULES=tests.lifecycle_tasks).

The test process imports this module too, so it can submit them.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fairqueue.jobs.registry import JobContext, fairqueue_task
from fairqueue.jobs.retry_policy import RetryPolicy
from fairqueue.jobs.task_limits import TaskTimeout


class TransientError(Exception):
    """An error worth another attempt (a timeout talking to a dependency, say)."""


class PermanentError(Exception):
    """An error no retry can fix (a bad document, say)."""


class FlakyArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fail_times: int = Field(default=0, ge=0, le=100)  # attempts that fail before one succeeds
    permanent: bool = False  # raise an error the policy does not retry
    seconds: float = Field(default=0.0, ge=0, le=60)  # work before failing or succeeding


FLAKY_POLICY = RetryPolicy(max_attempts=5, backoff_base_s=0.2, backoff_cap_s=0.5, retry_on=(TransientError,))
# A backoff long enough that nothing retries within a test unless it promotes by hand.
PATIENT_POLICY = RetryPolicy(max_attempts=3, backoff_base_s=3600.0, backoff_cap_s=3600.0, retry_on=(TransientError,))


def _flaky(ctx: JobContext, args: FlakyArgs) -> dict[str, Any]:
    started = datetime.now(UTC).isoformat()
    time.sleep(args.seconds)
    if args.permanent:
        raise PermanentError(f"attempt {ctx.attempt}: this document cannot be parsed")
    if ctx.attempt <= args.fail_times:
        raise TransientError(f"attempt {ctx.attempt}: the dependency timed out")
    return {"attempt": ctx.attempt, "started": started, "finished": datetime.now(UTC).isoformat()}


@fairqueue_task("test.flaky", args=FlakyArgs, retry=FLAKY_POLICY)
def flaky(ctx: JobContext, args: FlakyArgs) -> dict[str, Any]:
    """Fails `fail_times` attempts with a transient error (or once with a permanent one)."""
    return _flaky(ctx, args)


@fairqueue_task("test.flaky_patient", args=FlakyArgs, retry=PATIENT_POLICY)
def flaky_patient(ctx: JobContext, args: FlakyArgs) -> dict[str, Any]:
    """test.flaky with an hour of backoff: a failed attempt stays `retrying`."""
    return _flaky(ctx, args)


class SlowFirstArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


# A timeout is an attempt's failure like any error: retried when the policy names it.
TIMEOUT_POLICY = RetryPolicy(max_attempts=3, backoff_base_s=0.2, backoff_cap_s=0.5, retry_on=(TaskTimeout,))


@fairqueue_task("test.slow_first", args=SlowFirstArgs, retry=TIMEOUT_POLICY, timeout_seconds=1.0)
def slow_first(ctx: JobContext, args: SlowFirstArgs) -> dict[str, Any]:
    """Runs past its 1 s limit on the first attempt (checking its deadline, as tasks in the
    worker do), and at once on the next."""
    while ctx.attempt == 1:
        ctx.check_deadline()
        time.sleep(0.05)
    return {"attempt": ctx.attempt}
