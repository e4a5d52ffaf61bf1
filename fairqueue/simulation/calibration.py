"""The stack's own latencies, measured from finished jobs, for the simulation's parameters.

A job's wait is not only its time parked: the web process admits it a moment after the
row is written, the broker and a worker take a moment to start it, and a worker slot takes
a moment between one job and the next. The replay measures each from the very rows it
replays, as a distribution the simulation draws from (a constant would give every job the
median and no job the tail that makes a P99):

- admit: submitted -> admitted, for jobs admitted at submit (no job finished in between,
  so no release can have woken them);
- dispatch: admitted -> started, for those same jobs when they found the pool with room
  (fewer jobs running or admitted-and-not-started than slots): the web process publishes
  them;
- handoff: admitted -> started likewise for the other jobs, woken by a release: the
  releasing worker publishes them after recording its own job, so they take longer;
- turnaround: a worker's last finish -> its next start, for starts whose job was ready
  (admitted + the median dispatch) before that finish, so the slot, not the job, was what
  it waited for.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JobTiming:
    """A finished job's timestamps (unix seconds) and the worker that ran it."""

    submitted: float
    admitted: float
    started: float
    finished: float
    worker: str = ""


# A distribution is kept as at most this many evenly spaced order statistics: a day of
# jobs then costs a few kilobytes, and draws from it keep the shape.
MAX_SAMPLES = 1001
LATENCY_NAMES = ("admit", "dispatch", "handoff", "turnaround")


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
    handoff: tuple[float, ...] = ()
    turnaround: tuple[float, ...] = ()

    def as_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {}
        for name in LATENCY_NAMES:
            values: tuple[float, ...] = getattr(self, name)
            out[f"{name}_p50_s"] = round(statistics.median(values), 4) if values else None
            out[f"{name}_samples"] = len(values)
        return out


def latencies_measure(jobs: Sequence[JobTiming], *, slots: int) -> Latencies:
    """The four latencies of the stack the jobs ran on (`slots`: the pool's size then)."""
    admitted = sorted(j.admitted for j in jobs)
    started = sorted(j.started for j in jobs)
    finished = sorted(j.finished for j in jobs)
    admit: list[float] = []
    dispatch: list[float] = []
    handoff: list[float] = []
    for j in jobs:
        a = j.admitted
        at_submit = bisect.bisect_right(finished, a) == bisect.bisect_right(finished, j.submitted)
        if at_submit:
            admit.append(a - j.submitted)
        running = bisect.bisect_right(started, a) - bisect.bisect_right(finished, a)
        # Jobs admitted with it (a bulk submit) count too: they compete for the same slots.
        pending = bisect.bisect_right(admitted, a) - 1 - bisect.bisect_left(started, a)
        if running + pending < slots:
            (dispatch if at_submit else handoff).append(j.started - a)
    ready_after = statistics.median(dispatch + handoff) if dispatch or handoff else 0.0
    finishes_by_worker: dict[str, list[float]] = {}
    for j in jobs:
        if j.worker:
            finishes_by_worker.setdefault(j.worker, []).append(j.finished)
    for values in finishes_by_worker.values():
        values.sort()
    turnaround = []
    for j in jobs:
        finishes = finishes_by_worker.get(j.worker)
        if not finishes:
            continue
        k = bisect.bisect_right(finishes, j.started) - 1
        if k >= 0 and j.admitted + ready_after <= finishes[k]:
            turnaround.append(j.started - finishes[k])
    return Latencies(
        admit=_quantiles(admit),
        dispatch=_quantiles(dispatch),
        handoff=_quantiles(handoff),
        turnaround=_quantiles(turnaround),
    )
