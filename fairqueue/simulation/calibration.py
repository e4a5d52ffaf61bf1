"""The stack's own latencies, measured from finished jobs, for the simulation's parameters.

A job's wait is not only its time parked: the web process admits it a moment after the
row is written, the broker and a worker take a moment to start it, and a worker slot takes
a moment between one job and the next. The replay measures each from the very rows it
replays, as a distribution the simulation draws from (a constant would give every job the
median and no job the tail that makes a P99):

- admit: submitted -> admitted, for jobs admitted at submit: no job of their tenant
  finished in between, so no release of its key (or a sub-tenant's) can have woken them.
  (A wait on a binding shard key, or a wake by a raised limit, would pass for an admit:
  both are rare next to the admissions that test a tenant's own limit.) Counting any
  job's finish instead would keep only the admits of quiet moments, whose latency is
  shortest, and miss how slow a busy web process admits;
- dispatch: admitted -> started, for those same jobs when they found the pool with room
  (fewer jobs running or admitted-and-not-started than slots): an idle slot's pick-up.
  (Jobs woken by a release are left out: a slot that frees is busy again after a
  turnaround, and those jobs' dispatch mixes both);
- turnaround: a worker slot's finish -> its next start, for starts whose job was ready
  (admitted + the median dispatch) before the slot freed, so the slot, not the job, was
  what it waited for (see _slot_gaps).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from fairqueue.simulation.records import JobTiming

# A distribution is kept as at most this many evenly spaced order statistics per activity
# level: a day of jobs then costs a few kilobytes, and draws from it keep the shape.
MAX_SAMPLES = 1001
LATENCY_NAMES = ("admit", "dispatch", "turnaround")
# The stack is slower when it is busy (one host's cores serve the web process, the broker
# and the workers): each latency is kept per level of activity, jobs started in the
# ACTIVITY_WINDOW_S before the sample per slot, in up to ACTIVITY_LEVELS levels of equal
# counts, as many as give each MIN_PER_LEVEL samples.
ACTIVITY_WINDOW_S = 1.0
ACTIVITY_LEVELS = 3
MIN_PER_LEVEL = 12


def _quantiles(values: list[float]) -> tuple[float, ...]:
    ordered = sorted(values)
    if len(ordered) <= MAX_SAMPLES:
        return tuple(ordered)
    step = (len(ordered) - 1) / (MAX_SAMPLES - 1)
    return tuple(ordered[round(i * step)] for i in range(MAX_SAMPLES))


@dataclass(frozen=True)
class Distribution:
    """Latency samples (seconds, sorted) by the activity they were taken at: `levels[i]`
    holds those with activity at most `edges[i]`, the last level the rest."""

    edges: tuple[float, ...] = ()
    levels: tuple[tuple[float, ...], ...] = ()

    @classmethod
    def flat(cls, values: Sequence[float]) -> Distribution:
        """One level: the same draws at any activity."""
        return cls((), (tuple(sorted(values)),) if values else ())

    @classmethod
    def of(cls, samples: list[tuple[float, float]]) -> Distribution:
        """From (activity, seconds) samples."""
        levels = min(ACTIVITY_LEVELS, len(samples) // MIN_PER_LEVEL)
        if levels <= 1:
            return cls.flat(_quantiles([seconds for _, seconds in samples]))
        ordered = sorted(samples)
        size = len(ordered) / levels
        cuts = [round(size * i) for i in range(levels + 1)]
        parts = [ordered[cuts[i] : cuts[i + 1]] for i in range(levels)]
        edges = tuple(part[-1][0] for part in parts[:-1])
        return cls(edges, tuple(_quantiles([seconds for _, seconds in part]) for part in parts))

    def values(self) -> list[float]:
        return sorted(v for level in self.levels for v in level)

    def draw(self, u: float, activity: float) -> float:
        """The sample at uniform `u` in [0, 1) of the level of `activity` (0 if none)."""
        if not self.levels:
            return 0.0
        level = self.levels[bisect.bisect_left(self.edges, activity)]
        return level[int(u * len(level))]


@dataclass(frozen=True)
class Latencies:
    """Measured distributions (empty when no job qualified)."""

    admit: Distribution = field(default_factory=Distribution)
    dispatch: Distribution = field(default_factory=Distribution)
    turnaround: Distribution = field(default_factory=Distribution)

    def as_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {}
        for name in LATENCY_NAMES:
            values = getattr(self, name).values()
            out[f"{name}_p50_s"] = round(statistics.median(values), 4) if values else None
            out[f"{name}_samples"] = len(values)
        return out


class _Activity:
    """Jobs started in the ACTIVITY_WINDOW_S up to a time, per slot."""

    def __init__(self, started: list[float], slots: int) -> None:
        self.started, self.slots = started, max(slots, 1)

    def at(self, t: float) -> float:
        window = bisect.bisect_right(self.started, t) - bisect.bisect_right(self.started, t - ACTIVITY_WINDOW_S)
        return window / self.slots


def _slot_gaps(runs: list[JobTiming], ready_after: float) -> list[tuple[float, float]]:
    """One worker's slot turnarounds: each start takes the slot that has been free longest
    (its finishes queue up in order), and counts when its job was ready before that slot
    freed. A worker whose intake lags (its slots free, messages waiting) shows here as long
    gaps, which is what the model needs: a slot there is of no use for that long."""
    slots = _most_at_once(runs)
    events = sorted([(j.started, 1, j) for j in runs] + [(j.finished, -1, j) for j in runs], key=lambda e: (e[0], e[1]))
    free: list[float] = [-math.inf] * slots  # its slots, by the time each freed (never: -inf)
    gaps: list[tuple[float, float]] = []  # (when the slot freed, its gap)
    head = 0
    for at, kind, job in events:
        if kind == -1:
            free.append(at)
            continue
        freed = free[head] if head < len(free) else -math.inf
        head += 1
        if freed != -math.inf and job.admitted + ready_after <= freed:
            gaps.append((freed, at - freed))
    return gaps


def _most_at_once(runs: list[JobTiming]) -> int:
    running = most = 0
    for _, step in sorted([(j.started, 1) for j in runs] + [(j.finished, -1) for j in runs]):
        running += step
        most = max(most, running)
    return most


def latencies_measure(jobs: Sequence[JobTiming], *, slots: int) -> Latencies:
    """The latencies of the stack the jobs ran on (`slots`: the pool's size then)."""
    admitted = sorted(j.admitted for j in jobs)
    started = sorted(j.started for j in jobs)
    finished = sorted(j.finished for j in jobs)
    finished_by_tenant: dict[str, list[float]] = {}
    for j in jobs:
        finished_by_tenant.setdefault(j.tenant, []).append(j.finished)
    for values in finished_by_tenant.values():
        values.sort()
    activity = _Activity(started, slots)
    admit: list[tuple[float, float]] = []
    dispatch: list[tuple[float, float]] = []
    for j in jobs:
        a = j.admitted
        own = finished_by_tenant[j.tenant]
        at_submit = bisect.bisect_right(own, a) == bisect.bisect_right(own, j.submitted)
        if at_submit:
            admit.append((activity.at(j.submitted), a - j.submitted))
        running = bisect.bisect_right(started, a) - bisect.bisect_right(finished, a)
        # Jobs admitted with it (a bulk submit) count too: they compete for the same slots.
        pending = bisect.bisect_right(admitted, a) - 1 - bisect.bisect_left(started, a)
        if at_submit and running + pending < slots:
            dispatch.append((activity.at(a), j.started - a))
    ready_after = statistics.median(seconds for _, seconds in dispatch) if dispatch else 0.0
    by_worker: dict[str, list[JobTiming]] = {}
    for j in jobs:
        if j.worker:
            by_worker.setdefault(j.worker, []).append(j)
    turnaround = [
        (activity.at(freed), gap) for runs in by_worker.values() for freed, gap in _slot_gaps(runs, ready_after)
    ]
    return Latencies(
        admit=Distribution.of(admit), dispatch=Distribution.of(dispatch), turnaround=Distribution.of(turnaround)
    )
