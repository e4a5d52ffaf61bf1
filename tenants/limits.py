"""The per-tenant limit formula (Little's Law plus fleet pressure), as a pure function.

base     = max(floor, ceil(R * D / 60))             R submissions/min, D mean seconds
ceiling  = base + max(burst_floor, base * burst_pct)
pressure = clamp(pool_target / in_flight, f_min, f_max)
protected = min(ceiling, fair share)                 only while pressure < 1
limit    = min(max(floor(ceiling * pressure), ceil(protected), floor) + idle share, hard max, shard cap) + dedicated

Pressure alone squeezes every ceiling by the same factor, including the ceilings of
tenants that use less than their share, so a steady tenant would wait on its own limit
during someone else's burst. So when the pool is saturated a tenant never drops below
min(its ceiling, its max-min fair share of the pool target) (`fair_shares`,
water-filling): the squeeze lands on the tenants above their share, first.

The formula alone is not work-conserving: with one bursty tenant holding the backlog, its
limit settles where L = ceiling * target / (L + others), far below a full pool. So idle
slots are also shared out (`idle_shares`): tenants at their limit get an equal share of
the slots nobody holds, on top of what they hold; when the pool is over-held the share is
negative and they give slots back by not refilling them. Never below the formula.

Where a shard's capacity binds rather than the pool, the same two rules apply one level
down (`shard_caps`): a tenant that wants more than its max-min fair share of the shard is
capped at that share plus an equal part of the shard's free room, so it fills what its
shard-mates leave idle but gives back, within a tick, the slots a shard-mate is waiting
for instead of keeping its own jobs queued at the shard in front of theirs. The free room
it may fill excludes what its shard-mates held of late (up to their shares), so a steady
shard-mate's next job finds a slot free rather than waiting for one of the burst's jobs to
end: the shard then runs a little below its capacity while a burst and steady tenants
share it, the price of leaving the steady ones alone.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class LimitBreakdown:
    """Every term of one limit decision, so operators and customers can see why."""

    floor: int
    rate_per_min: float
    mean_seconds: float
    base: int
    ceiling: float
    pool_target: float
    in_flight: int
    pressure: float
    hard_max: int | None
    dedicated: int
    idle_share: int
    fair_share: float | None
    limit: int
    shard_cap: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tenant_limit(
    *,
    floor: int,
    burst_floor: int,
    burst_pct: float,
    max_concurrency: int | None,
    dedicated: int,
    rate_per_min: float,
    mean_seconds: float,
    pool_slots: int,
    target_utilisation: float,
    in_flight: int,
    f_min: float,
    f_max: float,
    idle_share: int = 0,
    fair_share: float | None = None,
    shard_cap: int | None = None,
) -> LimitBreakdown:
    """Compute a tenant's concurrency limit from its policy and the live signals."""
    base = max(floor, math.ceil(rate_per_min * mean_seconds / 60 - 1e-9))
    ceiling = base + max(burst_floor, base * burst_pct)
    pool_target = pool_slots * target_utilisation
    if pool_slots <= 0:
        # No live worker registered: nothing can run anyway, so don't pretend to know the pressure.
        pressure = 1.0
    elif in_flight <= 0:
        pressure = f_max
    else:
        pressure = min(max(pool_target / in_flight, f_min), f_max)
    squeezed = math.floor(ceiling * pressure + 1e-9)
    if pressure < 1.0 and fair_share is not None:
        squeezed = max(squeezed, math.ceil(min(ceiling, fair_share) - 1e-9))
    limit = max(squeezed, floor) + max(idle_share, 0)
    if max_concurrency is not None:
        limit = min(limit, max_concurrency)
    if shard_cap is not None:
        limit = min(limit, max(shard_cap, floor))
    return LimitBreakdown(
        floor=floor,
        rate_per_min=rate_per_min,
        mean_seconds=mean_seconds,
        base=base,
        ceiling=ceiling,
        pool_target=pool_target,
        in_flight=in_flight,
        pressure=pressure,
        hard_max=max_concurrency,
        dedicated=dedicated,
        idle_share=max(idle_share, 0),
        fair_share=fair_share,
        limit=limit + dedicated,
        shard_cap=shard_cap,
    )


