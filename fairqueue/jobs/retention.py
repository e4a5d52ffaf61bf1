"""Retention: finished jobs past a cutoff go, with their payload files and demo ledger rows.

Work is done in small batches, each its own transaction, so pruning can run while workers
finish jobs and the admin retries them: a batch deletes only rows that are still finished
before the cutoff when it locks them, and payload files only of rows it really deleted.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from fairqueue.conf import fq_settings
from fairqueue.jobs import payloads
from fairqueue.jobs.models import PRUNABLE, Job, LedgerEntry

DEFAULT_BATCH_SIZE = 1000
# The fleet's duty leader calls it every RETENTION_EVERY_SECONDS (fairqueue.jobs.duties): each
# call does a bounded amount of work, and a large backlog of old jobs drains over many calls.
TICK_BATCH_SIZE = 500
TICK_MAX_BATCHES = 2


@dataclasses.dataclass(frozen=True)
class PruneResult:
    """What a prune deleted (or, for a preview, would delete)."""

    jobs: int = 0
    payload_files: int = 0  # references removed from the payload store (an already missing file counts)

    def __add__(self, other: PruneResult) -> PruneResult:
        return PruneResult(jobs=self.jobs + other.jobs, payload_files=self.payload_files + other.payload_files)


def prunable_jobs(*, cutoff: datetime) -> QuerySet[Job]:
    """Finished jobs that finished before `cutoff`.

    A finished job whose release has not reached the engine yet stays: the reconciler
    needs its row to free the slots it held.
    """
    return Job.objects.filter(PRUNABLE, finished_at__lt=cutoff)


def jobs_prune_select(*, cutoff: datetime, limit: int) -> list[uuid.UUID]:
    """The ids of the next batch to prune, oldest first."""
    return list(prunable_jobs(cutoff=cutoff).order_by("finished_at", "id").values_list("id", flat=True)[:limit])


def jobs_prune_batch(*, ids: Sequence[uuid.UUID], cutoff: datetime) -> PruneResult:
    """Delete those of `ids` that are still prunable, their ledger rows and payload files.

    The rows are locked and re-checked first, so a job retried (or re-finished) since it
    was selected is kept along with its payload files, which its next run reads. Files
    go only once the deletion has committed: a rolled-back batch loses nothing.
    """
    with transaction.atomic():
        # select_for_update: on PostgreSQL a concurrent retry waits for this batch, then
        # finds the row gone; SQLite takes the whole write lock when the transaction begins.
        locked = list(
            prunable_jobs(cutoff=cutoff)
            .select_for_update()
            .filter(id__in=ids)
            .values_list("id", "args_ref", "result_ref")
        )
        doomed = [job_id for job_id, _, _ in locked]
        _, deleted = prunable_jobs(cutoff=cutoff).filter(id__in=doomed).delete()
        LedgerEntry.objects.filter(job_id__in=doomed).delete()
        refs = [ref for _, args_ref, result_ref in locked for ref in (args_ref, result_ref) if ref]
        transaction.on_commit(lambda: _payloads_delete(refs))
    return PruneResult(jobs=deleted.get(Job._meta.label, 0), payload_files=len(refs))


def _payloads_delete(refs: list[str]) -> None:
    for ref in refs:
        payloads.payload_delete(ref)  # the storage ignores a file that is already gone


def _cutoff(*, older_than: timedelta, now: datetime | None) -> datetime:
    if older_than < timedelta(0):
        raise ValueError(f"older_than must not be negative (got {older_than})")
    return (now or timezone.now()) - older_than


def jobs_prune(
    *,
    older_than: timedelta,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_batches: int | None = None,
    now: datetime | None = None,
) -> PruneResult:
    """Delete jobs finished more than `older_than` ago, `batch_size` at a time, oldest
    first, until none is left or `max_batches` batches have run."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1 (got {batch_size})")
    cutoff = _cutoff(older_than=older_than, now=now)
    total = PruneResult()
    batches = 0
    while max_batches is None or batches < max_batches:
        ids = jobs_prune_select(cutoff=cutoff, limit=batch_size)
        if ids:
            total += jobs_prune_batch(ids=ids, cutoff=cutoff)
            batches += 1
        if len(ids) < batch_size:
            break
    return total


def jobs_prune_preview(*, older_than: timedelta, now: datetime | None = None) -> PruneResult:
    """What `jobs_prune` would delete now, deleting nothing."""
    cutoff = _cutoff(older_than=older_than, now=now)
    counts = prunable_jobs(cutoff=cutoff).aggregate(
        jobs=Count("id"),
        args=Count("id", filter=~Q(args_ref="")),
        results=Count("id", filter=~Q(result_ref="")),
    )
    return PruneResult(jobs=counts["jobs"], payload_files=counts["args"] + counts["results"])


def retention_due_prune(*, now: datetime | None = None) -> PruneResult | None:
    """The periodic duty: a bounded share of automatic retention (FAIRQUEUE["RETENTION_DAYS"]).

    Returns None when retention is disabled (0 days).
    """
    days = float(fq_settings().RETENTION_DAYS)
    if days <= 0:
        return None
    return jobs_prune(
        older_than=timedelta(days=days), batch_size=TICK_BATCH_SIZE, max_batches=TICK_MAX_BATCHES, now=now
    )
