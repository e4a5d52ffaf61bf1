"""Turns policy into the engine's vocabulary: a hash tag, keys with limits, a priority.

This is the one place that knows which keys a job needs. The engine below it only
sees names and numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fairqueue.engine import KeyLimit
from fairqueue.queues import PRIORITY_LEVELS
from tenants.limits import LimitBreakdown, tenant_limit
from tenants.policy import PolicySnapshot, TenantPolicy

# The engine takes a job's keys in sorted-name order and keeps what it holds while it waits
# for the next. The leading digit makes that order narrowest-first: a job parked on its
# sub-tenant holds nothing of its tenant, and one parked on its tenant holds no shard slot,
# so waiting jobs never eat the shared capacity of wider keys (or inflate in-flight counts).
SHARD_KEY = "3:shard"
BATCH_KEY = "2:batch"  # per shard: capacity that would otherwise sit idle
# Per shard: the quarantine lane's slots (`lane_room`: the pool's quarantine_slots less what
# the other shards' lane keys hold), held by quarantined jobs besides their tenant's keys.
# It sorts after the tenant's keys and before the shard's: a job waiting for a quarantine
# slot holds no shard slot meanwhile.
QUARANTINE_KEY = "3:quarantine"
BATCH_PRIORITY = 0
# Admitted jobs may outnumber the pool's live slots by this many: a delivery in transit to a
# worker holds a pool slot it does not use yet. Handoffs and pulls run the next job in the
# slot that freed, so none is needed to keep slots busy, and any would be a backlog in the
# broker's FIFO queue, where no fair order applies.
POOL_MARGIN = 0
# A tenant's jobs cost the pool's fair order their expected duration over their weight
# (slot-seconds, not slots: docs/fairness.md); durations below this count as this.
MIN_JOB_SECONDS = 0.01
# An outside resource's key sorts before every other, so a job waiting for a throttled (or
# paused) upstream holds nothing else meanwhile: no tenant or shard slot sits idle behind
# an upstream's refusal (docs/resources.md).
RESOURCE_KEY_PREFIX = "0:r:"
# One parent job's children (a document's pages, fairqueue.jobs.fanout) share its document
# key, capped at the parent's fan-out. It sorts after the resources and before the
# sub-tenant, tenant and shard keys: a child waiting for its document's cap holds nothing
# its siblings or its tenant's other documents could use.
DOCUMENT_KEY_PREFIX = "1:d:"


def shard_tag(shard: str) -> str:
    """All keys of one tenant share its shard's hash slot (Redis Cluster)."""
    return f"s:{shard}"


def tenant_key(slug: str) -> str:
    return f"2:t:{slug}"


def sub_tenant_key(slug: str, external_id: str) -> str:
    return f"1:st:{slug}:{external_id}"


def resource_key(name: str) -> str:
    return f"{RESOURCE_KEY_PREFIX}{name}"


def document_key(parent_id: str) -> str:
    return f"{DOCUMENT_KEY_PREFIX}{parent_id}"


def document_flow(parent_id: str) -> str:
    """A child's flow at its tenant and sub-tenant keys: its document (docs/fanout.md)."""
    return f"d:{parent_id}"


@dataclass(frozen=True)
class LiveSignals:
    """Live inputs to the limit formula; defaults mean 'nothing known yet'."""

    rate_per_min: float = 0.0
    mean_seconds: float | None = None
    pool_slots: int = 0
    in_flight: int = 0
    idle_share: int = 0  # this tenant's share of unheld slots, published by the worker tick
    fair_share: float | None = None  # its max-min fair share of the pool target, ditto
    shard_cap: int | None = None  # its cap where its shard binds (tenants.limits.shard_caps), ditto
    # The limit the duty tick last set for the tenant (tenant_limit_for), ditto, and the
    # slots held elsewhere it subtracted (a move since then holds more: see tenant_limit_for).
    tick_limit: int | None = None
    tick_held_elsewhere: int = 0
    # Slots the tenant (and its shard) still hold at a place they were moved away from
    # (fairqueue.jobs.moves): counted against the limit at the new place until they finish.
    held_elsewhere: int = 0
    shard_held_elsewhere: int = 0


@dataclass(frozen=True)
class AdmissionPlan:
    tag: str
    keys: list[KeyLimit]
    priority: int
    tenant_limit: LimitBreakdown
    sub_tenant_cap: int | None


