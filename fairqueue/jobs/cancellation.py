"""Cancelling a job that has not started (or waits to be retried): a conditional update,
then its slot, if it holds or waits for one, is given back."""

from __future__ import annotations

import logging

from django.utils import timezone

from fairqueue.jobs import cells, stats
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
    """
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
    return job
