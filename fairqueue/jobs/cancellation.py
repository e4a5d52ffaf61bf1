"""Cancelling a job that has not started: a conditional update, then its slot is given back."""

from __future__ import annotations

import logging

from django.utils import timezone

from fairqueue.jobs import cells, stats
from fairqueue.jobs.dispatch import job_release_or_defer
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.models import TERMINAL_STATUSES, WAITING_STATUSES, Job, JobStatus

log = logging.getLogger("fairqueue.jobs.cancellation")

CANCEL_ATTEMPTS = 3


def job_cancel(*, job: Job) -> Job:
    """Cancel a job that has not started. A parked job gives up its place at once.

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
        updated = Job.objects.filter(id=job.id, generation=job.generation, status__in=sorted(WAITING_STATUSES)).update(
            status=JobStatus.CANCELLED, finished_at=timezone.now()
        )
        job.refresh_from_db()
        if updated:
            break
        # Lost a race (re-delivered, promoted, moved: a new generation, still waiting): again.
    else:
        raise JobError(409, "not_cancellable", "The job keeps changing; retry the cancel.", None)
    stats.count("finished:cancelled")
    cells.jobs_leave([str(job.id)])
    job_release_or_defer(job)
    return job