def tenant_limit_for(policy: PolicySnapshot, tenant: TenantPolicy, signals: LiveSignals) -> LimitBreakdown:
    pool = policy.pool
    breakdown = tenant_limit(
        floor=tenant.floor,
        burst_floor=tenant.burst_floor,
        burst_pct=tenant.burst_pct,
        max_concurrency=tenant.max_concurrency,
        dedicated=tenant.dedicated,
        rate_per_min=signals.rate_per_min,
        mean_seconds=signals.mean_seconds if signals.mean_seconds is not None else pool.default_job_seconds,
        pool_slots=signals.pool_slots,
        target_utilisation=pool.target_utilisation,
        in_flight=signals.in_flight,
        f_min=pool.f_min,
        f_max=pool.f_max,
        idle_share=signals.idle_share,
        fair_share=signals.fair_share,
        shard_cap=signals.shard_cap,
    )
    # A tenant never runs more than its shard can: a limit past the shard's capacity would
    # only move its backlog from its own key to the shard's, in front of its shard-mates.
    capped = (
        min(breakdown.limit, max(policy.shards[tenant.shard].capacity, tenant.floor))
        if tenant.shard in policy.shards
        else breakdown.limit
    )
    capped = max(0, capped - signals.held_elsewhere)
    if signals.tick_limit is not None:
        # The limit the duty tick last set (fairqueue.jobs.duties.limits_refresh: with its
        # idle share and shard cap, from the pool as it was then), not one from this
        # process's own view of the pool, up to a second older: between ticks that pulled
        # an idle share or a shard cap back. Still within what the policy allows now (an
        # admin edit since the tick).
        # A move after the tick (fairqueue.jobs.moves) holds slots at the old place that
        # the tick's limit did not subtract yet; slots freed there since wait for the tick.
        tick = max(0, signals.tick_limit - max(0, signals.held_elsewhere - signals.tick_held_elsewhere))
        if tenant.max_concurrency is not None:
            tick = min(tick, tenant.max_concurrency + tenant.dedicated)
        if tenant.shard in policy.shards:
            tick = min(tick, max(policy.shards[tenant.shard].capacity, tenant.floor))
        formula = breakdown.limit - breakdown.idle_share
        breakdown = dataclasses.replace(breakdown, idle_share=max(0, tick - formula))
        capped = tick
    if capped != breakdown.limit:
        breakdown = dataclasses.replace(breakdown, limit=capped)
    return breakdown


def pool_room(*, slots: int, held_by_shard: Mapping[str, int], shard: str, margin: int = POOL_MARGIN) -> int | None:
    """The most jobs a shard's key may hold now, so that the jobs admitted across the fleet
    never outnumber its live slots (plus `margin`): the slots less what the other shards'
    keys hold. Jobs beyond it park at the shard key in fair order instead of queueing in
    the broker. None while no worker is registered: with no fleet to count, the tenants'
    limits alone bound what is admitted, and it waits in the broker for the first worker."""
    if slots <= 0:
        return None
    elsewhere = sum(held_by_shard.values()) - held_by_shard.get(shard, 0)
    return max(0, slots + margin - elsewhere)


def lane_room(*, slots: int, held_by_shard: Mapping[str, int], shard: str) -> int:
    """The most quarantined jobs `shard`'s lane key may hold now: the pool's `slots` for the
    lane (its quarantine_slots), less what the other shards' lane keys hold, so the cap holds
    across shards as the pool's room does (two shards admitting in the same instant, each
    seeing the other's count of a moment before, may pass it by the jobs they admit then)."""
    elsewhere = sum(held_by_shard.values()) - held_by_shard.get(shard, 0)
    return max(0, slots - elsewhere)


def lane_limits(*, slots: int, held_by_shard: Mapping[str, int], shards: Sequence[str], turn: int) -> dict[str, int]:
    """Each shard's lane key limit as a tick sets it: what the shard holds, and the lane's
    free slots for the one shard whose turn it is (`turn` rotates over `shards`), so that
    waiters in two shards are never both woken for the same free slot. A waiter waits up to
    one tick per shard; a new quarantined job is admitted at `lane_room` at once. While the
    lane holds nothing nobody waits there (an admission then finds room), and every shard
    gets all the slots: the limits stay put, and a tick sends none."""
    held = {shard: held_by_shard.get(shard, 0) for shard in shards}
    if not any(held.values()):
        return dict.fromkeys(held, slots)
    free = max(0, slots - sum(held.values()))
    ordered = sorted(shards)
    lucky = ordered[turn % len(ordered)] if ordered else None
    return {shard: n + (free if shard == lucky else 0) for shard, n in held.items()}


