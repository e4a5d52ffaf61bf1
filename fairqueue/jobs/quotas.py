"""Backlog quotas, the submission rate and the memory guard: what a tenant may add to the
waiting jobs, decided before its rows are written.

A tenant's waiting jobs (`queued` or `parked`, each lane apart) are its cells'
(fairqueue.jobs.cells): a submit enters its jobs in their cells in the same script call
that checks the quota, the memory guard's cap and the rate bucket (lua/cells.lua), so the
count and the entry are one atomic step and a request is refused whole or entered whole.
A refusal is a 429 naming the quota, with a Retry-After from the tenant's drain rate (its
limit over its mean job duration): about when enough of its backlog will have started.

Crash windows: the entry comes before the rows; if the rows are then not written (an
idempotency race, a database error) the entries leave again; if the process dies in
between, the cells audit removes entries with no row. A Redis outage checks nothing: the
submit is accepted as before and its jobs enter their cells with their admission.

Only jobs that start waiting now count: a delayed job (run_at, delay_seconds) counts from
its due time, when its promotion enters it without a check (a job already accepted is
never refused later).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import redis

from fairqueue.jobs import cells, live
from fairqueue.jobs.admission import shard_tag, tenant_key, tenant_limit_for
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.runtime import engine
from tenants.policy import PolicySnapshot, TenantPolicy

log = logging.getLogger("fairqueue.jobs.quotas")

# A Retry-After is at least this (a client retrying at once only meets the same refusal)
# and at most this (past an hour the drain rate says little; the client should look).
RETRY_AFTER_MIN_SECONDS = 1
RETRY_AFTER_MAX_SECONDS = 3600


def _lanes(policy: PolicySnapshot) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The class names of the interactive lane, and the batch lane's."""
    return tuple(sorted(policy.classes)), (cells.BATCH_CLASS,)


def backlog_enter(*, tp: TenantPolicy, policy: PolicySnapshot, jobs: Sequence[Job]) -> bool:
    """Check the tenant's quotas, the memory guard and its submission rate for `jobs` (all
    of one request) and enter those due now in their cells, all in one atomic call; raise
    JobError 429 when a check fails (nothing entered). True when the jobs were entered
    (their admission must not enter them again); False when Redis could not be asked."""
    due = [j for j in jobs if j.status == JobStatus.QUEUED]
    rate = policy.pool.submit_rate_of(tp)
    if not due and rate <= 0:
        return False
    interactive, batch = _lanes(policy)
    checks: list[cells.Check] = []
    batch_n = sum(1 for j in due if j.in_batch_lane)
    if len(due) - batch_n:
        quota = policy.pool.backlog_quota_of(tp, batch=False)
        checks.append(
            cells.Check("quota", "backlog_quota", len(due) - batch_n, quota, cells.tenant_cells(tp.slug, interactive))
        )
    if batch_n:
        quota = policy.pool.backlog_quota_of(tp, batch=True)
        checks.append(cells.Check("quota", "batch_backlog_quota", batch_n, quota, cells.tenant_cells(tp.slug, batch)))
    everything = cells.tenant_cells(tp.slug, interactive + batch)
    guard = cells.Check("guard", "memory_guard", len(due), 0, everything) if due else None
    if rate > 0:
        checks.append(cells.Check("rate", tp.slug, len(jobs), rate, burst=policy.pool.submit_burst))
    try:
        refusal = cells.jobs_enter_checked(due, policy=policy, checks=[*checks, *([guard] if guard else [])])
        if refusal is not None and refusal.check == "guard" and guard is not None and _below_floor(tp):
            # A tenant below its floor is admitted under the guard: its floor is what it can count on.
            exempt = cells.Check("guard", "memory_guard", len(due), 1, everything)
            refusal = cells.jobs_enter_checked(due, policy=policy, checks=[*checks, exempt])
    except redis.RedisError:
        log.warning("Redis unreachable: %d job(s) of %s accepted without their quota checked", len(jobs), tp.slug)
        return False
    if refusal is not None:
        raise _refused(tp, policy, refusal, n=len(due) if refusal.check != "rate" else len(jobs))
    return bool(due)


def backlog_leave(jobs: Sequence[Job]) -> None:
    """The rows of entered jobs were not written after all: they leave their cells."""
    cells.jobs_leave([str(j.id) for j in jobs if j.status == JobStatus.QUEUED])


def _below_floor(tp: TenantPolicy) -> bool:
    held = engine().counts(tag=shard_tag(tp.shard), keys=[tenant_key(tp.slug)]).get(tenant_key(tp.slug), 0)
    return held < tp.floor


def drain_per_second(tp: TenantPolicy, policy: PolicySnapshot) -> float:
    """Jobs per second the tenant's backlog drains at: its limit over its mean job duration."""
    signals = live.live_signals(tenant_slug=tp.slug)
    limit = tenant_limit_for(policy, tp, signals).limit
    mean = signals.mean_seconds if signals.mean_seconds is not None else policy.pool.default_job_seconds
    return max(limit, 1) / max(mean, 1e-3)


def _retry_after(seconds: float) -> int:
    return int(min(RETRY_AFTER_MAX_SECONDS, max(RETRY_AFTER_MIN_SECONDS, math.ceil(seconds))))


def _refused(tp: TenantPolicy, policy: PolicySnapshot, refusal: cells.Refusal, *, n: int) -> JobError:
    if refusal.check == "rate":
        rate = policy.pool.submit_rate_of(tp)
        return JobError(
            429,
            "submit_rate_exceeded",
            f"Submission rate exceeded: submit_rate allows {rate:g} job(s) per second "
            f"(bursts of {policy.pool.submit_burst}); nothing was written.",
            retry_after=_retry_after(refusal.count),
        )
    excess = refusal.count + n - refusal.cap
    wait = _retry_after(excess / drain_per_second(tp, policy))
    if refusal.check == "guard":
        return JobError(
            429,
            "memory_guard",
            f"The scheduler's memory is nearly full: memory_guard refuses new waiting jobs from tenants with "
            f"more than {refusal.cap} waiting; you have {int(refusal.count)}. Nothing was written.",
            retry_after=wait,
        )
    lane = "batch-lane " if refusal.name == "batch_backlog_quota" else ""
    return JobError(
        429,
        "backlog_quota_exceeded",
        f"Backlog quota exceeded: {refusal.name} allows {refusal.cap} waiting {lane}job(s); "
        f"{int(refusal.count)} wait and this request adds {n}. Nothing was written.",
        retry_after=wait,
    )
