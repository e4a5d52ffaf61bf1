"""One picture of the live state: pool, tenants and the shard x latency-class grid.

`snapshot_build()` is what the dashboard shows and what `/metrics` exports. Per call it
costs no database query and a few Redis round trips, and reads nothing per waiting job:

- every tenant's submission rate and mean duration (`live.signals_read_many`: a ring is
  read again only once its bucket completes, a mean only for a tenant with a rate);
- the worker registry (`fleet_read`);
- one pipeline: every shard's engine holder counts (HMGET) and the version of the tick's
  shares and limits; those (three HGETALLs) only when their version moved;
- the cells (fairqueue.jobs.cells `cells_refresh`: every (shard, class) and (tenant,
  class) cell's waiting count and oldest job, kept as jobs move; only the cells changed
  since the last build are read, by the summary's version and changes log; a job waits
  from when it became due, `due_at` for a delayed or retried job, else `submitted_at`);
- each cell's history list (pushed to when `record=True`, then read). Jobs in the batch
  lane (batch, not promoted) are shown as their own class `batch`, measured against the
  pool's batch objective, so hours-long batch waits never colour an interactive cell.

What the last build read and made is kept in the process (dashboard.tenant_rows: a tenant's
row is made again only when one of its inputs changed); every build still reads every
version and every holder count, so a change made anywhere shows in the next build. The
answer shares objects with the builds before and after it: read it, do not change it.

JSON shape (all numbers plain; ages and durations in seconds)::

    {
      "generated_at": "2025-01-01T12:00:00.000000+00:00", "generated_ts": 1735732800.0,
      "pool": {"slots", "busy", "busy_batch", "workers", "in_flight", "batch_in_flight",
               "utilisation",   # non-batch busy slots / slots (the autoscaling signal)
               "batch_share",   # batch busy slots / slots
               "target",        # slots x target utilisation
               "floor_headroom", "flood_utilisation"},  # slots kept for floors, and their cost
      "quarantine": {"slots" (the lane's cap, across the shards), "running" (jobs holding a lane slot),
                     "waiting", "oldest_wait_s" (null when none waits),
                     "workers", "worker_slots"},  # its live workers (not the pool's); fairqueue.jobs.quarantine
      "shards": ["default", ...], "classes": ["critical", "high", "default", "low", "batch"],
      "tenants": [{"slug", "name", "active", "shard", "floor", "limit", "in_flight",
                   "parked_by_class": {class: n}, "parked", "waiting",
                   "oldest_wait_s" (null when nothing waits; the batch lane aside),
                   "oldest_wait_ratio" (the worst of the tenant's classes' oldest wait over
                                        the class objective, batch lane included; null when
                                        nothing waits),
                   "rate_per_min", "mean_job_s"}],
      "cells": [{"shard", "class", "objective_s", "oldest_age_s", "state", "waiting",
                 "history": [age, ...]}],   # history oldest first, at most HISTORY_LEN ticks
      "red": [cell, ...],                   # the cells whose state is "red"
      "workers": [{"hostname", "slots" (offered), "capacity" (configured), "busy", "busy_batch",
                   "signal" (e.g. "memory"; "" when all are offered), "reason" (a sentence)}],
      "capacity": {"slots", "busy", "needed_now", "forecast", "desired", ...}  # fairqueue.jobs.capacity
      "resources": [{"name", "limit" (configured), "effective" (now; 0 while paused), "effective_exact",
                     "paused_for_s" (null unless paused), "refusals"}],
      "engine_memory": {"used_bytes", "max_bytes", "used_ratio", "threshold_pct", "headroom_bytes",
                        "guard_active", "guard_cap"},  # fairqueue.jobs.memory_guard
      "policy_changes": [{"ts", "id", "text", "user", "source"}],  # the latest, oldest first
      "documents": {"in_flight",   # fan-out parents awaiting their children
                    "tenants": {slug: {"documents", "children", "running", "max_running"}},
                    "top": [{"id", "tenant", "children", "cap", "running"}]}  # the busiest
    }

The charts draw each policy change as a marker at its time (tenants.change_markers): a cell's
history has one point per tick (dashboard.ticker, one a second), the capacity chart its times.

A cell is green while its oldest waiting job is younger than the class objective (or
nothing waits), orange from the objective on, red from twice the objective on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from dashboard.gc_pause import gc_paused
from dashboard.tenant_rows import LimitsRaw, RowsInputs, TenantRows
from fairqueue.engine.keys import key_name
from fairqueue.jobs import cells, documents, live
from fairqueue.jobs.admission import (
    BATCH_KEY,
    QUARANTINE_KEY,
    SHARD_KEY,
    document_key,
    flood_utilisation,
    shard_tag,
    tenant_key,
)
from fairqueue.jobs.capacity import capacity_read
from fairqueue.jobs.dependencies import dependencies_up
from fairqueue.jobs.fleet import fleet_read, fleet_workers
from fairqueue.jobs.memory_guard import guard_state
from fairqueue.jobs.runtime import engine, redis_client
from fairqueue.jobs.selectors import resources_explain
from tenants.change_markers import markers_parse
from tenants.keys import CHANGE_MARKERS_KEY
from tenants.policy import PolicySnapshot, TenantPolicy, policy_snapshot

BATCH_CLASS = cells.BATCH_CLASS  # pseudo-class of the batch lane in the grid
HISTORY_LEN = 120  # ticks kept per cell (about two minutes at one tick per second)
HISTORY_TTL_SECONDS = 24 * 3600  # a cell that disappears from policy takes its history with it
GREEN, ORANGE, RED = "green", "orange", "red"
# Documents in flight (fan-out parents) listed one by one, most pages running first; the
# rest are counted per tenant.
DOCUMENTS_SHOWN = 20


def history_key(shard: str, latency_class: str) -> str:
    return f"fq:dash:hist:{shard}:{latency_class}"


def cell_state(*, oldest_age_s: float | None, objective_s: float) -> str:
    """Green under the objective (or nothing waiting), orange from it, red from twice it."""
    if oldest_age_s is None or oldest_age_s < objective_s:
        return GREEN
    if oldest_age_s < 2 * objective_s:
        return ORANGE
    return RED


def _class_objectives(policy: PolicySnapshot) -> dict[str, int]:
    """Grid columns, highest rank first, then the batch lane."""
    ordered = sorted(policy.classes.values(), key=lambda c: (-c.rank, c.name))
    columns = {c.name: c.objective_seconds for c in ordered}
    columns.setdefault(BATCH_CLASS, policy.pool.batch_objective_seconds)
    return columns


@dataclass(frozen=True)
class _Roster:
    """What the tenant rows need from one policy snapshot, built once per snapshot (a
    policy change makes a new one): ten thousand tenants sorted, their engine keys and the
    policy half of their limit's memo key."""

    policy: PolicySnapshot
    tenants: list[TenantPolicy]
    keys: list[str]  # tenant_key of each tenant, in the same order
    limit_keys: list[int]  # the tenant's policy numbers, as an id shared by tenants alike
    count_names: dict[str, list[str]]  # shard -> the fields of its engine state to read
    rows: TenantRows  # their rows, kept from build to build


