"""One page's frames (dashboard.frames): the first picture, then what changed. A page that
applies every frame as dashboard.js does holds what a page opening now would be sent, cell
histories included; a tick that changed nothing sends its time alone."""

from __future__ import annotations

import copy
from typing import Any

from django.conf import settings
from django.test import TestCase, override_settings

from dashboard.frames import PageView
from dashboard.picture import GRID_SHARDS, picture_build
from dashboard.snapshot import HISTORY_LEN
from dashboard.watched import watched_add
from fairqueue.jobs import cells
from fairqueue.jobs.submission import JobRequest, job_submit
from tenants.models import Tenant
from tests.base import RedisTestCase
from tests.factories import make_tenant
from tests.test_dashboard_picture import runs_decode, waiting_job

TOP_N = 2


def _merge(into: dict[str, Any], changed: dict[str, Any]) -> None:
    for key, value in changed.items():
        if value is None:
            into.pop(key, None)
        else:
            into[key] = value


def cell_decoded(cell: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in cell.items() if k != "history_runs"}
    out["history"] = runs_decode(cell["history_runs"])
    return out


class PageState:
    """What dashboard.js holds: the first picture with every frame applied (its `picture`
    and `delta`, written again here to check the frames say everything)."""

    def __init__(self, first: dict[str, Any]) -> None:
        assert first["t"] == "picture"
        self.s = copy.deepcopy(first)
        cells = self.s["grid"]["cells"]
        for key, cell in cells.items():
            cells[key] = cell_decoded(cell)

    def apply(self, d: dict[str, Any]) -> None:
        assert d["t"] == "delta"
        s = self.s
        s["ts"] = d["ts"]
        for key in ("pool", "quarantine", "totals", "capacity", "dependencies", "engine_memory"):
            if key in d:
                _merge(s[key], d[key])
        for key in ("top", "top_n", "red", "workers", "resources", "policy_changes", "documents"):
            if key in d:
                s[key] = d[key]
        for slug, row in d.get("rows", {}).items():
            if slug in s["rows"]:
                _merge(s["rows"][slug], row)
            else:
                s["rows"][slug] = copy.deepcopy(row)
        for slug in d.get("gone", []):
            del s["rows"][slug]
        g, gd = s["grid"], d.get("grid", {})
        for key in ("classes", "shards", "shards_total", "counts"):
            if key in gd:
                g[key] = gd[key]
        for key in gd.get("gone", []):
            del g["cells"][key]
        changed = gd.get("cells", {})
        for key, cell in g["cells"].items():
            if key not in changed:
                cell["history"] = [*cell["history"], cell["oldest_age_s"] or 0][-HISTORY_LEN:]
        for key, cell in changed.items():
            if "history_runs" in cell:
                g["cells"][key] = cell_decoded(cell)
            else:
                _merge(g["cells"][key], cell)
                kept = g["cells"][key]
                kept["history"] = [*kept["history"], kept["oldest_age_s"] or 0][-HISTORY_LEN:]

    def comparable(self) -> dict[str, Any]:
        return {k: v for k, v in self.s.items() if k not in ("t", "generated_at")}


def fresh(page: PageView, picture: dict[str, Any]) -> dict[str, Any]:
    """What a page watching the same tenants would be sent if it opened at this picture."""
    other = PageView()
    other.pinned = page.pinned
    first = PageState(other.first(picture))
    return first.comparable()


