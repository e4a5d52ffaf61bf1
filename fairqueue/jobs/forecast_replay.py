"""Replaying a recorded week against two autoscalers: utilisation alone, and slots desired.

A trace is a CSV of jobs, `submitted_at,duration_s[,latency_class]` (unix seconds or
ISO-8601 times; a header row is optional). Its last seven days are replayed minute by
minute; the weeks before them are the history the forecast learns from, hour by hour as
production does (fairqueue.jobs.forecast, the same code). Both autoscalers work in whole
workers of `worker_slots` slots, never go under `min_slots`, and see their capacity only
after the warm-up: a worker asked for at minute m serves from minute m + warm-up, one
removed is gone at once, so the ready capacity is min(desired now, desired a warm-up ago).

- *utilisation alone* asks for the busy slots it saw at the target utilisation. It only
  sees work that runs, so while demand exceeds its capacity it grows by 1/target per
  warm-up, like an HPA on `fairqueue_slot_utilisation_nonbatch`.
- *slots desired* asks for the larger of that and the forecast's peak within the warm-up
  (`fairqueue_slots_desired`).

Demand is what would run if capacity were unlimited: every job from its submission for
its duration. *Needed* is that demand at the target utilisation. Over-provisioned
slot-hours add up ready capacity above the need, under-provisioned ones the need above
ready capacity, minute by minute. For each step up (one more worker) the utilisation
autoscaler asked for, the report says how many minutes earlier the forecast autoscaler
had asked for that many workers (negative: later).

`trace_synthetic` makes a deterministic trace with a daily shape (quiet nights, a morning
rise, a lunch dip, an evening fall) and a weekly one (quiet weekends).
"""

from __future__ import annotations

import csv
import itertools
import math
import random
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fairqueue.jobs.forecast import (
    DEFAULT_DECAY,
    DEFAULT_SPREAD_SIGMAS,
    DEFAULT_WEEKS,
    SECONDS_PER_HOUR,
    forecast_peak,
    hour_index,
    profile_build,
    slots_for,
)

MINUTE = 60
DAY_SECONDS = 24 * SECONDS_PER_HOUR
WEEK_SECONDS = 7 * DAY_SECONDS
REPLAY_DAYS = 7
STABILISATION_SECONDS = 600  # deploy/worker-hpa.yaml's scale-down stabilisation window
LEAD_LOOKBACK_SECONDS = 12 * SECONDS_PER_HOUR
STEP_REARM_SECONDS = SECONDS_PER_HOUR
RISING = 1.1  # an hour whose demand is 10 % over the hour before is on a rise
SIGNAL_MINUTES = 2  # deploy/prometheus-adapter-rules.yaml averages the signal over 2 minutes
BURN_IN_SECONDS = 6 * SECONDS_PER_HOUR  # both autoscalers settle before the measured week
DEFAULT_CLASS = "default"
# The synthetic trace starts on a Monday, 00:00 UTC.
SYNTHETIC_START = datetime(2026, 1, 5, tzinfo=UTC).timestamp()
# (hour of day, share of the daily peak): quiet night, morning rise, lunch dip, evening fall.
DAILY_SHAPE = (
    (0.0, 0.12),
    (6.0, 0.12),
    (7.0, 0.3),
    (9.0, 0.95),
    (12.0, 1.0),
    (13.0, 0.8),
    (14.0, 0.95),
    (17.0, 0.9),
    (19.0, 0.4),
    (22.0, 0.18),
    (24.0, 0.12),
)
WEEKLY_SHAPE = (1.0, 1.0, 0.97, 1.0, 0.9, 0.4, 0.3)  # Monday .. Sunday
WEEK_JITTER = 0.08  # each week's level within ±8 % of the base
DAY_JITTER = 0.05
CLASS_MIX = (("default", 0.7), ("high", 0.25), ("critical", 0.05))
DURATION_SIGMA = 0.8  # lognormal spread of job durations


@dataclass(frozen=True)
class TraceJob:
    submitted_at: float
    duration_s: float
    latency_class: str = DEFAULT_CLASS


class TraceError(ValueError):
    """A trace that cannot be read; the message names the line."""