_roster: _Roster | None = None


def _roster_for(policy: PolicySnapshot) -> _Roster:
    global _roster
    roster = _roster
    if roster is None or roster.policy is not policy:
        tenants = sorted(policy.tenants.values(), key=lambda t: t.slug)
        keys = [tenant_key(t.slug) for t in tenants]
        count_names: dict[str, list[str]] = {shard: [SHARD_KEY, BATCH_KEY, QUARANTINE_KEY] for shard in policy.shards}
        for t, key in zip(tenants, keys, strict=True):
            if t.shard in count_names:
                count_names[t.shard].append(key)
        # Tenants with equal policy numbers share one small int (hashed per tenant per call).
        numbers: dict[tuple[Any, ...], int] = {}
        limit_keys = [
            numbers.setdefault(
                (t.shard, t.floor, t.burst_floor, t.burst_pct, t.max_concurrency, t.dedicated), len(numbers)
            )
            for t in tenants
        ]
        rows = TenantRows(policy, tenants, keys, limit_keys, _class_objectives(policy))
        roster = _roster = _Roster(policy, tenants, keys, limit_keys, count_names, rows)
    return roster


@dataclass
class _Kept:
    """What the last build read, to read again only what changed since (one per process;
    every build still reads the state's versions and every engine holder count, so a
    change made by any process shows in the next build)."""

    view: cells.CellsView | None = None
    count_names: dict[str, list[str]] | None = None  # the roster's fields the holders were read for
    held_raw: dict[str, list[str | None]] = field(default_factory=dict)  # shard -> its reply, as read
    # shard -> (its key's, its batch key's, its quarantine lane key's)
    shard_held: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    holders: dict[str, int] = field(default_factory=dict)  # tenant engine key -> held
    limits_version: str | None = None  # the tick's publication the three hashes were read at
    limits_raw: LimitsRaw = ({}, {}, {})
    markers_raw: list[str] = field(default_factory=list)  # the policy change markers as read
    markers: list[dict[str, Any]] = field(default_factory=list)  # and parsed


