"""Delayed jobs at submit: when a job asked to start (`run_at` or `delay_seconds`).

A job due later is written `scheduled` with its `due_at` and goes neither to the engine nor
to the broker; the due promotion (fairqueue.jobs.due) admits it when its time comes. A time
in the past, or a delay of 0, means now: the job is admitted at once like any other.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from fairqueue.jobs.errors import JobError

# The furthest ahead a job may be scheduled: far enough for any real schedule, near enough
# that a typo (a year 2206, a delay in milliseconds) is refused rather than kept for ever.
MAX_DELAY = timedelta(days=366)


def _parse_run_at(text: str, field: str) -> datetime:
    try:
        # Python 3.11+ reads every ISO-8601 form a client sends, including a trailing Z.
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise JobError(
            400,
            "invalid_run_at",
            f"run_at must be an ISO-8601 time such as 2030-01-31T09:00:00Z; got {text[:40]!r}.",
            field,
        ) from None
    if when.tzinfo is None or when.utcoffset() is None:
        raise JobError(
            400, "invalid_run_at", "run_at needs a UTC offset (Z or +hh:mm): a bare local time is ambiguous.", field
        )
    try:
        # Kept in UTC: PostgreSQL refuses an offset past 15:59 that ISO 8601 allows.
        return when.astimezone(UTC)
    except OverflowError:
        raise JobError(400, "invalid_run_at", "run_at is out of range.", field) from None


def due_time(
    *, run_at: str | None, delay_seconds: float | None, now: datetime, where: str = ""
) -> tuple[datetime | None, datetime | None]:
    """(run_at as asked, the time the job is due) for a submit; (None, None) when it asked
    for neither. Raises JobError (400) on a bad value or on both at once."""
    if run_at is not None and delay_seconds is not None:
        raise JobError(400, "invalid_delay", "Give run_at or delay_seconds, not both.", f"{where}run_at")
    if run_at is not None:
        when = _parse_run_at(run_at, f"{where}run_at")
        if when - now > MAX_DELAY:
            raise JobError(
                400, "invalid_run_at", f"run_at may be at most {MAX_DELAY.days} days ahead.", f"{where}run_at"
            )
        return when, when
    if delay_seconds is not None:
        # bool is an int in Python: a JSON true is not a delay.
        if isinstance(delay_seconds, bool) or not math.isfinite(delay_seconds) or delay_seconds < 0:
            raise JobError(
                400, "invalid_delay", "delay_seconds must be a number of seconds, 0 or more.", f"{where}delay_seconds"
            )
        if delay_seconds > MAX_DELAY.total_seconds():
            raise JobError(
                400,
                "invalid_delay",
                f"delay_seconds may be at most {int(MAX_DELAY.total_seconds())} ({MAX_DELAY.days} days).",
                f"{where}delay_seconds",
            )
        when = now + timedelta(seconds=delay_seconds)
        return when, when
    return None, None


def is_deferred(due: datetime | None, now: datetime) -> bool:
    """A job due after `now` waits `scheduled`; one due now or in the past is admitted at once."""
    return due is not None and due > now
