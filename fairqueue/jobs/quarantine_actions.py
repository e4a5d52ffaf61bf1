"""The operators' actions on the quarantine lane (the admin's): send a waiting job back to
the normal lane, or fail it. Each is a compare-and-set on the job's (id, generation,
status), so an action that loses a race (the job started, finished or was re-delivered
meanwhile) changes nothing; the engine's hold of the old generation is then given back.
A running job is left alone: its worker decides what happens to it."""

from __future__ import annotations

from collections.abc import Sequence

from django.db.models import QuerySet
from django.utils import timezone

from fairqueue.jobs import cells, stats
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.dispatch import job_release_or_defer, jobs_admit
from fairqueue.jobs.models import DEFERRED_STATUSES, WAITING_STATUSES, Job, JobStatus
from webhooks.outbox import job_finish

# What an operator's "fail" leaves as the job's reason.
OPERATOR_FAILED = "quarantine_failed"
# Statuses an operator may act on: waiting in the lane, or waiting for its time.
ACTIONABLE: list[str] = sorted({*WAITING_STATUSES, *DEFERRED_STATUSES})
WAITING: list[str] = sorted(WAITING_STATUSES)


def _actionable(job: Job, statuses: Sequence[str] = ACTIONABLE) -> dict[str, object]:
    return {
        "id": job.id,
        "generation": job.generation,
        "status__in": statuses,
        "quarantined_at__isnull": False,
    }


def jobs_quarantine_send_back(jobs: QuerySet[Job]) -> int:
    """Send each waiting quarantined job back to the normal lane: a new generation, its
    death counts cleared, admitted again in the normal lane. A scheduled or retrying one
    only leaves the lane: it is admitted, in the normal lane, when it is due
    (fairqueue.jobs.due). Returns how many moved."""
    moved: list[Job] = []
    count = 0
    for job in jobs.select_related("tenant"):
        was = job.status
        if was in DEFERRED_STATUSES:
            count += Job.objects.filter(
                id=job.id, generation=job.generation, status=was, quarantined_at__isnull=False
            ).update(
                quarantined_at=None,
                quarantine_reason="",
                quarantine_losses=0,
                worker_losses=0,
                timeline=tl.appended(tl.line(tl.REQUEUED, "sent back from quarantine by an operator")),
            )
            continue
        won = Job.objects.filter(**_actionable(job, WAITING)).update(
            quarantined_at=None,
            quarantine_reason="",
            quarantine_losses=0,
            worker_losses=0,
            status=JobStatus.QUEUED,
            generation=job.generation + 1,
            admitted_at=None,
            engine_keys="",  # placed again at its admission, in the normal lane
            timeline=tl.appended(tl.line(tl.REQUEUED, "sent back from quarantine by an operator")),
        )
        if not won:
            continue
        job_release_or_defer(job)  # the old generation's hold (or place in line) in the lane
        moved.append(job)
    if moved:
        cells.jobs_leave([str(j.id) for j in moved])
        jobs_admit(list(Job.objects.filter(id__in=[j.id for j in moved]).select_related("tenant")), enter_cells=True)
    return count + len(moved)


def jobs_quarantine_fail(jobs: QuerySet[Job]) -> int:
    """Fail each waiting quarantined job for good (its webhook event in the same
    transaction). Returns how many failed."""
    failed = 0
    for job in jobs.select_related("tenant"):
        was = job.status
        now = timezone.now()
        won = job_finish(
            job,
            where=_actionable(job),
            fields={
                "status": JobStatus.FAILED,
                "error_reason": OPERATOR_FAILED,
                "error": "Failed from the quarantine lane by an operator.",
                "finished_at": now,
                "timeline": tl.appended(tl.line(tl.FINISHED, f"failed {OPERATOR_FAILED}", at=now)),
            },
        )
        if not won:
            continue
        failed += 1
        stats.count("finished:failed")
        cells.jobs_leave([str(job.id)])
        if was not in DEFERRED_STATUSES:
            job_release_or_defer(job)
    return failed