def histories_apart(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Both sides' cell histories taken out (compared apart: the page appends each tick's
    age to a tenth of a second, a new page gets them in whole seconds)."""
    out = {}
    for side in (a, b):
        for key, cell in side["grid"]["cells"].items():
            out.setdefault(key, []).append(cell.pop("history"))
    return out


def assert_same(test: TestCase, state: PageState, fresh: dict[str, Any]) -> None:
    """The page holds what a new page would be sent, its cell histories to the second."""
    held = copy.deepcopy(state.comparable())
    for key, (mine, theirs) in histories_apart(held, fresh).items():
        test.assertEqual(len(mine), len(theirs), key)
        for a, b in zip(mine, theirs, strict=True):
            test.assertLessEqual(abs(a - b), 1.0, (key, mine, theirs))
    test.assertEqual(held, fresh)


@override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "DASHBOARD_TOP_TENANTS": TOP_N})
class FrameTests(RedisTestCase):
    def setUp(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            self.tenants = {slug: make_tenant(slug, max_concurrency=1)[0] for slug in ("a", "b", "c", "d", "e")}

    def submit(self, slug: str, n: int) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            for _ in range(n):
                job_submit(tenant=self.tenants[slug], req=JobRequest(task="demo.sleep", args={"seconds": 5}))

    def tick(self, page: PageView, state: PageState) -> dict[str, Any]:
        picture = picture_build(record=True)
        frame = page.next(picture)
        assert frame is not None
        state.apply(frame)
        assert_same(self, state, fresh(page, picture))
        return frame

    def test_deltas_rebuild_what_a_new_page_would_get(self) -> None:
        page = PageView()
        page.pinned = ("e",)
        watched_add(page.pinned)
        first = page.first(picture_build(record=True))
        self.assertEqual(set(first["rows"]), {"a", "b", "e"})  # the top two (idle, by slug) and the pin
        state = PageState(first)

        quiet = self.tick(page, state)
        # Nothing moved: the time alone (the engine's memory too, should it just have
        # crossed one of the steps the page is shown it in).
        self.assertEqual(set(quiet) - {"engine_memory"}, {"t", "ts"}, quiet)

        self.submit("c", 3)  # c: one in flight, two parked; it leads the top now
        frame = self.tick(page, state)
        self.assertEqual(frame["top"], ["c", "a"])
        self.assertEqual(frame["gone"], ["b"], "the pinned tenant out of the top stays")
        self.assertEqual(set(frame["rows"]), {"c"})  # a new row, whole
        self.assertEqual(frame["rows"]["c"]["in_flight"], 1)
        self.assertEqual(frame["totals"]["waiting"], 3)
        self.assertEqual(set(frame["grid"]["cells"]), {"default/default"})

        self.submit("e", 2)  # the pinned tenant moves: only the fields that changed
        frame = self.tick(page, state)
        self.assertEqual(frame["top"], ["c", "e"])
        self.assertEqual(frame["gone"], ["a"])
        changed = frame["rows"]["e"]
        self.assertEqual(changed["in_flight"], 1)
        self.assertNotIn("slug", changed)
        self.assertNotIn("limit", changed)

        for _ in range(3):  # ages move on: the cells' histories grow on both sides alike
            self.tick(page, state)
        self.assertEqual(len(state.s["grid"]["cells"]["default/default"]["history"]), 7)  # one per recorded build

        page.pinned = ("a",)  # pinned on the page: its row comes with the next tick
        watched_add(page.pinned)
        self.assertEqual(self.tick(page, state)["rows"]["a"]["slug"], "a")
        page.pinned = ()
        self.assertEqual(self.tick(page, state)["gone"], ["a"])

    def test_a_picture_no_newer_than_the_page_sends_nothing(self) -> None:
        page = PageView()
        picture = picture_build(record=True)
        page.first(picture)
        self.assertIsNone(page.next(picture))


class GridFrameTests(RedisTestCase):
    def setUp(self) -> None:
        self.tenants: dict[str, Tenant] = {}
        with self.captureOnCommitCallbacks(execute=True):
            for i in range(GRID_SHARDS + 2):
                shard = f"s{i:02d}"
                self.tenants[shard], _ = make_tenant(f"t{i:02d}", shard_name=shard)

    def test_a_shard_that_turns_red_comes_into_the_grid_with_its_history(self) -> None:
        page = PageView()
        first = page.first(picture_build(record=True))
        state = PageState(first)
        last = sorted(self.tenants)[-1]
        self.assertNotIn(last, first["grid"]["shards"])
        second = page.next(picture_build(record=True))  # a second point in every history
        assert second is not None
        state.apply(second)
        waiting_job(self.tenants[last], "critical", 130)
        cells.cells_rebuild()
        picture = picture_build(record=True)
        frame = page.next(picture)
        assert frame is not None
        state.apply(frame)
        grid = frame["grid"]
        self.assertEqual(grid["shards"][0], last)
        self.assertEqual(grid["counts"]["red"], 1)
        new = grid["cells"][f"{last}/critical"]
        self.assertEqual(new["state"], "red")
        self.assertEqual(
            len(runs_decode(new["history_runs"])), 3, "a cell new to the page comes whole, with its history"
        )
        dropped = sorted(first["grid"]["shards"])[-1]
        self.assertIn(f"{dropped}/critical", grid["gone"])
        assert_same(self, state, fresh(page, picture))
