"""The quarantine lane: where a job goes after its workers died under it.

A job whose worker died under it (a SIGKILL, an OOM kill, a lease that ran out without a
hand-back) `quarantine_after_losses` times (a pool setting) is moved here by the lease
recovery (fairqueue.jobs.dispatch.jobs_redeliver). From then on each of its deliveries is
published to its own queue, `fq.quarantine`, which only workers started for it consume
(`manage.py worker --quarantine`), and its admission holds one more engine key, the lane's
(fairqueue.jobs.admission.QUARANTINE_KEY, at the pool's `quarantine_slots`), besides its
tenant's keys, so it waits for a quarantine slot in fair order like any key. Only after
`quarantine_poison_losses` further deaths there does it fail as a poison pill.

A warm shutdown is no death: a worker stopped with SIGTERM hands its running jobs back
(fairqueue.jobs.execution.job_requeue_graceful), which counts nothing.

This module holds the lane's rules (`death_outcome`), below dispatch, which applies them;
the operators' actions are in fairqueue.jobs.quarantine_actions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from django.db.models import QuerySet

from fairqueue.conf import fq_settings
from fairqueue.jobs.fleet import QUARANTINE_LANE
from fairqueue.jobs.models import TERMINAL_STATUSES, Job
from tenants.policy import PoolPolicy

WORKER_LOST = "worker_lost"
LANE = QUARANTINE_LANE  # the lane's name where the API, the dashboard and the fleet registry show it
REASON_MAX = Job._meta.get_field("quarantine_reason").max_length or 0


class Death(enum.Enum):
    RETRY = "retry"  # run again where it was
    QUARANTINE = "quarantine"  # moved to the quarantine lane now
    POISON = "poison"  # failed for good (worker_lost)


@dataclass(frozen=True)
class DeathOutcome:
    death: Death
    reason: str  # the quarantine reason, or the failure's message


def lane_enabled(pool: PoolPolicy) -> bool:
    return pool.quarantine_after_losses > 0


def death_outcome(job: Job, pool: PoolPolicy) -> DeathOutcome:
    """What a worker death under `job` (already counted on it: worker_losses, and
    quarantine_losses when quarantined) does to it."""
    if job.quarantined:
        if job.quarantine_losses >= pool.quarantine_poison_losses:
            return DeathOutcome(
                Death.POISON,
                f"Workers died {job.worker_losses} times running this job, "
                f"{job.quarantine_losses} of them in quarantine; not re-delivered again.",
            )
        return DeathOutcome(Death.RETRY, "")
    if lane_enabled(pool):
        if job.worker_losses >= pool.quarantine_after_losses:
            reason = f"worker died {job.worker_losses} time(s) running it (last on {job.worker or 'an unknown worker'})"
            # A hostname may be as long as the reason's column: cut to fit, never a failed write.
            return DeathOutcome(Death.QUARANTINE, reason[:REASON_MAX])
        return DeathOutcome(Death.RETRY, "")
    if job.worker_losses >= int(fq_settings().POISON_PILL_LIMIT):
        return DeathOutcome(
            Death.POISON, f"Workers died {job.worker_losses} times running this job; not re-delivered again."
        )
    return DeathOutcome(Death.RETRY, "")


def quarantined_jobs() -> QuerySet[Job]:
    """Unfinished jobs in the lane, oldest move first."""
    return (
        Job.objects.filter(quarantined_at__isnull=False)
        .exclude(status__in=sorted(TERMINAL_STATUSES))
        .order_by("quarantined_at")
    )
