"""Due jobs enter admission: delayed jobs (`scheduled`) whose time has come and failed
attempts (`retrying`) whose backoff is over, in due order, through the throttle like any
new job (they wait their turn behind jobs already parked; nothing held while they waited).

Cost per tick: one read of the due rows only, by the (status, due_at) index, however many
jobs wait for a later time; one conditional UPDATE per group of like rows; one pipelined
admission. It runs in the periodic duties (fairqueue.jobs.duties.scheduler_tick: one
process per fleet, every 0.25-0.75 s). The database is the only store of the schedule, so
a Redis flush loses no delayed or retrying job and there is nothing of it to rebuild.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from datetime import datetime
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone

from fairqueue.jobs import live, stats
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.admission import job_placement, known_resources
from fairqueue.jobs.dispatch import jobs_admit
from fairqueue.jobs.models import DEFERRED_DUE, KEY_SEPARATOR, Job, JobStatus
from tenants.policy import PolicySnapshot, policy_snapshot

log = logging.getLogger("fairqueue.jobs.due")

DUE_BATCH = 500
# A tick promotes batches until this is spent (then the next tick goes on): a wave of jobs
# due at one instant enters admission within a few ticks without stalling the other duties.
DUE_BUDGET_SECONDS = 0.5


def jobs_promote_due(
    *, batch: int = DUE_BATCH, budget_seconds: float = DUE_BUDGET_SECONDS, now: datetime | None = None
) -> int:
    """Admit every job due by `now` (default: now), earliest first; returns how many."""
    started = time.monotonic()
    total = 0
    while True:
        read, promoted = _promote_batch(batch=batch, now=now or timezone.now())
        total += promoted
        if read < batch or time.monotonic() - started > budget_seconds:
            return total


def due_rows(now: datetime) -> QuerySet[Job]:
    """Deferred jobs due by `now`, earliest first: a range of the job_deferred_due index
    in its own order (the first rows of a backlog are read, not all of them sorted).

    A retrying job whose last release has not reached the engine waits for the reconciler
    (`release_pending`): its next admission must not share an engine id with that release."""
    due = Job.objects.alias(deferred_due=DEFERRED_DUE).filter(deferred_due__isnull=False, deferred_due__lte=now)
    # `isnull` repeats the index's condition word for word: SQLite uses a partial index
    # only for a query that states its condition (PostgreSQL infers it from `lte`).
    return due.order_by("deferred_due", "id")


def _promote_batch(*, batch: int, now: datetime) -> tuple[int, int]:
    """Promote the next `batch` due rows; returns (rows read, rows promoted)."""
    due = list(due_rows(now).select_related("tenant__shard")[:batch])
    if not due:
        return 0, 0
    policy = policy_snapshot()
    marked_at = timezone.now()
    promoted = _mark_queued(due, policy, marked_at)
    if promoted:
        stats.count("due_promoted", len(promoted))
        try:
            # A due job arrives now: it counts in its tenant's rate (the limit formula) now.
            for slug, n in Counter(j.tenant.slug for j in promoted).items():
                live.record_submissions(tenant_slug=slug, count=n)
        except Exception:
            log.exception("could not count %d due job(s) as arrivals", len(promoted))
        _admit(promoted, policy)
        entered = timezone.now()
        for job in promoted:  # the objective: within a second of its time (/metrics)
            stats.observe("due_lateness", max(0.0, (entered - job.due_at).total_seconds()) if job.due_at else 0.0)
    return len(due), len(promoted)


def _admit(jobs: list[Job], policy: PolicySnapshot) -> None:
    """Admit rows `_mark_queued` wrote as admitted (as the submit path does: an admitted job
    then costs no second write, only a parked one is updated). If the admission does not
    happen the mark is cleared, so the pending sweep admits them (fairqueue.jobs.recovery)."""
    try:
        jobs_admit(jobs, policy=policy, strict=True, fresh=True, enter_cells=True)  # they wait from due_at
    except Exception:
        log.warning("%d due job(s) not admitted now; the pending sweep admits them", len(jobs), exc_info=True)
        pending = tl.line(tl.PENDING, "not admitted when due")
        for (generation, at), group in _by_generation(jobs).items():
            Job.objects.filter(id__in=[j.id for j in group], generation=generation, status=JobStatus.QUEUED).update(
                admitted_at=None,
                timeline=tl.replaced(tl.line(tl.ADMITTED, at=at), pending) if at is not None else tl.appended(pending),
            )


def _by_generation(jobs: list[Job]) -> dict[tuple[int, datetime | None], list[Job]]:
    """`jobs` by (generation, the admission they were marked with)."""
    groups: defaultdict[tuple[int, datetime | None], list[Job]] = defaultdict(list)
    for job in jobs:
        groups[(job.generation, job.admitted_at)].append(job)
    return groups


def _mark_queued(due: list[Job], policy: PolicySnapshot, marked_at: datetime) -> list[Job]:
    """Move each row from its deferred status to `queued`, marked admitted at `marked_at`
    (see `_admit`), at its tenant's current place: a compare-and-set on status and
    generation, so a cancel in between wins; a retry is a new delivery, so it gets a new
    generation. Returns the rows moved, in due order."""
    groups: defaultdict[tuple[str, int, str, str, datetime | None], list[Job]] = defaultdict(list)
    for job in due:
        tag, keys, admitted_at = job.engine_tag, job.engine_keys, None
        tenant = policy.tenants.get(job.tenant.slug)
        if tenant is not None:  # else not admitted now: the pending sweep admits it once the policy is known
            tag, names = job_placement(
                tenant=tenant,
                sub_tenant=job.sub_tenant,
                batch=job.in_batch_lane,
                resources=known_resources(policy, job.resource_names),
                document=job.document,
                quarantined=job.quarantined,
            )
            keys, admitted_at = KEY_SEPARATOR.join(names), marked_at
        groups[(job.status, job.generation, tag, keys, admitted_at)].append(job)
    moved: set[Any] = set()
    for (status, generation, tag, keys, admitted_at), jobs in groups.items():
        new_generation = generation + 1 if status == JobStatus.RETRYING else generation
        ids = [j.id for j in jobs]
        # Marked admitted, the row says so in its timeline in the same UPDATE (a park
        # rewrites the line, as at submit; fairqueue.jobs.dispatch).
        step = {"timeline": tl.appended(tl.line(tl.ADMITTED, at=admitted_at))} if admitted_at is not None else {}
        won = Job.objects.filter(id__in=ids, status=status, generation=generation).update(
            status=JobStatus.QUEUED,
            generation=new_generation,
            admitted_at=admitted_at,
            engine_tag=tag,
            engine_keys=keys,
            **step,
        )
        if won == len(ids):
            winners = set(ids)
        else:  # some were cancelled meanwhile: the rows say which are ours
            winners = set(
                Job.objects.filter(id__in=ids, status=JobStatus.QUEUED, generation=new_generation).values_list(
                    "id", flat=True
                )
            )
        for job in jobs:
            if job.id in winners:
                job.status, job.generation, job.admitted_at = JobStatus.QUEUED, new_generation, admitted_at
                job.engine_tag, job.engine_keys = tag, keys
                moved.add(job.id)
    return [j for j in due if j.id in moved]
