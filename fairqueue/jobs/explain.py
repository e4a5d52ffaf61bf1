"""A tenant's limit and load in words, term by term: what the admin's live state panel
says (the same numbers as /api/v1/limits, which gives them as fields)."""

from __future__ import annotations

import math

from tenants.limits import LimitBreakdown
from tenants.policy import PolicySnapshot, TenantPolicy

TIMES = "\N{MULTIPLICATION SIGN}"
# tenants.limits.tenant_limit compares with this slack (a float product that should be whole).
EPSILON = 1e-9


def _n(value: float) -> str:
    """A number as an operator reads it: whole numbers without decimals, others with two."""
    return f"{value:,.0f}" if abs(value - round(value)) < EPSILON else f"{value:,.2f}"


def seconds_text(seconds: float) -> str:
    """A duration to read at a glance: tenths below ten seconds, then whole seconds."""
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:,.0f} s"


def limit_sentences(policy: PolicySnapshot, tenant: TenantPolicy, b: LimitBreakdown, *, slots: int) -> list[str]:
    """How the limit came out of its terms: the limit, the ceiling and base, the pressure."""
    squeezed = math.floor(b.ceiling * b.pressure + EPSILON)
    terms = [f"ceiling {_n(b.ceiling)} {TIMES} pressure {b.pressure:.2f} = {squeezed}"]
    protected = None
    if b.pressure < 1.0 and b.fair_share is not None:
        protected = math.ceil(min(b.ceiling, b.fair_share) - EPSILON)
        terms.append(f"fair share {_n(b.fair_share)} → {protected}")
    terms.append(f"floor {b.floor}")
    formula = max(squeezed, protected or 0, b.floor)
    text = f"limit {b.limit} = max({', '.join(terms)}) = {formula}"
    value = formula
    if b.idle_share:
        text += f", + idle share {b.idle_share}"
        value += b.idle_share
    if b.hard_max is not None and value > b.hard_max:
        text += f", at most the hard max {b.hard_max}"
        value = b.hard_max
    if b.dedicated:
        text += f", + dedicated {b.dedicated}"
        value += b.dedicated
    shard = policy.shards.get(tenant.shard)
    if shard is not None and b.limit < value:
        cap = max(shard.capacity, tenant.floor)
        text += (
            f", at most shard {tenant.shard}'s capacity {cap}"
            if b.limit == cap
            else f", less {value - b.limit} still held where it was moved from"
        )
    burst = f"max(burst floor {tenant.burst_floor}, {tenant.burst_pct:.0%} of base)"
    rate = (
        f"⌈{_n(b.rate_per_min)} jobs/min {TIMES} {b.mean_seconds:.2f} s mean / 60⌉"
        if b.rate_per_min
        else "no steady submissions yet"
    )
    sentences = [
        text,
        f"ceiling {_n(b.ceiling)} = base {b.base} + {burst}; base {b.base} = max(floor {b.floor}, {rate})",
    ]
    pool = policy.pool
    if slots <= 0:
        sentences.append("pressure 1: no live worker, so nothing to measure it against")
    elif b.in_flight <= 0:
        sentences.append(f"pressure {_n(b.pressure)} (f_max): nothing in flight on a pool of {slots} slots")
    else:
        sentences.append(
            f"pressure {b.pressure:.2f} = pool target {_n(b.pool_target)} ({slots} slots {TIMES} "
            f"{pool.target_utilisation:.0%}) / {b.in_flight:,} in flight, kept within "
            f"[{_n(pool.f_min)}, {_n(pool.f_max)}]"
        )
    return sentences


def load_sentence(
    *, in_flight: int, parked: int, by_priority: dict[int, int], oldest: str | None, counts: dict[str, int]
) -> str:
    """What the tenant runs and what waits: the engine's counts, then the database's."""
    text = f"{in_flight:,} in flight, {parked:,} parked"
    if len(by_priority) > 1:
        text += " (" + "; ".join(f"priority {p}: {n:,}" for p, n in by_priority.items()) + ")"
    if oldest:
        text += f"; {oldest}"
    return (
        text + f". Jobs in the database: {counts.get('queued', 0):,} queued, {counts.get('parked', 0):,} parked, "
        f"{counts.get('running', 0):,} running."
    )
