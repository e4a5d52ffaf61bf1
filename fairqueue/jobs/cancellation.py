"""Cancelling a job that has not started (or waits to be retried): a conditional update,
then its slot, if it holds or waits for one, is given back."""

from __future__ import annotations

import logging

from django.utils import timezone

from fairqueue.jobs import cells, documents, fanout, stats
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.dispatch import job_release_or_defer
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.models import DEFERRED_STATUSES, TERMINAL_STATUSES, WAITING_STATUSES, Job, JobStatus
from webhooks.outbox import job_finish

log = logging.getLogger("fairqueue.jobs.cancellation")

CANCEL_ATTEMPTS = 3


def job_cancel(*, job: Job) -> Job:
    """Cancel a job that has not started. A parked job gives up its place at once; a
    scheduled or retrying one (fairqueue.jobs.due) is in neither the engine nor the broker,
    so the row is all there is to change.

    The database decides: the cancel is a compare-and-set on (id, generation, waiting
    status), and a delivery's claim is one on the same row, so exactly one of them wins.
    Giving the engine its slot back is best-effort: if Redis cannot be reached the cancel
    still stands, and the reconciler frees the slot (`release_pending`).

    A parent awaiting its children (fairqueue.jobs.fanout) holds nothing: it is cancelled by
    a compare-and-set on `awaiting`, then so is each of its children not started yet (and
    theirs); a running child runs to its end, and no join follows a cancelled parent.
    """
    if job.status == JobStatus.AWAITING:
        return _parent_cancel(job)
    for _ in range(CANCEL_ATTEMPTS):
        if job.status in TERMINAL_STATUSES:
            raise JobError(409, "not_cancellable", f"Job is already {job.status}.", None)
        if job.status == JobStatus.RUNNING:
            raise JobError(409, "not_cancellable", "Job is already running.", None)
        was = job.status
        # A deferred job is cancelled only while still deferred: promoted meanwhile (a
        # scheduled job keeps its generation), it may hold slots the release must free.
        statuses = [was] if was in DEFERRED_STATUSES else sorted(WAITING_STATUSES)
        updated = job_finish(
            job,
            where={"id": job.id, "generation": job.generation, "status__in": statuses},
            fields={
                "status": JobStatus.CANCELLED,
                "finished_at": timezone.now(),
                "timeline": tl.appended(tl.line(tl.FINISHED, JobStatus.CANCELLED)),
            },
        )
        job.refresh_from_db()
        if updated:
            break
        # Lost a race (re-delivered, promoted, moved: a new generation, still waiting): again.
    else:
        raise JobError(409, "not_cancellable", "The job keeps changing; retry the cancel.", None)
    stats.count("finished:cancelled")
    if was not in DEFERRED_STATUSES:
        # A deferred job holds nothing and waits in no cell: its last attempt's release
        # happened when it failed.
        cells.jobs_leave([str(job.id)])
        job_release_or_defer(job)
    if job.parent_id is not None:
        fanout.child_finished_safely(job)
    return job


def _parent_cancel(job: Job) -> Job:
    updated = job_finish(
        job,
        where={"id": job.id, "status": JobStatus.AWAITING},
        fields={
            "status": JobStatus.CANCELLED,
            "finished_at": timezone.now(),
            "timeline": tl.appended(tl.line(tl.FINISHED, JobStatus.CANCELLED)),
        },
    )
    job.refresh_from_db()
    if not updated:
        raise JobError(409, "not_cancellable", f"Job is already {job.status}.", None)
    stats.count("finished:cancelled")
    documents.documents_forget([str(job.id)])
    children_cancel(parent=job)
    return job


def children_cancel(*, parent: Job) -> int:
    """Cancel the parent's children that have not started (each by its own compare-and-set;
    one that started meanwhile runs to its end); returns how many were cancelled."""
    cancelled = 0
    open_statuses = sorted({*WAITING_STATUSES, *DEFERRED_STATUSES, JobStatus.AWAITING})
    for child in Job.objects.select_related("tenant").filter(parent_id=parent.id, status__in=open_statuses):
        try:
            job_cancel(job=child)
            cancelled += 1
        except JobError:  # it started, or finished, meanwhile
            continue
    return cancelled