def idle_shares(*, slots: int, in_flight: int, overcommit: float, demand: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Share the pool's unheld slots among tenants that are at their limit.

    `demand` maps each tenant at its formula limit to (held, formula limit); the result is
    the bonus on top of the formula for each, so that its limit becomes held + an equal
    share of `slots * (1 + overcommit) - in_flight` (the overcommit covers jobs in transit
    to a worker, which hold a slot without using it). Negative shares hand slots back.
    """
    if not demand or slots <= 0:
        return {}
    room = math.floor(slots * (1 + overcommit)) - in_flight
    share = math.ceil(room / len(demand)) if room > 0 else math.floor(room / len(demand))
    return {slug: max(0, held + share - formula) for slug, (held, formula) in demand.items()}


def fair_shares(*, pool_target: float, demand: dict[str, float], weight: dict[str, float]) -> dict[str, float]:
    """Each tenant's max-min fair share of the pool target (water-filling): a tenant that
    demands less than its weighted share of what is left gets all it demands; the others
    split the rest in proportion to their weights. Shares sum to at most the target."""
    left, weight_left = max(pool_target, 0.0), sum(max(weight[s], 1e-9) for s in demand)
    shares: dict[str, float] = {}
    ordered = sorted(demand, key=lambda s: demand[s] / max(weight[s], 1e-9))
    for i, slug in enumerate(ordered):
        w = max(weight[slug], 1e-9)
        level = left / weight_left if weight_left > 0 else 0.0
        if demand[slug] >= level * w:
            # Every tenant from here on demands at least the level, which then stays where
            # it is: one level for all (as arithmetic would have it; rounding would drift).
            for rest in ordered[i:]:
                shares[rest] = level * max(weight[rest], 1e-9)
            break
        shares[slug] = demand[slug]
        left -= shares[slug]
        weight_left -= w
    return shares


def shard_caps(
    *,
    capacity: int,
    holders: int,
    waiting: int,
    held: dict[str, int],
    wanting: set[str],
    weight: dict[str, float],
    floor: dict[str, int],
    recent: dict[str, float] | None = None,
    idle: set[str] | None = None,
) -> dict[str, int]:
    """Caps for the tenants of one shard whose capacity binds, or may bind.

    `held` maps each tenant of the shard to the slots of its own key (its running jobs and
    those queued at the shard key), `wanting` names those that want more than they hold
    (at their limit); `holders`/`waiting` are the shard key's holders and waiters;
    `recent` is what each tenant held of late (a mean over the last seconds of ticks).
    Each tenant's fair share of the shard is water-filled over demands (what it holds or
    held of late, whichever is more, or without bound if it wants more), weighted like the
    shard's fair order. A tenant that wants no more keeps room for min(what it held of
    late, its share): that much of the shard stays free for it
    between its jobs, so a steady tenant's next job finds a free slot instead of waiting
    behind a burst for one (the pool's pressure spares it the same way: `tenant_limit`).
    A wanting tenant is capped at max(its share, its floor, what it holds + an equal part
    of the room the shard has: capacity - holders - waiting - the room kept, negative
    while jobs queue at the shard). With room to spare the cap is what it holds plus that
    room: it may take every free slot not kept, but queues no more of its jobs at the shard
    key than the shard can start. The wanting tenants' shares are whole slots that add up
    to the whole part of theirs (largest remainders), so a fraction of a kept slot is not
    handed to them by rounding up. An `idle` tenant (it holds nothing and held nothing of
    late) is capped at max(its floor, the room a wanting tenant would share), so that its
    first burst takes the free room and not the room kept for its shard-mates: it would
    otherwise fill the whole shard before the next tick could cap it.
    """
    if not wanting and not idle:
        return {}
    recent = recent or {}
    unbounded = float(capacity)  # a wanting tenant's demand: more than the whole shard can give
    demand = {
        slug: (unbounded if slug in wanting else max(float(n), recent.get(slug, 0.0))) for slug, n in held.items()
    }
    share = fair_shares(pool_target=capacity, demand=demand, weight=weight)
    capped = [slug for slug in sorted(wanting) if slug in held]
    kept = sum(max(0.0, min(recent.get(slug, 0.0), share[slug]) - held[slug]) for slug in held if slug not in wanting)
    room = capacity - holders - waiting - math.floor(kept + 0.5)
    caps = {slug: max(floor.get(slug, 0), room) for slug in sorted(idle or ()) if slug in held and slug not in wanting}
    if capped:
        part = math.ceil(room / len(capped)) if room > 0 else math.floor(room / len(capped))
        whole = _whole_shares({slug: share[slug] for slug in capped})
        caps.update({slug: max(whole[slug], floor.get(slug, 0), held[slug] + part) for slug in capped})
    return caps


def _whole_shares(shares: dict[str, float]) -> dict[str, int]:
    """Round shares to whole slots that sum to the floor of their total: each gets the
    whole part of its own, and the slots left go to the largest remainders (ties by name)."""
    whole = {slug: math.floor(share + 1e-9) for slug, share in shares.items()}
    left = math.floor(sum(shares.values()) + 1e-9) - sum(whole.values())
    by_remainder = sorted(shares, key=lambda slug: (-(shares[slug] - whole[slug]), slug))
    for slug in by_remainder[: max(left, 0)]:
        whole[slug] += 1
    return whole