_kept = _Kept()
_kept_lock = threading.Lock()  # builds from several threads (the collector, the websocket) take turns


def snapshot_forget() -> None:
    """Drop what this process kept from earlier builds: the next one reads and makes
    everything (tests compare it with a build that kept)."""
    global _kept, _roster
    with _kept_lock:
        _kept, _roster = _Kept(), None


def _documents_view(docs: list[documents.Document], *, prefix: str) -> dict[str, Any]:
    """The documents in flight: per tenant their count, children and children running (the
    holders of their document keys, one HMGET per shard), and the DOCUMENTS_SHOWN busiest."""
    running: dict[str, int] = {}
    if docs:
        by_shard: dict[str, list[documents.Document]] = {}
        for doc in docs:
            by_shard.setdefault(doc.shard, []).append(doc)
        pipe = redis_client().pipeline(transaction=False)
        for shard, group in by_shard.items():
            pipe.hmget(key_name(prefix, shard_tag(shard), "state"), [document_key(d.parent_id) for d in group])
        for group, raw in zip(by_shard.values(), pipe.execute(), strict=True):
            running.update({d.parent_id: int(v or 0) for d, v in zip(group, raw, strict=True)})
    tenants: dict[str, dict[str, int]] = {}
    for doc in docs:
        row = tenants.setdefault(doc.tenant, {"documents": 0, "children": 0, "running": 0, "max_running": 0})
        row["documents"] += 1
        row["children"] += doc.children
        row["running"] += running.get(doc.parent_id, 0)
        row["max_running"] = max(row["max_running"], running.get(doc.parent_id, 0))
    busiest = sorted(docs, key=lambda d: (-running.get(d.parent_id, 0), -d.children, d.parent_id))
    return {
        "in_flight": len(docs),
        "tenants": tenants,
        "top": [
            {
                "id": d.parent_id,
                "tenant": d.tenant,
                "children": d.children,
                "cap": d.cap,
                "running": running.get(d.parent_id, 0),
            }
            for d in busiest[:DOCUMENTS_SHOWN]
        ],
    }


def snapshot_build(*, record: bool = False, with_history: bool = True) -> dict[str, Any]:
    """Build the snapshot; `record=True` (the broadcaster, once per tick) appends to history.
    The answer shares objects with the builds before and after it: read it, do not change it."""
    with gc_paused(), _kept_lock:
        return _snapshot_build(record=record, with_history=with_history)


