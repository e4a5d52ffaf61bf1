"""The stack's own latencies, measured from finished jobs, for the simulation's parameters.

A job's wait is not only its time parked: the web process admits it a moment after the
row is written, the broker and a worker take a moment to start it, and a worker slot takes
a moment between one job and the next. The replay measures each from the very rows it
replays, as a distribution the simulation draws from (a constant would give every job the
median and no job the tail that makes a P99):

- admit: submitted -> admitted, for jobs admitted at submit (no job finished in between,
  so no release can have woken them);
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
from dataclasses import dataclass

from fairqueue.simulation.records import JobTiming

# A distribution is kept as at most this many evenly spaced order statistics: a day of
# jobs then costs a few kilobytes, and draws from it keep the shape.
MAX_SAMPLES = 1001
LATENCY_NAMES = ("admit", "dispatch", "turnaround")


def _quantiles(values: list[float]) -> tuple[float, ...]:
    ordered = sorted(values)
    if len(ordered) <= MAX_SAMPLES:
        return tuple(ordered)
    step = (len(ordered) - 1) / (MAX_SAMPLES - 1)
    return tuple(ordered[round(i * step)] for i in range(MAX_SAMPLES))


@dataclass(frozen=True)
class Latencies:
    """Measured distributions (sorted seconds; empty when no job qualified)."""

    admit: tuple[float, ...] = ()
    dispatch: tuple[float, ...] = ()
    turnaround: tuple[float, ...] = ()

    def as_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {}
        for name in LATENCY_NAMES:
            values: tuple[float, ...] = getattr(self, name)
            out[f"{name}_p50_s"] = round(statistics.median(values), 4) if values else None
            out[f"{name}_samples"] = len(values)
        return out


def _slot_gaps(runs: list[JobTiming], ready_after: float) -> list[float]:
    """One worker's slot turnarounds: each start takes the slot that has been free longest
    (its finishes queue up in order), and counts when its job was ready before that slot
    freed. A worker whose intake lags (its slots free, messages waiting) shows here as long
    gaps, which is what the model needs: a slot there is of no use for that long."""
    slots = _most_at_once(runs)
    events = sorted([(j.started, 1, j) for j in runs] + [(j.finished, -1, j) for j in runs], key=lambda e: (e[0], e[1]))
    free: list[float] = [-math.inf] * slots  # its slots, by the time each freed (never: -inf)
    gaps = []
    head = 0
    for at, kind, job in events:
        if kind == -1:
            free.append(at)
            continue
        freed = free[head] if head < len(free) else -math.inf
        head += 1
        if freed != -math.inf and job.admitted + ready_after <= freed:
            gaps.append(at - freed)
    return gaps


def _most_at_once(runs: list[JobTiming]) -> int:
    running = most = 0
    for _, step in sorted([(j.started, 1) for j in runs] + [(j.finished, -1) for j in runs]):
        running += step
        most = max(most, running)
    return most


def latencies_measure(jobs: Sequence[JobTiming], *, slots: int) -> Latencies:
    """The four latencies of the stack the jobs ran on (`slots`: the pool's size then)."""
    admitted = sorted(j.admitted for j in jobs)
    started = sorted(j.started for j in jobs)
    finished = sorted(j.finished for j in jobs)
    admit: list[float] = []
    dispatch: list[float] = []
    for j in jobs:
        a = j.admitted
        at_submit = bisect.bisect_right(finished, a) == bisect.bisect_right(finished, j.submitted)
        if at_submit:
            admit.append(a - j.submitted)
        running = bisect.bisect_right(started, a) - bisect.bisect_right(finished, a)
        # Jobs admitted with it (a bulk submit) count too: they compete for the same slots.
        pending = bisect.bisect_right(admitted, a) - 1 - bisect.bisect_left(started, a)
        if at_submit and running + pending < slots:
            dispatch.append(j.started - a)
    ready_after = statistics.median(dispatch) if dispatch else 0.0
    by_worker: dict[str, list[JobTiming]] = {}
    for j in jobs:
        if j.worker:
            by_worker.setdefault(j.worker, []).append(j)
    turnaround: list[float] = []
    for runs in by_worker.values():
        turnaround += _slot_gaps(runs, ready_after)
    return Latencies(
        admit=_quantiles(admit),
        dispatch=_quantiles(dispatch),
        turnaround=_quantiles(turnaround),
    )
