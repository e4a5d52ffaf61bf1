"""Cancelling a job that has not started: a conditional update, then its slot is given back."""

from __future__ import annotations

from django.utils import timezone

from fairqueue.jobs import stats
from fairqueue.jobs.admission import shard_tag
from fairqueue.jobs.dispatch import outcomes_handle
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.models import TERMINAL_STATUSES, Job, JobStatus
from fairqueue.jobs.runtime import engine


def job_cancel(*, job: Job) -> Job:
    """Cancel a job that has not started. A parked job gives up its place at once."""
    if job.status in TERMINAL_STATUSES:
        raise JobError(409, "not_cancellable", f"Job is already {job.status}.", None)
    if job.status == JobStatus.RUNNING:
        raise JobError(409, "not_cancellable", "Job is already running.", None)
    updated = Job.objects.filter(
        id=job.id, generation=job.generation, status__in=[JobStatus.QUEUED, JobStatus.PARKED]
    ).update(status=JobStatus.CANCELLED, finished_at=timezone.now())
    job.refresh_from_db()
    if not updated:
        raise JobError(409, "not_cancellable", f"Job is already {job.status}.", None)
    stats.count("finished:cancelled")
    result = engine().release(tag=shard_tag(job.tenant.shard.name), job_id=job.engine_id)
    outcomes_handle(woken=result.woken, reclaimed=result.reclaimed)
    return job
