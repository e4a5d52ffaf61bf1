"""One page's frames: the first picture whole, then only what changed since the last frame.

Each open page has a PageView in its consumer: the tenants it watches of its own (pinned,
searched for, opened) and what it was last sent. From each tick's picture
(dashboard.picture) it makes that page's frame:

- the first frame (`"t": "picture"`): the picture, its rows cut to the top N and the
  page's own tenants;
- every later one (`"t": "delta"`): for the pool, the quarantine lane, the totals,
  capacity, the dependencies and the engine's memory, the keys whose value changed; the
  top's order, the red cells, the workers, the resources, the policy changes and the
  documents in flight whole when they changed; per tenant row the fields
  that changed (a row new to the page: whole) and the rows the page should drop (`gone`);
  the grid's shards, classes and counts when they changed, per cell the fields that
  changed (a cell new to the page: whole, with its history) and the cells to drop. A tick
  that changed nothing the page shows sends its time alone: an idle tenant costs nothing.

A cell's history is sent once (`history_runs`, dashboard.picture). On every later frame
the page appends each cell's oldest age (0 when nothing waits) to the history it keeps, as
the tick's build appends it in Redis: each frame after the first comes from one tick's
build.

Delta shape::

    {"t": "delta", "ts",
     "pool"?: {key: value}, "quarantine"?: {...}, "totals"?: {...}, "capacity"?: {...}, "dependencies"?: {...},
     "engine_memory"?: {...},
     "top"?: [slug, ...], "top_n"?: n, "red"?: {...}, "workers"?: [...], "resources"?: [...],
     "policy_changes"?: [...], "documents"?: {...},
     "rows"?: {slug: {field: value}}, "gone"?: [slug, ...],
     "grid"?: {"classes"?, "shards"?, "shards_total"?, "counts"?,
               "cells"?: {key: {field: value}}, "gone"?: [key, ...]}}
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable
from typing import Any

# Sent as the keys that changed.
DICT_SECTIONS = ("pool", "quarantine", "totals", "capacity", "dependencies", "engine_memory")
# Sent whole when changed.
WHOLE_SECTIONS = ("top", "top_n", "red", "workers", "resources", "policy_changes", "documents")
GRID_WHOLE = ("classes", "shards", "shards_total", "counts")


def frame_encode(frame: dict[str, Any]) -> str:
    """A frame as the websocket sends it: compact JSON."""
    return json.dumps(frame, separators=(",", ":"))


def _changed(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """The keys of `new` whose value differs from `old`'s (a key `new` dropped: None)."""
    out = {k: v for k, v in new.items() if k not in old or old[k] != v}
    out.update((k, None) for k in old.keys() - new.keys())
    return out


def _without_history(cell: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cell.items() if k != "history_runs"}


def _entries_diff(
    new: dict[str, dict[str, Any]],
    kept: dict[str, dict[str, Any]],
    *,
    keep: Collection[str],
    kept_as: Callable[[dict[str, Any]], dict[str, Any]] = lambda entry: entry,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Per entry of `new`: the whole entry if the page lacks it, else the fields that
    changed; then the keys the page has that are not in `keep`, dropped. `kept` (what the
    page has, each entry as `kept_as` makes it) is brought up to date."""
    out: dict[str, dict[str, Any]] = {}
    for key, entry in new.items():
        had = kept.get(key)
        plain = kept_as(entry)
        changed = entry if had is None else _changed(plain, had)
        if changed:
            out[key] = changed
        kept[key] = plain
    gone = [key for key in kept if key not in keep]
    for key in gone:
        del kept[key]
    return out, gone


class PageView:
    """What one open page watches and has been sent."""

    def __init__(self) -> None:
        self.pinned: tuple[str, ...] = ()
        self.searched: tuple[str, ...] = ()
        self.opened: str | None = None
        self.rows: dict[str, dict[str, Any]] = {}  # tenant rows the page has, as sent
        self.cells: dict[str, dict[str, Any]] = {}  # grid cells the page has, history aside
        self.sections: dict[str, Any] = {}  # the other sections, as last sent
        self.grid: dict[str, Any] = {}  # the grid's own sections, as last sent
        self.ts = 0.0  # the time of the last picture sent from

    @property
    def own(self) -> set[str]:
        """The tenants this page watches beyond the top N."""
        own = set(self.pinned) | set(self.searched)
        if self.opened is not None:
            own.add(self.opened)
        return own

    def _wanted(self, picture: dict[str, Any]) -> dict[str, dict[str, Any]]:
        rows = picture["rows"]
        wanted = {slug: rows[slug] for slug in picture["top"]}
        for slug in self.own:
            if slug in rows:
                wanted[slug] = rows[slug]
        return wanted

    def first(self, picture: dict[str, Any]) -> dict[str, Any]:
        """The page's first frame: the picture, cut to what this page shows."""
        rows = self._wanted(picture)
        grid = picture["grid"]
        self.ts = picture["ts"]
        self.rows = dict(rows)
        self.cells = {key: _without_history(c) for key, c in grid["cells"].items()}
        self.sections = {k: picture[k] for k in (*DICT_SECTIONS, *WHOLE_SECTIONS)}
        self.grid = {k: grid[k] for k in GRID_WHOLE}
        return {"t": "picture", **{k: v for k, v in picture.items() if k != "rows"}, "rows": rows}

    def rows_sent(self, rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Rows sent to the page apart from a frame (a reply): later frames send their changes."""
        sent = {row["slug"]: row for row in rows}
        self.rows.update(sent)
        return sent

    def next(self, picture: dict[str, Any]) -> dict[str, Any] | None:
        """The page's frame for the next tick: what changed since the last one (None for a
        picture no newer than the page's: its first may have been this tick's already)."""
        if picture["ts"] <= self.ts:
            return None
        self.ts = picture["ts"]
        frame: dict[str, Any] = {"t": "delta", "ts": picture["ts"]}
        sections = self.sections
        for key in DICT_SECTIONS:
            changed = _changed(picture[key] or {}, sections[key] or {})
            if changed:
                frame[key] = changed
        for key in WHOLE_SECTIONS:
            if picture[key] != sections[key]:
                frame[key] = picture[key]
        self.sections = {k: picture[k] for k in (*DICT_SECTIONS, *WHOLE_SECTIONS)}

        rows_out, gone = _entries_diff(self._wanted(picture), self.rows, keep=set(picture["top"]) | self.own)
        if rows_out:
            frame["rows"] = rows_out
        if gone:
            frame["gone"] = gone

        grid = picture["grid"]
        grid_out: dict[str, Any] = {k: grid[k] for k in GRID_WHOLE if grid[k] != self.grid[k]}
        self.grid = {k: grid[k] for k in GRID_WHOLE}
        cells_out, cells_gone = _entries_diff(grid["cells"], self.cells, keep=grid["cells"], kept_as=_without_history)
        if cells_out:
            grid_out["cells"] = cells_out
        if cells_gone:
            grid_out["gone"] = cells_gone
        if grid_out:
            frame["grid"] = grid_out
        return frame
