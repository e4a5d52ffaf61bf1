"""The job list's cursor: an opaque token for a place in the list's order (newest first),
and the rows after that place.

A place is a row's (submitted_at, id): both are set when the row is written and never
change, so a page read after the cursor neither repeats nor skips a job that was listed or
still to come when the cursor was made, whatever is inserted (newer rows come before the
cursor, not after it) or whichever statuses change in between. The token is a version, the
time in whole microseconds since the epoch and the id, in URL-safe base64: opaque to a
client, which only hands back a `next` it was given.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db.models import QuerySet

from fairqueue.jobs.errors import JobError
from fairqueue.jobs.models import Job

CURSOR_VERSION = "1"
CURSOR_MAX_LENGTH = 100  # a token is about 70 characters
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


@dataclass(frozen=True)
class ListCursor:
    submitted_at: datetime
    id: uuid.UUID


def cursor_encode(job: Job) -> str:
    """The token of the place right after `job` in the list."""
    micros = (job.submitted_at - _EPOCH) // _MICROSECOND
    raw = f"{CURSOR_VERSION}|{micros}|{job.id.hex}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _invalid(reason: str) -> JobError:
    return JobError(400, "invalid_cursor", f"cursor: {reason}; pass the `next` of a previous page as is.", "cursor")


def cursor_decode(token: str) -> ListCursor:
    """The place a token names; a 400 (`invalid_cursor`) for anything this API did not make."""
    if len(token) > CURSOR_MAX_LENGTH:
        raise _invalid(f"longer than {CURSOR_MAX_LENGTH} characters")
    try:
        raw = base64.b64decode(token + "=" * (-len(token) % 4), altchars=b"-_", validate=True).decode("ascii")
    except (binascii.Error, ValueError):
        raise _invalid("not a cursor (bad encoding)") from None
    parts = raw.split("|")
    if len(parts) != 3 or parts[0] != CURSOR_VERSION:
        raise _invalid("not a cursor of this API version")
    _, micros, hex_id = parts
    try:
        # int() and UUID() accept signs, spaces and braces: only what cursor_encode writes passes.
        if not micros.isdigit() or len(hex_id) != 32:
            raise ValueError
        submitted_at = _EPOCH + int(micros) * _MICROSECOND
        job_id = uuid.UUID(hex=hex_id)
    except (ValueError, OverflowError):
        raise _invalid("not a cursor (bad place)") from None
    if job_id.hex != hex_id:
        raise _invalid("not a cursor (bad place)")
    return ListCursor(submitted_at=submitted_at, id=job_id)


def jobs_after(qs: QuerySet[Job], cursor: ListCursor) -> QuerySet[Job]:
    """The rows of `qs` (ordered newest first: -submitted_at, -id) after the cursor: a range
    an index on (..., submitted_at) walks backwards from the cursor (`submitted_at <= t`),
    less the rows of that instant already listed (as recovery.reconcile_after, reversed)."""
    return qs.filter(submitted_at__lte=cursor.submitted_at).exclude(submitted_at=cursor.submitted_at, id__gte=cursor.id)
