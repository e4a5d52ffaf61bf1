"""What needs attention first: the tenants and the grid's shards, ranked.

A tenant's attention, most urgent first: the state of its oldest waits against their
objectives (red from twice the objective, orange from the objective, as the cells are
coloured), the worst such wait while red or orange (in quarters of the objective while
green, so a table of steady tenants does not reshuffle at every tick), then its waiting
jobs, its jobs in flight and its pressure (in flight over its limit: 1 or more is at its
limit), then its slug. Tenants with nothing waiting and nothing in flight all rank alike,
last, by slug: a fleet of idle tenants costs a scan and no sort.

A shard's attention in the grid: its worst cell (red, then orange), the worst wait against
the objective among its cells, then its name.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from typing import Any

from dashboard.snapshot import GREEN, ORANGE, RED, cell_state

STATE_RANK = {GREEN: 0, ORANGE: 1, RED: 2}
GREEN_STEPS = 4  # a green wait counts in quarters of its objective


def tenant_state(row: dict[str, Any]) -> str:
    """Green, orange or red by the tenant's worst wait against its objective."""
    ratio = row.get("oldest_wait_ratio")
    return cell_state(oldest_age_s=ratio, objective_s=1.0)


def tenant_pressure(row: dict[str, Any]) -> float:
    """Jobs in flight over the limit (0 for a tenant with none in flight)."""
    in_flight, limit = row["in_flight"], row["limit"]
    if not in_flight:
        return 0.0
    return in_flight / limit if limit > 0 else float(in_flight)


def tenant_attention(row: dict[str, Any]) -> tuple[int, float, int, int, float]:
    """The sort key: larger needs attention sooner."""
    ratio = row.get("oldest_wait_ratio") or 0.0
    rank = STATE_RANK[cell_state(oldest_age_s=ratio, objective_s=1.0)]
    wait = ratio if rank else math.floor(ratio * GREEN_STEPS) / GREEN_STEPS
    return (rank, wait, row["waiting"], row["in_flight"], tenant_pressure(row))


def tenants_top(rows: Sequence[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The n rows that need attention most; idle tenants fill what is left, in the rows'
    order (the snapshot's: by slug). Ties keep the rows' order too."""
    busy = [r for r in rows if r["waiting"] or r["in_flight"]]
    top = heapq.nlargest(n, busy, key=tenant_attention)  # stable: as sorted(..., reverse=True)[:n]
    if len(top) < n:
        for row in rows:
            if not (row["waiting"] or row["in_flight"]):
                top.append(row)
                if len(top) == n:
                    break
    return top


def cell_ratio(cell: dict[str, Any]) -> float:
    age = cell["oldest_age_s"]
    return age / cell["objective_s"] if age and cell["objective_s"] else 0.0


def shards_ranked(cells: Iterable[dict[str, Any]], shards: Sequence[str]) -> list[str]:
    """Every shard, the one whose cells need attention most first."""
    worst: dict[str, tuple[int, float]] = {shard: (0, 0.0) for shard in shards}
    for cell in cells:
        shard = cell["shard"]
        if shard not in worst:
            continue
        rank, ratio = STATE_RANK[cell["state"]], cell_ratio(cell)
        was = worst[shard]
        worst[shard] = (max(was[0], rank), max(was[1], ratio))
    # Worst first, then by name (the sort is stable over `shards`, which are sorted).
    return sorted(shards, key=lambda shard: (-worst[shard][0], -worst[shard][1] if worst[shard][0] else 0.0))
