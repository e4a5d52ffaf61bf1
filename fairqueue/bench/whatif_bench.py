"""`manage.py bench whatif`: how much faster than real time the what-if replays a busy shard.

A synthetic day of one shard (seeded): STEADY_TENANTS tenants with Poisson arrivals at
STEADY_RATE each and lognormal durations, plus one tenant bursting BURST_JOBS short jobs
every BURST_EVERY_S, on SLOTS worker slots: the pool is about half used on average and
saturated during the bursts, so the model's queues, handoffs and limit refreshes all work.
The figure is simulated seconds per wall second of one `simulate` run (a preview runs
two: the current policy and the proposed one). No Redis, no database: the model alone.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from typing import Any

from fairqueue.simulation.calibration import Distribution, Latencies
from fairqueue.simulation.records import Arrival
from fairqueue.simulation.scheduler import SimConfig, simulate
from tenants.policy import ClassPolicy, PolicySnapshot, PoolPolicy, ShardPolicy, TenantPolicy

SEED = 11
SLOTS = 32
STEADY_TENANTS = 8
STEADY_RATE = 0.6  # jobs per second, per steady tenant
STEADY_MEAN_S = 2.0
BURST_JOBS = 3000
BURST_EVERY_S = 3600.0
BURST_MEAN_S = 0.5
SIGMA = 1.0
MAX_JOB_S = 60.0
# The stack's latencies: a few milliseconds each, as bench noisy measures them on one host.
LATENCIES = Latencies(
    admit=Distribution.flat((0.001, 0.002, 0.003, 0.008)),
    dispatch=Distribution.flat((0.006, 0.008, 0.012, 0.03)),
    turnaround=Distribution.flat((0.01, 0.015, 0.03)),
)
HOURS = {"default": 24.0, "quick": 1.0}
TARGET_RATIO = 1000.0
SHARD = "busy"


def workload(hours: float, seed: int = SEED) -> tuple[PolicySnapshot, list[Arrival]]:
    rnd = random.Random(seed)
    span = hours * 3600

    def duration(mean: float) -> float:
        return min(rnd.lognormvariate(math.log(mean) - SIGMA**2 / 2, SIGMA), MAX_JOB_S)

    arrivals = []
    for i in range(STEADY_TENANTS):
        t = rnd.expovariate(STEADY_RATE)
        while t < span:
            sub = f"c{rnd.randrange(20)}" if i % 2 else ""
            arrivals.append(Arrival(at=t, tenant=f"steady-{i}", duration=duration(STEADY_MEAN_S), sub_tenant=sub))
            t += rnd.expovariate(STEADY_RATE)
    burst_at = min(600.0, span / 2)
    while burst_at < span:
        arrivals += [
            Arrival(at=burst_at + k * 0.002, tenant="bursty", duration=duration(BURST_MEAN_S))
            for k in range(BURST_JOBS)
        ]
        burst_at += BURST_EVERY_S
    arrivals.sort(key=lambda a: a.at)
    tenants = {f"steady-{i}": TenantPolicy.plain(f"steady-{i}", shard=SHARD) for i in range(STEADY_TENANTS)}
    tenants["bursty"] = TenantPolicy.plain("bursty", shard=SHARD)
    policy = PolicySnapshot(
        tenants=tenants,
        shards={SHARD: ShardPolicy(SHARD, 200, 1)},
        classes={"default": ClassPolicy("default", 3600, 100, 1)},
        pool=replace(PoolPolicy()),
    )
    return policy, arrivals


def run(*, quick: bool, hours: float | None = None, log: Any = print) -> dict[str, Any]:
    hours = hours or HOURS["quick" if quick else "default"]
    policy, arrivals = workload(hours)
    log(f"bench whatif: {hours:g} h of a busy shard, {len(arrivals):,} jobs, {SLOTS} slots")
    t0 = time.perf_counter()
    result = simulate(
        arrivals, policy=policy, shard=SHARD, config=SimConfig(slots=SLOTS, latencies=LATENCIES, end=hours * 3600)
    )
    wall = time.perf_counter() - t0
    ratio = hours * 3600 / wall
    doc = {
        "hours": hours,
        "jobs": len(arrivals),
        "slots": SLOTS,
        "wall_s": round(wall, 2),
        "simulated_s_per_wall_s": round(ratio),
        "refreshes": result.refreshes,
        "utilisation": round(result.utilisation or 0.0, 3),
        "peak_waiting": result.peak_waiting,
        "stranded": result.stranded,
        "target": f"at least {TARGET_RATIO:,.0f}x real time (24 h in under {24 * 3600 / TARGET_RATIO:.0f} s)",
        "met": ratio >= TARGET_RATIO,
    }
    log(
        f"  simulated in {wall:.1f} s: {ratio:,.0f}x real time ({result.refreshes:,} limit refreshes, "
        f"utilisation {doc['utilisation']:.0%}, at most {result.peak_waiting:,} waiting)"
    )
    log(f"{'PASS' if doc['met'] else 'MISS'} {doc['target']}")
    return doc
