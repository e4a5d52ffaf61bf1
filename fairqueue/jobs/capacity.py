"""Slots desired: the autoscaling signal that anticipates the day.

`slots_desired = max(needed now, forecast)`, where *needed now* is the non-batch busy
slots at the pool's target utilisation and *forecast* the most busy slots the demand
profile (fairqueue.jobs.forecast) expects within the fleet's warm-up time, at the same
target. A worker asked for now is ready after the warm-up, so scaling on this number
brings capacity up before the daily rise instead of after it.

Where things live:
- the profiles, one per latency class, are rebuilt from the job history (one aggregate
  query over the last weeks) by the periodic duties every REFRESH_SECONDS and kept in
  Redis (`fq:forecast:profiles`), so every web process reads them in one round trip and a
  lost Redis loses nothing the database cannot rebuild;
- one point (slots live, busy, desired, forecast) is recorded every RECORD_SECONDS into a
  capped Redis list (`fq:capacity:history`) for the dashboard's chart;
- `capacity_read` gives the dashboard and `/metrics` the current figures.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import DurationField, ExpressionWrapper, F, Min, Q, Sum
from django.db.models.functions import TruncHour

from fairqueue.conf import ForecastSettings, fq_settings
from fairqueue.jobs.fleet import fleet_read
from fairqueue.jobs.forecast import (
    HOURS_PER_WEEK,
    SECONDS_PER_HOUR,
    forecast_peak,
    hour_index,
    profile_build,
    slots_desired,
    slots_for,
)
from fairqueue.jobs.models import TERMINAL_STATUSES, Job
from fairqueue.jobs.runtime import redis_client
from tenants.policy import policy_snapshot

log = logging.getLogger("fairqueue.jobs.capacity")

PROFILES_KEY = "fq:forecast:profiles"  # HASH latency class -> JSON list of 168 floats, META_FIELD -> JSON
META_FIELD = "_meta"
REFRESH_LOCK_KEY = "fq:forecast:refreshed"  # SET NX EX REFRESH_SECONDS: one rebuild per period, fleet-wide
HISTORY_KEY = "fq:capacity:history"  # LIST of JSON points, newest first
RECORD_LOCK_KEY = "fq:capacity:recorded"  # SET NX EX RECORD_SECONDS: one point per period, fleet-wide
AHEAD_STEP_SECONDS = 300  # the chart's forecast line ahead of now
AHEAD_SECONDS = 2 * SECONDS_PER_HOUR


def _conf() -> ForecastSettings:
    return fq_settings().FORECAST


def demand_history(*, now: float, weeks: int) -> tuple[dict[str, dict[int, float]], int | None]:
    """Mean busy slots per hour and latency class from finished jobs (the batch lane left
    out), and the hour the history starts (None when there is none).

    One aggregate query over the (status, finished_at) index. A job's running time counts
    in the hour it started: jobs are short next to an hour, and this keeps it one query.
    """
    since = datetime.fromtimestamp(now, UTC) - timedelta(hours=weeks * HOURS_PER_WEEK + 1)
    finished = Job.objects.filter(
        status__in=sorted(TERMINAL_STATUSES), finished_at__gte=since, started_at__isnull=False
    ).filter(Q(batch=False) | Q(promoted_at__isnull=False))
    rows = (
        finished.annotate(hour=TruncHour("started_at"))
        .values("hour", "latency_class")
        .annotate(busy=Sum(ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())))
        .order_by()
    )
    hourly: dict[str, dict[int, float]] = defaultdict(dict)
    for row in rows:
        busy = row["busy"]
        seconds = busy.total_seconds() if isinstance(busy, timedelta) else float(busy or 0) / 1e6
        hourly[row["latency_class"]][hour_index(row["hour"].timestamp())] = seconds / SECONDS_PER_HOUR
    start = finished.aggregate(first=Min("started_at"))["first"]
    return dict(hourly), hour_index(start.timestamp()) if start else None


def profiles_refresh(*, now: float | None = None) -> dict[str, list[float]]:
    """Rebuild every class's profile from the job history and store them in Redis."""
    now = time.time() if now is None else now
    conf = _conf()
    hourly, start = demand_history(now=now, weeks=int(conf.WEEKS))
    profiles = {}
    if start is not None:
        for latency_class, hours in hourly.items():
            profiles[latency_class] = profile_build(
                hours,
                now_hour=hour_index(now),
                history_start_hour=start,
                weeks=int(conf.WEEKS),
                decay=float(conf.DECAY),
            )
    meta = {"computed_at": now, "history_start": None if start is None else start * SECONDS_PER_HOUR}
    pipe = redis_client().pipeline(transaction=True)
    pipe.delete(PROFILES_KEY)
    pipe.hset(PROFILES_KEY, META_FIELD, json.dumps(meta))
    for latency_class, profile in profiles.items():
        pipe.hset(PROFILES_KEY, latency_class, json.dumps([round(v, 4) for v in profile]))
    pipe.execute()
    return profiles


