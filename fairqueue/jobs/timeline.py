"""A job's lifecycle on its own row: one line per step (`<time> <event>[ <detail>]`),
appended by the same conditional UPDATE that changes its status, so it costs no extra
round trip and reads without a tracing backend (the admin's job page shows it).

Lease renewals are not written here (a write every few seconds per running job): they
are span events only (fairqueue.tracing).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import F, TextField, Value
from django.db.models.functions import Concat, Replace
from django.utils import timezone

SUBMITTED = "submitted"
ADMITTED = "admitted"
PARKED = "parked"
WOKEN = "woken"
PENDING = "pending"  # accepted, waiting for the engine (Redis unreachable, state not rebuilt)
STARTED = "started"
RECLAIMED = "reclaimed"
REQUEUED = "requeued"
QUARANTINED = "quarantined"  # moved to the quarantine lane after worker deaths (fairqueue.jobs.quarantine)
# An attempt that failed and will be tried again: the job is not finished, it waits for
# its backoff (`retry_scheduled <due time>`), then the due promotion admits it again.
ATTEMPT_FAILED = "attempt_failed"
RETRY_SCHEDULED = "retry_scheduled"
FINISHED = "finished"  # terminal states only
AWAITING = "awaiting"  # its run ended after submitting children (fairqueue.jobs.fanout)
JOINED = "joined"  # its last child ended: its continuation was submitted


@dataclass(frozen=True)
class Step:
    event: str
    at: datetime
    detail: str = ""


def line(event: str, detail: str = "", *, at: datetime | None = None) -> str:
    stamp = (at or timezone.now()).isoformat(timespec="milliseconds")
    return f"{stamp} {event} {detail}\n" if detail else f"{stamp} {event}\n"


def appended(*lines: str) -> Concat:
    """An UPDATE's value for `timeline`: what it holds, then `lines`, in the same statement."""
    return Concat(F("timeline"), _text("".join(lines)), output_field=TextField())


def replaced(old_line: str, *lines: str) -> Concat:
    """Ditto, with `old_line` taken out first (a fresh row's assumed `admitted`)."""
    return Concat(
        Replace(F("timeline"), _text(old_line), _text(""), output_field=TextField()),
        _text("".join(lines)),
        output_field=TextField(),
    )


def _text(value: str) -> Value:
    return Value(value, output_field=TextField())


def steps(timeline: str) -> list[Step]:
    """The timeline as steps, oldest first; a line that does not parse is skipped."""
    out = []
    for raw in timeline.splitlines():
        stamp, _, rest = raw.partition(" ")
        event, _, detail = rest.partition(" ")
        try:
            at = datetime.fromisoformat(stamp)
        except ValueError:
            continue
        if event:
            out.append(Step(event, at, detail))
    return out
