"""The picture every dashboard page is drawn from: bounded, whatever the fleet's size.

Made from one snapshot (dashboard.snapshot) by the tick's build and sent to every page
through the channel layer; each page's consumer turns it into that page's frame
(dashboard.frames). At ten thousand tenants the snapshot is megabytes; the picture holds:

- the top N tenants by attention (dashboard.attention; N is
  FAIRQUEUE["DASHBOARD_TOP_TENANTS"]) and the tenants some page watches
  (dashboard.watched), nothing of the others;
- the fleet's totals, exact: tenants, active ones, busy ones (anything waiting or in
  flight), jobs in flight, waiting and parked, tenants throttled (at their limit with jobs
  parked), tenants red and orange (their oldest waits against the objectives);
- the grid's GRID_SHARDS shards that need attention most (red and orange cells first),
  their cells with their history, and every cell counted by colour; the worst RED_SHOWN
  red cells and how many there are;
- the pool, the workers, capacity, the outside resources, which services answer and the
  latest policy changes, as the snapshot has them;
- the documents in flight (fan-out parents): how many, the busiest, and the figures of
  the tenants shown and of those the busiest belong to.

Shape::

    {"ts", "generated_at", "top_n",
     "pool": {...}, "quarantine": {...}, "totals": {"tenants", "active", "busy", "in_flight", "waiting", "parked",
                               "throttled", "red", "orange"},
     "top": [slug, ...],                       # most attention first
     "rows": {slug: row},                      # the snapshot's tenant row (ages to 0.1 s)
     "grid": {"classes": [...], "shards": [shard, ...] (shown, worst first), "shards_total",
              "counts": {"red", "orange", "green"},
              "cells": {"<shard>/<class>": cell}},   # the snapshot's cell, its history as runs
     "red": {"cells": [cell without history, ...], "total"},
     "workers": [...], "resources": [...], "dependencies": {name: answers now},
     "policy_changes": [...],                  # the latest, drawn as markers on the charts
     "documents": {"in_flight", "tenants": {slug: {...}} (those shown), "top": [...]},  # fan-out
     "engine_memory": {...},                   # the snapshot's: the memory guard's figures
     "capacity": {... as the snapshot's, but "ahead" as "ahead_values": [slots, ...] one every
                  "ahead_step_s" from "ts"}}

A cell's history travels as `history_runs`: whole seconds, the oldest
value then (step, count) pairs, each step repeated count times. An oldest wait grows by a
second a tick and an empty cell stays at 0, so two minutes of a cell are a few numbers,
not 120 (the page decodes them once, then appends each tick's age itself).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection, Sequence
from typing import Any

from dashboard.attention import cell_ratio, shards_ranked, tenant_state, tenants_top
from dashboard.snapshot import ORANGE, RED, snapshot_build
from dashboard.tenant_history import tenant_history_record
from dashboard.watched import watched_read
from fairqueue.conf import fq_settings
from fairqueue.jobs.capacity import AHEAD_STEP_SECONDS
from fairqueue.jobs.runtime import redis_client

GRID_SHARDS = 20  # shard rows the grid shows; the rest are counted
RED_SHOWN = 20  # red cells listed by name; the rest are counted
LATEST_KEY = "fq:dash:picture"  # the last tick's picture, for pages that open before the next
LATEST_SECONDS = 3  # kept while this fresh: a page opening later builds its own
ENGINE_MEMORY_STEP_BYTES = 1 << 20  # the engine memory a page is shown, in MiB steps
ENGINE_MEMORY_RATIO_DIGITS = 3  # and its used share, in 0.1 % steps


def top_tenants() -> int:
    """How many tenants the table shows by attention (the setting)."""
    return int(fq_settings().DASHBOARD_TOP_TENANTS)


def cell_key(shard: str, latency_class: str) -> str:
    return f"{shard}/{latency_class}"  # shard and class names are slugs: no "/" in either


def _tenth(value: float) -> float | int:
    rounded = round(value, 1)
    return int(rounded) if rounded.is_integer() else rounded


def picture_row(row: dict[str, Any]) -> dict[str, Any]:
    """A snapshot's tenant row as pages get it (a copy: ages to a tenth of a second)."""
    out = dict(row)
    if out["oldest_wait_s"] is not None:
        out["oldest_wait_s"] = _tenth(out["oldest_wait_s"])
    if out["oldest_wait_ratio"] is not None:
        out["oldest_wait_ratio"] = round(out["oldest_wait_ratio"], 3)
    return out


def history_runs(values: Sequence[float]) -> list[int]:
    """A history in whole seconds as [first, step, count, step, count, ...]: the values
    after the first are the steps from one to the next, equal steps in a row written once."""
    seconds = [round(v) for v in values]
    if not seconds:
        return []
    runs = [seconds[0]]
    for a, b in itertools.pairwise(seconds):
        step = b - a
        if len(runs) > 1 and runs[-2] == step:
            runs[-1] += 1
        else:
            runs += [step, 1]
    return runs


def _cell(cell: dict[str, Any], *, history: bool) -> dict[str, Any]:
    out = {k: v for k, v in cell.items() if k != "history"}
    if out["oldest_age_s"] is not None:
        out["oldest_age_s"] = _tenth(out["oldest_age_s"])
    if history:
        out["history_runs"] = history_runs(cell["history"])
    return out


