"""The per-tenant limit formula (Little's Law plus fleet pressure), as a pure function.

base     = max(floor, ceil(R * D / 60))             R submissions/min, D mean seconds
ceiling  = base + max(burst_floor, base * burst_pct)
pressure = clamp(pool_target / in_flight, f_min, f_max)
limit    = min(max(floor(ceiling * pressure), floor), hard max) + dedicated
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
    limit: int

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
    limit = max(math.floor(ceiling * pressure + 1e-9), floor)
    if max_concurrency is not None:
        limit = min(limit, max_concurrency)
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
        limit=limit + dedicated,
    )