def _timestamp(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        moment = datetime.fromisoformat(text)
        return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def trace_read(path: Path) -> list[TraceJob]:
    jobs = []
    with path.open(newline="") as f:
        for line, row in enumerate(csv.reader(f), start=1):
            if not row or row[0].startswith("#"):
                continue
            if line == 1 and row[0].strip().lower() in ("submitted_at", "submit", "ts", "timestamp"):
                continue  # the header
            if len(row) < 2:
                raise TraceError(f"{path}:{line}: expected submitted_at,duration_s[,latency_class]")
            try:
                submitted, duration = _timestamp(row[0].strip()), float(row[1])
            except ValueError as exc:
                raise TraceError(f"{path}:{line}: {exc}") from exc
            if not math.isfinite(duration) or duration < 0:
                raise TraceError(f"{path}:{line}: duration must be a number of seconds >= 0")
            cls = row[2].strip() if len(row) > 2 and row[2].strip() else DEFAULT_CLASS
            jobs.append(TraceJob(submitted, duration, cls))
    if not jobs:
        raise TraceError(f"{path}: no jobs")
    return sorted(jobs, key=lambda j: j.submitted_at)


def trace_write(path: Path, jobs: Iterable[TraceJob]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["submitted_at", "duration_s", "latency_class"])
        for j in jobs:
            out.writerow([f"{j.submitted_at:.3f}", f"{j.duration_s:.3f}", j.latency_class])


def daily_shape(hour_of_day: float) -> float:
    for (h0, v0), (h1, v1) in itertools.pairwise(DAILY_SHAPE):
        if h0 <= hour_of_day <= h1:
            return v0 + (v1 - v0) * (hour_of_day - h0) / (h1 - h0)
    return DAILY_SHAPE[-1][1]


def _poisson(rng: random.Random, mean: float) -> int:
    if mean > 30:  # the normal approximation, where Knuth's product would underflow slowly
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def trace_synthetic(
    *, weeks: int = 5, seed: int = 1, peak_slots: float = 48.0, mean_seconds: float = 300.0
) -> list[TraceJob]:
    """Jobs whose demand peaks near `peak_slots` busy slots on weekdays around midday."""
    rng = random.Random(seed)
    peak_rate = peak_slots / mean_seconds  # jobs per second at the daily peak
    mu = math.log(mean_seconds) - DURATION_SIGMA**2 / 2
    classes = [name for name, _ in CLASS_MIX]
    weights = [share for _, share in CLASS_MIX]
    jobs = []
    for week in range(weeks):
        week_level = 1 + rng.uniform(-WEEK_JITTER, WEEK_JITTER)
        for day in range(7):
            level = week_level * WEEKLY_SHAPE[day] * (1 + rng.uniform(-DAY_JITTER, DAY_JITTER))
            day_start = SYNTHETIC_START + week * WEEK_SECONDS + day * DAY_SECONDS
            for minute in range(24 * 60):
                rate = peak_rate * level * daily_shape(minute / 60)
                for _ in range(_poisson(rng, rate * MINUTE)):
                    at = day_start + minute * MINUTE + rng.random() * MINUTE
                    duration = rng.lognormvariate(mu, DURATION_SIGMA)
                    jobs.append(TraceJob(at, duration, rng.choices(classes, weights)[0]))
    jobs.sort(key=lambda j: j.submitted_at)
    return jobs


def _minute_demand(jobs: Sequence[TraceJob], start: float, minutes: int) -> dict[str, list[float]]:
    """Mean busy slots per minute and class, if every job ran from its submission."""
    demand: dict[str, list[float]] = defaultdict(lambda: [0.0] * minutes)
    for j in jobs:
        series = demand[j.latency_class]
        begin, end = j.submitted_at - start, j.submitted_at - start + j.duration_s
        m = int(begin // MINUTE)
        while m < minutes and m * MINUTE < end:
            overlap = min(end, (m + 1) * MINUTE) - max(begin, m * MINUTE)
            series[m] += overlap / MINUTE
            m += 1
    return dict(demand)


def _ready(desired: list[int], m: int, lag: int, first: int) -> int:
    return min(desired[m], desired[max(first, m - lag)])


def _leads(
    util: list[int], fore: list[int], *, first: int, last: int, worker_slots: int
) -> tuple[list[tuple[int, float]], int]:
    """Minutes by which `fore` reached each step up that `util` took in [first, last).

    A step up is a level utilisation asks for that it has not asked for in the previous
    STEP_REARM_SECONDS: a new high of a rise, not the flapping around a plateau. Looking
    back from a step, the forecast is credited from when it last rose to that level, but
    not from before utilisation itself last left the level (the same capacity then) nor
    more than LEAD_LOOKBACK_SECONDS."""
    leads: list[tuple[int, float]] = []  # (minute of the step, lead)
    never = 0
    lookback = LEAD_LOOKBACK_SECONDS // MINUTE
    rearm = STEP_REARM_SECONDS // MINUTE
    for m in range(max(first, 1), last):
        before, after = util[m - 1] // worker_slots, util[m] // worker_slots
        recent_high = max(util[max(0, m - rearm) : m]) // worker_slots
        for level in range(max(before, recent_high) + 1, after + 1):
            need = level * worker_slots
            if fore[m] >= need:
                start, floor = m, max(0, m - lookback)
                while start > floor and fore[start - 1] >= need and util[start - 1] < need:
                    start -= 1
                leads.append((m, float(m - start)))
            else:
                later = next((t for t in range(m, len(fore)) if fore[t] >= need), None)
                if later is None:
                    never += 1
                else:
                    leads.append((m, float(m - later)))
    return leads, never


def replay(
    jobs: Sequence[TraceJob],
    *,
    warmup_seconds: float,
    target_utilisation: float,
    worker_slots: int,
    min_slots: int,
    weeks: int = DEFAULT_WEEKS,
    decay: float = DEFAULT_DECAY,
    spread_sigmas: float = DEFAULT_SPREAD_SIGMAS,
    stabilisation_seconds: float = STABILISATION_SECONDS,
) -> dict[str, Any]:
    """Replay the last seven days of `jobs`; see the module docstring for the figures."""
    first_ts = jobs[0].submitted_at
    trace_start = math.floor(first_ts / SECONDS_PER_HOUR) * SECONDS_PER_HOUR
    replay_end = math.ceil(jobs[-1].submitted_at / SECONDS_PER_HOUR) * SECONDS_PER_HOUR
    replay_start = replay_end - REPLAY_DAYS * DAY_SECONDS
    if replay_start - trace_start < WEEK_SECONDS:
        days = (replay_end - trace_start) / DAY_SECONDS
        raise TraceError(
            f"the trace spans {days:.1f} days: the forecast learns from the weeks before the replayed one, "
            "so give at least two weeks"
        )
    minutes = int((replay_end - trace_start) // MINUTE)
    by_class = _minute_demand(jobs, trace_start, minutes)
    demand = [sum(series[m] for series in by_class.values()) for m in range(minutes)]
    hourly: dict[str, dict[int, float]] = {}
    start_hour = hour_index(trace_start)
    for cls, series in by_class.items():
        # Every hour of the trace; profile_build reads only the hours before "now".
        hourly[cls] = {start_hour + h: sum(series[h * 60 : (h + 1) * 60]) / 60 for h in range(minutes // 60)}

    def workers(slots: int) -> int:
        return max(min_slots, math.ceil(slots / worker_slots) * worker_slots)

    lag = max(1, round(warmup_seconds / MINUTE))
    first = int((replay_start - BURN_IN_SECONDS - trace_start) // MINUTE)
    measured = int((replay_start - trace_start) // MINUTE)
    stabilise = max(1, round(stabilisation_seconds / MINUTE))
    util_raw, fore_raw = [0] * minutes, [0] * minutes
    seen_u, seen_f = [0.0] * minutes, [0.0] * minutes
    util_desired, fore_desired = [0] * minutes, [0] * minutes
    profiles: dict[str, list[float]] = {}
    profile_hour = None
    busy_u = busy_f = 0.0
    totals: defaultdict[str, float] = defaultdict(float)
    for m in range(first, minutes):
        ts = trace_start + m * MINUTE
        hour = hour_index(ts)
        if hour != profile_hour:  # production rebuilds the profile from the finished hours
            profiles = {
                cls: profile_build(h, now_hour=hour, history_start_hour=start_hour, weeks=weeks, decay=decay)
                for cls, h in hourly.items()
            }
            profile_hour = hour
        peak = forecast_peak(profiles, start=ts, horizon_seconds=warmup_seconds, spread_sigmas=spread_sigmas)
        util_raw[m] = workers(slots_for(busy_u, target_utilisation))
        fore_raw[m] = workers(max(slots_for(busy_f, target_utilisation), slots_for(peak, target_utilisation)))
        # The HPA's scale-down stabilisation: the highest recommendation of the window.
        window = slice(max(first, m - stabilise + 1), m + 1)
        util_desired[m], fore_desired[m] = max(util_raw[window]), max(fore_raw[window])
        ready_u = _ready(util_desired, m, lag, first)
        ready_f = _ready(fore_desired, m, lag, first)
        seen_u[m], seen_f[m] = min(demand[m], ready_u), min(demand[m], ready_f)
        # What the autoscaler reads next minute: busy slots averaged like the adapter rule does.
        busy_u = sum(seen_u[m - SIGNAL_MINUTES + 1 : m + 1]) / SIGNAL_MINUTES
        busy_f = sum(seen_f[m - SIGNAL_MINUTES + 1 : m + 1]) / SIGNAL_MINUTES
        if m < measured:
            continue
        need = slots_for(demand[m], target_utilisation)
        hours = MINUTE / SECONDS_PER_HOUR
        totals["demand"] += demand[m] * hours
        totals["over_f"] += max(0, ready_f - need) * hours
        totals["under_f"] += max(0, need - ready_f) * hours
        totals["over_u"] += max(0, ready_u - need) * hours
        totals["under_u"] += max(0, need - ready_u) * hours
        totals["unserved_f"] += max(0.0, demand[m] - ready_f) * hours
        totals["unserved_u"] += max(0.0, demand[m] - ready_u) * hours
        totals["slots_f"] += ready_f * hours
        totals["slots_u"] += ready_u * hours
    steps, never = _leads(util_desired, fore_desired, first=measured, last=minutes, worker_slots=worker_slots)
    leads = [lead for _, lead in steps]
    hourly_total = [sum(demand[h * 60 : (h + 1) * 60]) / 60 for h in range(minutes // 60)]

    def rising(m: int) -> bool:
        h = m // 60
        return h > 0 and hourly_total[h] >= RISING * hourly_total[h - 1]

    rising_leads = [lead for m, lead in steps if rising(m)]

    def iso(ts: float) -> str:
        return datetime.fromtimestamp(ts, UTC).isoformat()

    def r(x: float) -> float:
        return round(x, 2)

    return {
        "trace": {
            "jobs": len(jobs),
            "classes": sorted(by_class),
            "start": iso(first_ts),
            "replayed_from": iso(replay_start),
            "replayed_to": iso(replay_end),
        },
        "settings": {
            "warmup_minutes": lag,
            "target_utilisation": target_utilisation,
            "worker_slots": worker_slots,
            "min_slots": min_slots,
            "weeks": weeks,
            "decay": decay,
            "spread_sigmas": spread_sigmas,
            "stabilisation_minutes": stabilise,
        },
        "demand_slot_hours": r(totals["demand"]),
        "peak_demand_slots": r(max(demand[measured:])),
        "scale_up_steps": len(leads) + never,
        "scale_up_steps_forecast_never_reached": never,
        "scale_up_steps_forecast_later": sum(1 for x in leads if x < 0),
        "scale_up_steps_forecast_earlier": sum(1 for x in leads if x > 0),
        "minutes_earlier_median": r(statistics.median(leads)) if leads else None,
        "scale_up_steps_rising": len(rising_leads),
        "minutes_earlier_median_rising": r(statistics.median(rising_leads)) if rising_leads else None,
        "minutes_earlier_min": r(min(leads)) if leads else None,
        "minutes_earlier_max": r(max(leads)) if leads else None,
        "slot_hours": r(totals["slots_f"]),
        "overprovisioned_slot_hours": r(totals["over_f"]),
        "underprovisioned_slot_hours": r(totals["under_f"]),
        "unserved_slot_hours": r(totals["unserved_f"]),
        "utilisation_slot_hours": r(totals["slots_u"]),
        "utilisation_overprovisioned_slot_hours": r(totals["over_u"]),
        "utilisation_underprovisioned_slot_hours": r(totals["under_u"]),
        "utilisation_unserved_slot_hours": r(totals["unserved_u"]),
    }