def flood_utilisation(*, slots: int, headroom: int) -> float:
    """The floor headroom's cost: the share of the pool one tenant above its floor can fill
    (the slots kept for tenants below theirs stay free while nobody below a floor asks)."""
    if slots <= 0:
        return 1.0
    return max(0, slots - headroom) / slots


def flow_weight(floor: int, mean_seconds: float) -> float:
    """A tenant's weight in a shared key's fair order: its floor per second of a job, so that
    tenants share the pool's slot-seconds in proportion to their floors (a tenant of 20 s
    jobs gets one job served for every hundred of a tenant of 0.2 s jobs at equal floors)."""
    return max(floor, 1) / max(mean_seconds, MIN_JOB_SECONDS)


def sub_tenant_cap(policy: PolicySnapshot, tenant: TenantPolicy, external_id: str, limit: int) -> int:
    """A registered sub-tenant's own cap, else the tenant's default share of its limit."""
    registered = policy.subtenants.get(tenant.slug, {}).get(external_id)
    if registered is not None:
        return registered
    return max(1, math.floor(limit * tenant.sub_tenant_share))


def batch_limits(
    *, pool_slots: int, target_utilisation: float, in_flight: int, batch_by_shard: dict[str, int]
) -> dict[str, int]:
    """Per-shard batch key limits: together at most the idle part of the pool target.

    Each shard keeps the batch jobs it already runs (no eviction) plus the fleet's idle room.
    """
    idle = max(0, math.floor(pool_slots * target_utilisation + 1e-9) - in_flight - sum(batch_by_shard.values()))
    return {shard: running + idle for shard, running in batch_by_shard.items()}


def key_names(
    *,
    tenant_slug: str,
    sub_tenant: str,
    batch: bool,
    resources: Sequence[str] = (),
    document: str = "",
    quarantined: bool = False,
) -> list[str]:
    """A job's key names (admission_plan pairs them with limits). A release passes them to
    the engine as a hint that saves it a read; a stale hint (the job moved lanes) is
    ignored there. The keys of the outside resources it calls come next here (the engine
    sorts them first), then a child job's document key (`document`: its parent's id), and
    a quarantined job's lane key last."""
    names = [BATCH_KEY if batch else tenant_key(tenant_slug), SHARD_KEY]
    if sub_tenant:
        names.append(sub_tenant_key(tenant_slug, sub_tenant))
    names += [resource_key(r) for r in resources]
    if document:
        names.append(document_key(document))
    if quarantined:
        names.append(QUARANTINE_KEY)
    return names


def known_resources(policy: PolicySnapshot, names: Sequence[str]) -> list[str]:
    """The resources of `names` the policy knows, sorted: one deleted since a job was
    submitted is no longer throttled, so it gets no key."""
    return sorted(r for r in set(names) if r in policy.resources)


def job_placement(
    *,
    tenant: TenantPolicy,
    sub_tenant: str,
    batch: bool,
    resources: Sequence[str] = (),
    document: str = "",
    quarantined: bool = False,
) -> tuple[str, list[str]]:
    """Where a job is admitted now: its engine tag and key names. Stored on the job, so its
    later engine calls go to the same place even if the tenant or shard is renamed or moved."""
    return shard_tag(tenant.shard), key_names(
        tenant_slug=tenant.slug,
        sub_tenant=sub_tenant,
        batch=batch,
        resources=resources,
        document=document,
        quarantined=quarantined,
    )


def class_level(policy: PolicySnapshot, latency_class: str) -> int:
    """The broker priority level of a latency class: 0 for the highest-ranked class, then
    one level per class down the ranks (classes past the last level share it). An unknown
    class (deleted since) runs at the level of `default`, or last."""
    ranks = sorted({c.rank for c in policy.classes.values()}, reverse=True)
    known = policy.classes.get(latency_class) or policy.classes.get("default")
    if known is None:
        return PRIORITY_LEVELS - 1
    return min(ranks.index(known.rank), PRIORITY_LEVELS - 1)


