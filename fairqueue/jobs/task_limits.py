"""The limits one attempt of a task runs under (a wall-clock timeout; a memory limit for
isolated tasks) and the exceptions that end an attempt at one.

Each exception carries the reason the job records (Job.error_reason, `error_reason` in the
API), so a retry policy can tell a timeout from a memory kill from the task's own error.
They go through the ordinary task-failure path of fairqueue.jobs.execution.
"""

from __future__ import annotations

import math

# Job.error_reason for a task that raised (anything not listed below).
EXCEPTION = "exception"
TIMEOUT = "timeout"
MEMORY_LIMIT = "memory_limit"
CRASHED = "crashed"
# Every reason an attempt on a worker can fail with (the metric's labels are these).
ATTEMPT_FAILURE_REASONS = (EXCEPTION, TIMEOUT, MEMORY_LIMIT, CRASHED)


class TaskStopped(Exception):
    """The attempt ended for a reason other than the task's own code: `reason` says which."""

    reason = EXCEPTION


class TaskTimeout(TaskStopped):
    """Past the attempt's wall-clock limit: raised by JobContext.check_deadline in the task,
    or by the worker after it killed an isolated task's process."""

    reason = TIMEOUT


class TaskMemoryLimit(TaskStopped):
    """An isolated task grew past its memory limit: its process was killed (or its
    allocation refused)."""

    reason = MEMORY_LIMIT


class TaskCrashed(TaskStopped):
    """An isolated task's process died under it (a signal, a crash in native code, an exit)."""

    reason = CRASHED


def failure_reason(exc: BaseException) -> str:
    """What Job.error_reason records for an attempt that ended with `exc`."""
    return exc.reason if isinstance(exc, TaskStopped) else EXCEPTION


def effective_timeout(task_seconds: float | None, job_seconds: float | None) -> float | None:
    """A job may only lower its task's limit: the smaller of the two (None: no limit)."""
    if task_seconds is None:
        return job_seconds
    if job_seconds is None:
        return task_seconds
    return min(task_seconds, job_seconds)  # the task's when equal, as min() of the two always was


def valid_limit(value: float | None) -> bool:
    """A limit is a positive, finite number of seconds or megabytes (or none)."""
    return value is None or (isinstance(value, int | float) and math.isfinite(value) and value > 0)
