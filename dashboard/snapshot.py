"""One picture of the live state: pool, tenants and the shard x latency-class grid.

`snapshot_build()` is what the dashboard shows and what `/metrics` exports. Per call it
costs one database query and two Redis round trips, whatever the number of tenants:

- the database (one aggregate query): jobs not yet started (`queued` or `parked`) per
  tenant, shard, class and status, with the oldest time each became due (`submitted_at`,
  or `due_at` for a delayed or retried job: its wait starts when it is due). The database is the
  truth about which jobs exist and when they were submitted; Redis only holds scheduling
  state, and a job parked behind its shard's key rather than its tenant's key is not
  visible per tenant in the engine at all. Jobs in the batch lane (batch, not promoted)
  are shown as their own class `batch`, measured against the pool's batch objective, so
  hours-long batch waits never colour an interactive cell;
- Redis, round trip 1: the worker registry (`fleet_read`);
- Redis, round trip 2 (one pipeline): every shard's engine holder counts (HMGET), every
  tenant's submission-rate ring and mean duration, and each cell's history list (pushed
  to when `record=True`, then read).

JSON shape (all numbers plain; ages and durations in seconds)::

    {
      "generated_at": "2025-01-01T12:00:00.000000+00:00", "generated_ts": 1735732800.0,
      "pool": {"slots", "busy", "busy_batch", "workers", "in_flight", "batch_in_flight",
               "utilisation",   # non-batch busy slots / slots (the autoscaling signal)
               "batch_share",   # batch busy slots / slots
               "target"},       # slots x target utilisation
      "shards": ["default", ...], "classes": ["critical", "high", "default", "low", "batch"],
      "tenants": [{"slug", "name", "active", "shard", "floor", "limit", "in_flight",
                   "parked_by_class": {class: n}, "parked", "waiting",
                   "oldest_wait_s" (null when nothing waits), "rate_per_min", "mean_job_s"}],
      "cells": [{"shard", "class", "objective_s", "oldest_age_s", "state", "waiting",
                 "history": [age, ...]}],   # history oldest first, at most HISTORY_LEN ticks
      "red": [cell, ...],                   # the cells whose state is "red"
      "workers": [{"hostname", "slots" (offered), "capacity" (configured), "busy", "busy_batch",
                   "signal" (e.g. "memory"; "" when all are offered), "reason" (a sentence)}],
      "capacity": {"slots", "busy", "needed_now", "forecast", "desired", ...}  # fairqueue.jobs.capacity
      "resources": [{"name", "limit" (configured), "effective" (now; 0 while paused), "effective_exact",
                     "paused_for_s" (null unless paused), "refusals"}]
    }

A cell is green while its oldest waiting job is younger than the class objective (or
nothing waits), orange from the objective on, red from twice the objective on.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from django.db.models import BooleanField, Case, Count, Min, Q, Value, When
from django.db.models.functions import Coalesce

from fairqueue.engine.keys import key_name
from fairqueue.jobs import live
from fairqueue.jobs.admission import BATCH_KEY, SHARD_KEY, LiveSignals, shard_tag, tenant_key, tenant_limit_for
from fairqueue.jobs.capacity import capacity_read
from fairqueue.jobs.fleet import fleet_read, fleet_workers
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.runtime import engine, redis_client
from fairqueue.jobs.selectors import resources_explain
from tenants.policy import PolicySnapshot, policy_snapshot

BATCH_CLASS = "batch"  # pseudo-class of the batch lane in the grid
HISTORY_LEN = 120  # ticks kept per cell (about two minutes at one tick per second)
HISTORY_TTL_SECONDS = 24 * 3600  # a cell that disappears from policy takes its history with it
GREEN, ORANGE, RED = "green", "orange", "red"


def history_key(shard: str, latency_class: str) -> str:
    return f"fq:dash:hist:{shard}:{latency_class}"


def cell_state(*, oldest_age_s: float | None, objective_s: float) -> str:
    """Green under the objective (or nothing waiting), orange from it, red from twice it."""
    if oldest_age_s is None or oldest_age_s < objective_s:
        return GREEN
    if oldest_age_s < 2 * objective_s:
        return ORANGE
    return RED


def _waiting_rows() -> list[dict[str, Any]]:
    """The one database query of a tick: not-yet-started jobs grouped, with their oldest."""
    in_batch_lane = Case(
        When(Q(batch=True, promoted_at__isnull=True), then=Value(True)),
        default=Value(False),
        output_field=BooleanField(),
    )
    return list(
        Job.objects.filter(status__in=[JobStatus.QUEUED, JobStatus.PARKED])
        .annotate(lane=in_batch_lane)
        .values("tenant__slug", "tenant__shard__name", "latency_class", "status", "lane")
        .annotate(n=Count("id"), oldest=Min(Coalesce("due_at", "submitted_at")))
        .order_by()
    )


def _class_objectives(policy: PolicySnapshot) -> dict[str, int]:
    """Grid columns, highest rank first, then the batch lane."""
    ordered = sorted(policy.classes.values(), key=lambda c: (-c.rank, c.name))
    columns = {c.name: c.objective_seconds for c in ordered}
    columns.setdefault(BATCH_CLASS, policy.pool.batch_objective_seconds)
    return columns


def _ring_fields(now: float, window: int) -> list[str]:
    # Same ring as fairqueue.jobs.live: complete intervals only.
    size = max(window / live.RING_BUCKETS, 1.0)
    current = int(now // size)
    return [str(current - i) for i in range(1, live.RING_BUCKETS + 1)]


def snapshot_build(*, record: bool = False, with_history: bool = True) -> dict[str, Any]:
    """Build the snapshot; `record=True` (the broadcaster, once per tick) appends to history."""
    policy = policy_snapshot()
    rows = _waiting_rows()
    now = time.time()
    objectives = _class_objectives(policy)
    shards = sorted(policy.shards)

    # --- Database rows -> per cell and per tenant -----------------------------------------
    cell_oldest: dict[tuple[str, str], datetime] = {}
    cell_waiting: dict[tuple[str, str], int] = {}
    tenant_parked: dict[str, dict[str, int]] = {}
    tenant_waiting: dict[str, int] = {}
    tenant_oldest: dict[str, datetime] = {}
    for row in rows:
        slug, shard = row["tenant__slug"], row["tenant__shard__name"]
        cls = BATCH_CLASS if row["lane"] else row["latency_class"]
        cell = (shard, cls)
        cell_waiting[cell] = cell_waiting.get(cell, 0) + row["n"]
        if cell not in cell_oldest or row["oldest"] < cell_oldest[cell]:
            cell_oldest[cell] = row["oldest"]
        tenant_waiting[slug] = tenant_waiting.get(slug, 0) + row["n"]
        if row["status"] == JobStatus.PARKED:
            by_class = tenant_parked.setdefault(slug, {})
            by_class[cls] = by_class.get(cls, 0) + row["n"]
        if not row["lane"] and (slug not in tenant_oldest or row["oldest"] < tenant_oldest[slug]):
            tenant_oldest[slug] = row["oldest"]

    def age(at: datetime | None) -> float | None:
        return None if at is None else round(max(0.0, now - at.timestamp()), 3)

    cell_ages = {(s, c): age(cell_oldest.get((s, c))) for s in shards for c in objectives}

    # --- Redis: fleet, then everything else in one pipeline --------------------------------
    fleet = fleet_read()
    client = redis_client()
    tenants = sorted(policy.tenants.values(), key=lambda t: t.slug)
    prefix = engine().prefix
    pipe = client.pipeline(transaction=False)
    count_names: dict[str, list[str]] = {}
    for shard in shards:
        names = [SHARD_KEY, BATCH_KEY] + [tenant_key(t.slug) for t in tenants if t.shard == shard]
        count_names[shard] = names
        pipe.hmget(key_name(prefix, shard_tag(shard), "state"), names)
    fields = _ring_fields(now, policy.pool.rate_window_seconds)
    for t in tenants:
        pipe.hmget(live.rate_key(t.slug), fields)
        pipe.get(live.mean_key(t.slug))
    pipe.hgetall(live.SHARES_KEY)  # each tenant's share of idle slots, from the worker tick
    pipe.hgetall(live.FAIR_SHARES_KEY)  # and its fair share of the pool
    if with_history:
        for (shard, cls), oldest in cell_ages.items():
            key = history_key(shard, cls)
            if record:
                pipe.lpush(key, f"{oldest or 0:.3f}")
                pipe.ltrim(key, 0, HISTORY_LEN - 1)
                pipe.expire(key, HISTORY_TTL_SECONDS)
            pipe.lrange(key, 0, HISTORY_LEN - 1)
    results = iter(pipe.execute())

    holders: dict[str, int] = {}
    in_flight = batch_in_flight = 0
    for shard in shards:
        counts = dict(zip(count_names[shard], (int(v or 0) for v in next(results)), strict=True))
        batch_in_flight += counts[BATCH_KEY]
        in_flight += max(0, counts[SHARD_KEY] - counts[BATCH_KEY])
        holders.update({k: v for k, v in counts.items() if k not in (SHARD_KEY, BATCH_KEY)})
    signals: dict[str, tuple[float, float | None]] = {}
    for t in tenants:
        ring, mean = next(results), next(results)
        rate = live.rate_from_ring([int(c or 0) for c in ring], window_seconds=policy.pool.rate_window_seconds)
        signals[t.slug] = (rate, float(mean) if mean else None)
    shares = {slug: int(v) for slug, v in (next(results) or {}).items()}
    fair = {slug: float(v) for slug, v in (next(results) or {}).items()}
    histories: dict[tuple[str, str], list[float]] = {}
    if with_history:
        for cell in cell_ages:
            if record:
                next(results), next(results), next(results)
            histories[cell] = [float(v) for v in reversed(next(results))]

    # --- Assemble ---------------------------------------------------------------------------
    slots, busy, busy_batch = fleet["slots"], fleet["busy"], fleet["busy_batch"]
    pool = {
        "slots": slots,
        "busy": busy,
        "busy_batch": busy_batch,
        "workers": fleet["workers"],
        "in_flight": in_flight,
        "batch_in_flight": batch_in_flight,
        "utilisation": round(max(0, busy - busy_batch) / slots, 4) if slots else 0.0,
        "batch_share": round(busy_batch / slots, 4) if slots else 0.0,
        "target": round(slots * policy.pool.target_utilisation, 3),
    }
    tenant_rows = []
    for t in tenants:
        rate, mean = signals[t.slug]
        breakdown = tenant_limit_for(
            policy,
            t,
            LiveSignals(
                rate_per_min=rate,
                mean_seconds=mean,
                pool_slots=slots,
                in_flight=in_flight,
                idle_share=shares.get(t.slug, 0),
                fair_share=fair.get(t.slug),
            ),
        )
        parked_by_class = tenant_parked.get(t.slug, {})
        tenant_rows.append(
            {
                "slug": t.slug,
                "name": t.name,
                "active": t.active,
                "shard": t.shard,
                "floor": breakdown.floor,
                "limit": breakdown.limit,
                "in_flight": holders.get(tenant_key(t.slug), 0),
                "parked_by_class": parked_by_class,
                "parked": sum(parked_by_class.values()),
                "waiting": tenant_waiting.get(t.slug, 0),
                "oldest_wait_s": age(tenant_oldest.get(t.slug)),
                "rate_per_min": round(breakdown.rate_per_min, 3),
                "mean_job_s": round(breakdown.mean_seconds, 4),
            }
        )
    cells = []
    for (shard, cls), oldest in cell_ages.items():
        objective = objectives[cls]
        cells.append(
            {
                "shard": shard,
                "class": cls,
                "objective_s": objective,
                "oldest_age_s": oldest,
                "state": cell_state(oldest_age_s=oldest, objective_s=objective),
                "waiting": cell_waiting.get((shard, cls), 0),
                "history": histories.get((shard, cls), []),
            }
        )
    return {
        "generated_at": datetime.fromtimestamp(now, UTC).isoformat(),
        "generated_ts": round(now, 3),
        "pool": pool,
        "shards": shards,
        "classes": list(objectives),
        "tenants": tenant_rows,
        "cells": cells,
        "red": [c for c in cells if c["state"] == RED],
        # Per worker: offered and configured slots and why fewer are offered (backpressure).
        "workers": fleet_workers(),
        # Slots live, needed now, forecast and desired (the autoscaling signal), with the chart's history.
        "capacity": capacity_read(
            fleet=fleet, target_utilisation=policy.pool.target_utilisation, with_history=with_history
        ),
        # Outside resources: configured limit, effective limit now (AIMD, 0 while paused).
        "resources": resources_explain(policy),
    }