def admission_plan(
    *,
    policy: PolicySnapshot,
    tenant: TenantPolicy,
    sub_tenant: str,
    priority: int,
    signals: LiveSignals,
    batch: bool = False,
    batch_limit: int = 0,
    placement: tuple[str, list[str]] | None = None,
    resource_limits: Mapping[str, int] | None = None,
    pool_room: int | None = None,
    document: tuple[str, int] | None = None,
    quarantined: bool = False,
    quarantine_room: int | None = None,
) -> AdmissionPlan:
    """Keys for one job. A batch job waits on its shard's batch key instead of its tenant's
    key: it runs only on idle capacity and must not eat into the tenant's interactive limit.

    `placement` is the (tag, key names) stored on the job when it differs from where the
    tenant is now (it was moved or renamed since): the limits pair with those names.

    `resource_limits` maps each outside resource the job calls to its key's limit now (the
    effective limit, 0 while paused: tenants.resource_limits); each is one more key.

    `pool_room` (`pool_room()`, None: no cap) caps the shard key, which every job holds
    last, at what the pool's live slots leave for this shard: the broker never holds more
    admitted jobs than the workers can start.

    `document` (a child job's parent id and fan-out cap) adds the document key, capped at
    the fan-out; at the tenant and sub-tenant keys the child's flow is then its document,
    so a tenant's documents share its slots in fair order however many pages each has.

    `quarantined`: the job is in the quarantine lane; it holds the lane's key too, at
    `quarantine_room` (`lane_room()`; None: the pool's whole `quarantine_slots`), and
    waits there in fair order (one flow per tenant).
    """
    breakdown = tenant_limit_for(policy, tenant, signals)
    shard = policy.shards[tenant.shard]
    capacity = max(0, shard.capacity - signals.shard_held_elsewhere)
    if pool_room is not None:
        capacity = min(capacity, pool_room)
    limits = [batch_limit if batch else breakdown.limit, capacity]
    if batch:
        priority = BATCH_PRIORITY
    cap = None
    if sub_tenant:
        cap = sub_tenant_cap(policy, tenant, sub_tenant, breakdown.limit)
        limits.append(cap)
    resources = sorted(resource_limits or {})
    limits += [(resource_limits or {})[r] for r in resources]
    parent = document[0] if document else ""
    if document:
        limits.append(document[1])
    if quarantined:
        limits.append(policy.pool.quarantine_slots if quarantine_room is None else quarantine_room)
    tag, names = placement or job_placement(
        tenant=tenant, sub_tenant=sub_tenant, batch=batch, resources=resources, document=parent, quarantined=quarantined
    )
    # Fair order where a key is shared: at the shard and batch keys each tenant is a flow,
    # weighted by its floor per second of its jobs (flow_weight); at the tenant key each
    # sub-tenant is one (splitting work over many sub-tenants or keys gains nothing at the
    # shard: it is still one flow there).
    mean = signals.mean_seconds if signals.mean_seconds is not None else policy.pool.default_job_seconds
    tenant_flow = (tenant.slug, flow_weight(tenant.floor, mean))
    own_flow = (document_flow(parent), 1.0) if parent else None
    flows = [tenant_flow if batch else own_flow or (sub_tenant, 1.0), tenant_flow]
    if sub_tenant:
        flows.append(own_flow or ("", 1.0))
    flows += [tenant_flow] * len(resources)  # shared by tenants like the shard: one flow each
    if parent:
        flows.append(("", 1.0))  # the document's own key: its children alone
    if quarantined:
        flows.append(tenant_flow)
    keys = [
        KeyLimit(name, limit, flow, weight) for name, limit, (flow, weight) in zip(names, limits, flows, strict=True)
    ]
    # The pool's floor headroom: the shard key keeps `floor_headroom` of its slots for jobs of
    # tenants below their floor, and serves those jobs first, whatever their class (the
    # engine's reserve and floor band): a job is below its tenant's floor when its tenant key,
    # which it holds by then, has at most `floor` holders. Without headroom no job is banded,
    # so the classes' order holds strictly and a tenant that starts to wait is served next in
    # its class by the fair order alone. A batch job is never banded (it holds the batch key).
    reserve = shard_reserve(policy)
    if reserve:
        shard_at = names.index(SHARD_KEY)
        keys[shard_at] = dataclasses.replace(
            keys[shard_at],
            reserve=reserve,
            guard=None if batch else names[0],
            guarantee=0 if batch else tenant.floor,
        )
    return AdmissionPlan(tag=tag, keys=keys, priority=priority, tenant_limit=breakdown, sub_tenant_cap=cap)


def shard_reserve(policy: PolicySnapshot) -> int:
    """Slots of each shard's key kept for tenants below their floor (the pool's floor
    headroom); every call that passes the shard key's limit passes it too."""
    return policy.pool.floor_headroom