def _capacity(capacity: dict[str, Any]) -> dict[str, Any]:
    """The capacity section with the forecast ahead as its values alone, one every
    AHEAD_STEP_SECONDS from the picture's time: its timestamps move every tick, its values
    seldom."""
    out = {k: v for k, v in capacity.items() if k != "ahead"}
    if "ahead" in capacity:
        out["ahead_values"] = [value for _, value in capacity["ahead"]]
        out["ahead_step_s"] = AHEAD_STEP_SECONDS
    return out


def tenant_totals(rows: Collection[dict[str, Any]]) -> dict[str, int]:
    """The fleet's figures over every tenant row."""
    active = busy = in_flight = waiting = parked = throttled = red = orange = 0
    for r in rows:
        active += r["active"]
        if not (r["waiting"] or r["in_flight"]):
            continue
        busy += 1
        in_flight += r["in_flight"]
        waiting += r["waiting"]
        parked += r["parked"]
        throttled += r["parked"] > 0 and r["in_flight"] >= r["limit"]
        if r["oldest_wait_ratio"] is not None:
            state = tenant_state(r)
            red += state == RED
            orange += state == ORANGE
    return {
        "tenants": len(rows),
        "active": active,
        "busy": busy,
        "in_flight": in_flight,
        "waiting": waiting,
        "parked": parked,
        "throttled": throttled,
        "red": red,
        "orange": orange,
    }


def picture_make(snapshot: dict[str, Any], *, top_n: int, watched: Collection[str]) -> dict[str, Any]:
    """The bounded picture of one snapshot: its top `top_n` tenants and the `watched` ones."""
    rows = snapshot["tenants"]
    top = tenants_top(rows, top_n)
    shown = {r["slug"]: picture_row(r) for r in top}
    if watched:
        for r in rows:
            slug = r["slug"]
            if slug in watched and slug not in shown:
                shown[slug] = picture_row(r)
    cells = snapshot["cells"]
    grid_shards = shards_ranked(cells, snapshot["shards"])[:GRID_SHARDS]
    on_grid = set(grid_shards)
    counts = {"red": 0, "orange": 0, "green": 0}
    for c in cells:
        counts[c["state"]] += 1
    red = sorted(snapshot["red"], key=cell_ratio, reverse=True)
    return {
        "ts": snapshot["generated_ts"],
        "generated_at": snapshot["generated_at"],
        "top_n": top_n,
        "pool": snapshot["pool"],
        "quarantine": snapshot["quarantine"],
        "totals": tenant_totals(rows),
        "top": [r["slug"] for r in top],
        "rows": shown,
        "grid": {
            "classes": snapshot["classes"],
            "shards": grid_shards,
            "shards_total": len(snapshot["shards"]),
            "counts": counts,
            "cells": {cell_key(c["shard"], c["class"]): _cell(c, history=True) for c in cells if c["shard"] in on_grid},
        },
        "red": {"cells": [_cell(c, history=False) for c in red[:RED_SHOWN]], "total": len(red)},
        "workers": snapshot["workers"],
        "capacity": _capacity(snapshot["capacity"]),
        "resources": snapshot["resources"],
        "dependencies": snapshot["dependencies"],
        "policy_changes": snapshot["policy_changes"],
        "documents": _documents(snapshot.get("documents"), shown),
        "engine_memory": _engine_memory(snapshot["engine_memory"]),
    }


def _engine_memory(memory: dict[str, Any]) -> dict[str, Any]:
    """The engine's memory in ENGINE_MEMORY_STEP_BYTES steps: every write moves the exact
    figure, and a page is sent what changed, so an idle tick would otherwise never be."""

    def step(n: int | None) -> int | None:
        return None if n is None else n - n % ENGINE_MEMORY_STEP_BYTES

    ratio = memory["used_ratio"]
    return {
        **memory,
        "used_bytes": step(memory["used_bytes"]),
        "headroom_bytes": step(memory["headroom_bytes"]),
        "used_ratio": None if ratio is None else round(ratio, ENGINE_MEMORY_RATIO_DIGITS),
    }


def _documents(documents: dict[str, Any] | None, shown: Collection[str]) -> dict[str, Any]:
    """The documents in flight: the busiest, and the per-tenant figures of the tenants shown
    plus of the tenants those busiest belong to (bounded like the rows)."""
    if not documents:
        return {"in_flight": 0, "tenants": {}, "top": []}
    keep = set(shown) | {d["tenant"] for d in documents["top"]}
    return {
        "in_flight": documents["in_flight"],
        "tenants": {slug: row for slug, row in documents["tenants"].items() if slug in keep},
        "top": documents["top"],
    }


def picture_build(*, record: bool = False) -> dict[str, Any]:
    """A fresh snapshot's picture, with every tenant some page watches. `record=True` (the
    tick's build, once per tick fleet-wide) also appends to the cells' history and to the
    history of each tenant in the picture, and keeps the picture for the pages that open
    before the next tick (`picture_latest`)."""
    snapshot = snapshot_build(record=record)
    picture = picture_make(snapshot, top_n=top_tenants(), watched=watched_read())
    if record:
        tenant_history_record(picture["rows"].values(), ts=picture["ts"])
        redis_client().set(LATEST_KEY, json.dumps(picture, separators=(",", ":")), ex=LATEST_SECONDS)
    return picture


def picture_latest() -> dict[str, Any]:
    """A page's first picture: the last tick's while it is fresh (a few kilobytes read, not
    a build), else one built now (no page was open, or the ticks stopped)."""
    raw = redis_client().get(LATEST_KEY)
    if raw:
        picture: dict[str, Any] = json.loads(raw)
        return picture
    return picture_build()
