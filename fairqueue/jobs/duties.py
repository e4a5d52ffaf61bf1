"""The periodic duties of the fleet: reclaim expired holds, push limits, promote batch
jobs before their objective, admit what never reached the engine, rebuild lost state.

Every duty is atomic where it touches the engine and conditional where it touches the
database, so running it from several processes at once is safe.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from django.utils import timezone

from fairqueue.jobs import live
from fairqueue.jobs.admission import BATCH_KEY, SHARD_KEY, shard_tag, tenant_key, tenant_limit_for
from fairqueue.jobs.dispatch import jobs_admit, outcomes_handle
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.recovery import jobs_admit_pending, state_ensure
from fairqueue.jobs.runtime import engine
from tenants.limits import idle_shares
from tenants.policy import policy_snapshot

# Unheld slots are shared out up to slots * (1 + OVERCOMMIT): a job in transit to a worker
# holds a slot it is not yet using, and without a little overcommit workers would idle.
OVERCOMMIT = 0.125
BATCH_PROMOTE_AT = 0.75  # share of the batch objective after which a waiting batch job is promoted
SWEEP_JOBS_PER_TAG = 100


def sweep_once() -> int:
    """Reclaim expired leases on every shard; returns how many jobs were reclaimed."""
    total = 0
    results = engine().sweep([shard_tag(s) for s in policy_snapshot().shards], max_jobs_per_tag=SWEEP_JOBS_PER_TAG)
    for result in results.values():
        if result.reclaimed or result.woken:
            outcomes_handle(woken=result.woken, reclaimed=result.reclaimed)
        total += len(result.reclaimed)
    return total


def scheduler_tick() -> None:
    """The periodic duties any worker may perform; all are atomic and safe to overlap."""
    state_ensure()
    sweep_once()
    limits_refresh()
    batch_promote_due()
    jobs_admit_pending()


def batch_promote_due(*, now: float | None = None, limit: int = 200) -> int:
    """Move batch jobs out of the idle-capacity lane before their objective would be missed.

    A job is promoted once it has waited PROMOTE_AT of the batch objective; from then on it
    is admitted like any job of its latency class. Safe to run from many processes: the
    engine's cancel is atomic, so exactly one of them re-admits each job.
    """
    policy = policy_snapshot()
    objective = policy.pool.batch_objective_seconds
    cutoff = timezone.now() - timedelta(seconds=objective * BATCH_PROMOTE_AT)
    due = list(
        Job.objects.select_related("tenant__shard")
        .filter(batch=True, promoted_at__isnull=True, status=JobStatus.PARKED, submitted_at__lte=cutoff)
        .order_by("submitted_at")[:limit]
    )
    promoted: list[Job] = []
    for job in due:
        result = engine().cancel(tag=shard_tag(job.tenant.shard.name), job_id=job.engine_id)
        if not result.cancelled:
            continue  # woken meanwhile, or another process promoted it
        outcomes_handle(woken=result.woken, reclaimed=result.reclaimed)
        job.promoted_at = timezone.now()
        job.generation += 1
        job.status = JobStatus.QUEUED
        Job.objects.filter(id=job.id).update(promoted_at=job.promoted_at, generation=job.generation, status=job.status)
        promoted.append(job)
    jobs_admit(promoted, policy=policy)
    return len(promoted)


def limits_refresh() -> int:
    """Push every tenant's current limit (and each shard's batch room) to the engine.

    Limits travel with each admit, but a tenant whose jobs are all parked submits nothing;
    this tick is what lets a raised limit (idle pool, admin edit) wake its waiters within a
    second. It also shares the pool's unheld slots among tenants at their limit (see
    tenants.limits.idle_shares), which is what keeps the pool full under one big backlog.
    One round trip per shard to read holders, one per shard to set limits.
    """
    policy = policy_snapshot()
    fleet = live.fleet_state(max_age=0.05)  # the idle share must see the pool as it is now
    formulas: dict[str, int] = {}
    held: dict[str, int] = {}
    for shard_name in policy.shards:
        members = [tp for tp in policy.tenants.values() if tp.shard == shard_name]
        counts = engine().counts(tag=shard_tag(shard_name), keys=[tenant_key(tp.slug) for tp in members])
        for tp in members:
            signals = dataclasses.replace(live.live_signals(tenant_slug=tp.slug), idle_share=0)
            formulas[tp.slug] = tenant_limit_for(policy, tp, signals).limit
            held[tp.slug] = counts.get(tenant_key(tp.slug), 0)
    capped = {
        slug
        for slug, tp in policy.tenants.items()
        if tp.max_concurrency is not None and formulas.get(slug, 0) >= tp.max_concurrency + tp.dedicated
    }
    at_limit = {
        slug: (held[slug], formulas[slug]) for slug in formulas if held[slug] >= formulas[slug] and slug not in capped
    }
    shares = idle_shares(
        slots=fleet.slots, in_flight=fleet.in_flight + fleet.batch_in_flight, overcommit=OVERCOMMIT, demand=at_limit
    )
    live.idle_shares_publish(shares)
    woken = 0
    for shard_name, shard in policy.shards.items():
        limits = {SHARD_KEY: shard.capacity, BATCH_KEY: fleet.batch_limit(shard_name)}
        for tp in policy.tenants.values():
            if tp.shard == shard_name:
                limits[tenant_key(tp.slug)] = tenant_limit_for(policy, tp, live.live_signals(tenant_slug=tp.slug)).limit
        # An unready tag (state lost, rebuild pending) is left alone: the rebuild's admits
        # bring the limits, and waking waiters there could pass jobs the engine forgot.
        result = engine().set_limits(tag=shard_tag(shard_name), limits=limits, require_ready=True)
        if result:
            outcomes_handle(woken=result, reclaimed=[])
            woken += len(result)
    return woken