def _profiles_decode(raw: dict[Any, Any]) -> tuple[dict[str, list[float]], dict[str, Any]]:
    meta = json.loads(raw.get(META_FIELD) or "{}")
    return {k: json.loads(v) for k, v in raw.items() if k != META_FIELD}, meta


def profiles_read() -> tuple[dict[str, list[float]], dict[str, Any]]:
    """(profiles by latency class, meta); empty until the first refresh."""
    return _profiles_decode(redis_client().hgetall(PROFILES_KEY))


def capacity_figures(
    *, busy_now: float, profiles: dict[str, list[float]], target_utilisation: float, now: float
) -> dict[str, Any]:
    """needed_now, forecast and desired slots, and the forecast's busy slots per class."""
    conf = _conf()
    warmup, spread = float(conf.WARMUP_SECONDS), float(conf.SPREAD_SIGMAS)
    by_class = {
        cls: round(forecast_peak({cls: p}, start=now, horizon_seconds=warmup, spread_sigmas=spread), 3)
        for cls, p in profiles.items()
    }
    peak = forecast_peak(profiles, start=now, horizon_seconds=warmup, spread_sigmas=spread) if profiles else 0.0
    figures: dict[str, Any] = slots_desired(
        busy_now=busy_now, forecast_busy=peak, target_utilisation=target_utilisation
    )
    figures.update(forecast_busy=round(peak, 3), forecast_busy_by_class=by_class, warmup_s=warmup)
    return figures


def capacity_read(*, fleet: dict[str, int], target_utilisation: float, with_history: bool = True) -> dict[str, Any]:
    """The dashboard's and `/metrics`' capacity section: one Redis round trip.

    Shape: {"slots", "busy", "needed_now", "forecast", "desired", "forecast_busy",
    "forecast_busy_by_class", "warmup_s", "target", "profile_computed_at",
    "history": [[ts, slots, busy, desired, forecast], ...] oldest first,
    "ahead": [[ts, forecast slots], ...] from now on: the forecast term as it will read then}
    """
    now = time.time()
    pipe = redis_client().pipeline(transaction=False)
    pipe.hgetall(PROFILES_KEY)
    if with_history:
        pipe.lrange(HISTORY_KEY, 0, int(_conf().HISTORY_POINTS) - 1)
    results = pipe.execute()
    profiles, meta = _profiles_decode(results[0])
    busy = max(0, fleet["busy"] - fleet["busy_batch"])
    figures = capacity_figures(busy_now=busy, profiles=profiles, target_utilisation=target_utilisation, now=now)
    figures.update(
        slots=fleet["slots"],
        busy=busy,
        target=target_utilisation,
        profile_computed_at=meta.get("computed_at"),
    )
    if with_history:
        figures["history"] = [json.loads(p) for p in reversed(results[1])]
        conf = _conf()
        figures["ahead"] = [
            [
                round(now + s),
                slots_for(
                    forecast_peak(
                        profiles,
                        start=now + s,
                        horizon_seconds=float(conf.WARMUP_SECONDS),
                        spread_sigmas=float(conf.SPREAD_SIGMAS),
                    ),
                    target_utilisation,
                ),
            ]
            for s in range(0, AHEAD_SECONDS + 1, AHEAD_STEP_SECONDS)
        ]
    return figures


def capacity_record(*, now: float | None = None) -> list[float]:
    """Append one point to the chart's history (whoever calls it; see capacity_step)."""
    now = time.time() if now is None else now
    fleet = fleet_read()
    target = policy_snapshot().pool.target_utilisation
    profiles, _ = profiles_read()
    busy = max(0, fleet["busy"] - fleet["busy_batch"])
    figures = capacity_figures(busy_now=busy, profiles=profiles, target_utilisation=target, now=now)
    point = [round(now), fleet["slots"], busy, figures["desired"], figures["forecast"]]
    pipe = redis_client().pipeline(transaction=False)
    pipe.lpush(HISTORY_KEY, json.dumps(point))
    pipe.ltrim(HISTORY_KEY, 0, int(_conf().HISTORY_POINTS) - 1)
    pipe.execute()
    return point


def capacity_step() -> None:
    """The periodic duty: rebuild the profiles when due, record a chart point when due.
    SET NX locks make each happen once per period fleet-wide, whoever runs the duties."""
    conf = _conf()
    client = redis_client()
    if not client.exists(PROFILES_KEY) or client.set(
        REFRESH_LOCK_KEY, "1", nx=True, ex=max(1, int(conf.REFRESH_SECONDS))
    ):
        client.set(REFRESH_LOCK_KEY, "1", ex=max(1, int(conf.REFRESH_SECONDS)))
        profiles_refresh()
    if client.set(RECORD_LOCK_KEY, "1", nx=True, ex=max(1, int(conf.RECORD_SECONDS))):
        capacity_record()