def _snapshot_build(*, record: bool, with_history: bool) -> dict[str, Any]:
    policy = policy_snapshot()
    now = time.time()
    objectives = _class_objectives(policy)
    shards = sorted(policy.shards)
    roster = _roster_for(policy)
    kept = _kept
    signals = live.signals_read_many([t.slug for t in roster.tenants], now=now)

    # --- Redis: fleet, then the versions and the holders in one pipeline, then what moved --
    fleet = fleet_read()
    client = redis_client()
    prefix = engine().prefix
    pipe = client.pipeline(transaction=False)
    count_names = roster.count_names
    for shard in shards:
        names = count_names[shard]
        pipe.hmget(key_name(prefix, shard_tag(shard), "state"), names)
    pipe.get(live.SHARES_VERSION_KEY)  # the tick's shares and limits as of when
    pipe.zrange(CHANGE_MARKERS_KEY, 0, -1)  # the latest policy changes, for the charts' markers
    pipe.hgetall(documents.DOCUMENTS_KEY)  # the documents in flight (fan-out parents)
    results = iter(pipe.execute())
    if kept.count_names is not count_names:
        kept.count_names, kept.held_raw, kept.shard_held, kept.holders = count_names, {}, {}, {}
    # A shard's counts are converted only when its reply differs from the last build's; the
    # holders' dict is the last build's own while none did (the rows compare it by identity).
    held_raw = kept.held_raw
    changed = [(shard, raw) for shard in shards if held_raw.get(shard) != (raw := next(results))]
    if changed:
        holders = dict(kept.holders)
        for shard, raw in changed:
            # The fields read: the shard's key, its batch and quarantine keys, then its tenants' keys.
            holders.update(zip(count_names[shard][3:], [int(v) if v else 0 for v in raw[3:]], strict=True))
            kept.shard_held[shard] = (int(raw[0] or 0), int(raw[1] or 0), int(raw[2] or 0))
            held_raw[shard] = raw
        kept.holders = holders
    holders = kept.holders
    in_flight = batch_in_flight = quarantine_held = 0
    for shard in shards:
        shard_held, batch_held, lane_held = kept.shard_held[shard]
        quarantine_held += lane_held
        batch_in_flight += batch_held
        in_flight += max(0, shard_held - batch_held - lane_held)  # the pool's: the lane's run elsewhere
    limits_version: str | None = next(results)
    markers_raw = next(results)
    in_flight_documents = documents.documents_parse(next(results) or {})
    if markers_raw != kept.markers_raw:
        kept.markers_raw, kept.markers = markers_raw, markers_parse(markers_raw)
    # A missing version (nothing published, or expired) is never taken as unchanged.
    if limits_version is None or limits_version != kept.limits_version:
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(live.SHARES_KEY)  # each tenant's share of idle slots, from the worker tick
        pipe.hgetall(live.FAIR_SHARES_KEY)  # and its fair share of the pool
        pipe.hgetall(live.TICK_LIMITS_KEY)  # and the limit the tick set
        # Read after their version: at least as new as the version they are kept under;
        # kept as read (the rows parse a figure only for a limit they compute).
        shares, fair, ticked = pipe.execute()
        kept.limits_raw, kept.limits_version = (shares or {}, fair or {}, ticked or {}), limits_version
    # Every cell's waiting count and oldest job, read as far as they changed since the last build.
    view = kept.view = cells.cells_refresh(kept.view)

    def age(ts: float | None) -> float | None:
        return None if ts is None else round(max(0.0, now - ts), 3)

    cell_ages = {(s, c): age(view.get(cells.shard_cell(s, c)).oldest_ts) for s in shards for c in objectives}
    histories: dict[tuple[str, str], list[float]] = {}
    if with_history:
        pipe = client.pipeline(transaction=False)
        for (shard, cls), oldest in cell_ages.items():
            key = history_key(shard, cls)
            if record:
                pipe.lpush(key, f"{oldest or 0:.3f}")
                pipe.ltrim(key, 0, HISTORY_LEN - 1)
                pipe.expire(key, HISTORY_TTL_SECONDS)
            pipe.lrange(key, 0, HISTORY_LEN - 1)
        results = iter(pipe.execute())
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
        "floor_headroom": policy.pool.floor_headroom,
        "flood_utilisation": round(flood_utilisation(slots=slots, headroom=policy.pool.floor_headroom), 4),
    }
    lane_cells = [view.get(cells.quarantine_cell(s)) for s in shards]
    lane_oldest = [c.oldest_ts for c in lane_cells if c.waiting and c.oldest_ts is not None]
    quarantine = {
        "slots": policy.pool.quarantine_slots,
        "running": quarantine_held,
        "waiting": sum(c.waiting for c in lane_cells),
        "oldest_wait_s": age(min(lane_oldest)) if lane_oldest else None,
        "workers": fleet["quarantine_workers"],
        "worker_slots": fleet["quarantine_slots"],
    }
    tenant_rows = roster.rows.build(
        RowsInputs(signals, kept.limits_raw, holders, view, (slots, in_flight)),
        now=now,
    )
    grid = []
    for (shard, cls), oldest in cell_ages.items():
        objective = objectives[cls]
        grid.append(
            {
                "shard": shard,
                "class": cls,
                "objective_s": objective,
                "oldest_age_s": oldest,
                "state": cell_state(oldest_age_s=oldest, objective_s=objective),
                "waiting": view.get(cells.shard_cell(shard, cls)).waiting,
                "history": histories.get((shard, cls), []),
            }
        )
    return {
        "generated_at": datetime.fromtimestamp(now, UTC).isoformat(),
        "generated_ts": round(now, 3),
        "pool": pool,
        "quarantine": quarantine,
        "shards": shards,
        "classes": list(objectives),
        "tenants": tenant_rows,
        "cells": grid,
        "red": [c for c in grid if c["state"] == RED],
        # Per worker: offered and configured slots and why fewer are offered (backpressure).
        "workers": fleet_workers(),
        # Slots live, needed now, forecast and desired (the autoscaling signal), with the chart's history.
        "capacity": capacity_read(
            fleet=fleet, target_utilisation=policy.pool.target_utilisation, with_history=with_history
        ),
        # Outside resources: configured limit, effective limit now (AIMD, 0 while paused).
        "resources": resources_explain(policy),
        # Which of the services FairQueue needs answer now (a restart or failover in progress).
        "dependencies": dependencies_up(),
        # The engine Redis's memory, the headroom before the memory guard refuses, its cap.
        "engine_memory": guard_state().as_dict(),
        # Fan-out parents awaiting their children, per tenant, and the busiest of them.
        "documents": _documents_view(in_flight_documents, prefix=prefix),
        "policy_changes": kept.markers,
    }
