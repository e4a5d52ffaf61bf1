"""The picture every dashboard page is drawn from (dashboard.picture, dashboard.attention):
the top N tenants by what needs attention, the tenants pages watch, totals exact over the
whole fleet, the grid's worst shards first; bounded whatever the number of tenants."""

from __future__ import annotations

import json
import time
from datetime import timedelta

from django.conf import settings
from django.test import SimpleTestCase, override_settings
from django.utils import timezone

from dashboard.frames import PageView, frame_encode
from dashboard.picture import GRID_SHARDS, LATEST_KEY, history_runs, picture_build, picture_latest, picture_make
from dashboard.snapshot import snapshot_build
from dashboard.tenant_history import tenant_history_key, tenant_history_read
from dashboard.watched import WATCH_SECONDS, watched_add, watched_read
from fairqueue.jobs import cells
from fairqueue.jobs.models import Job
from fairqueue.jobs.submission import JobRequest, job_submit
from tenants.models import Shard, Tenant
from tenants.policy import policy_invalidate
from tenants.sync import policy_sync_all
from tests.base import RedisTestCase
from tests.factories import make_tenant


def waiting_job(tenant: Tenant, latency_class: str, age_s: float) -> None:
    """A job that has waited `age_s` (its row written straight; `cells.cells_rebuild` reads it)."""
    job = Job.objects.create(tenant=tenant, task="demo.sleep", latency_class=latency_class)
    Job.objects.filter(id=job.id).update(submitted_at=timezone.now() - timedelta(seconds=age_s))


def runs_decode(runs: list[int]) -> list[float]:
    """A history sent as runs (dashboard.picture.history_runs), as dashboard.js's cellDecode reads it."""
    if not runs:
        return []
    values = [float(runs[0])]
    for step, count in zip(runs[1::2], runs[2::2], strict=True):
        for _ in range(count):
            values.append(values[-1] + step)
    return values


def idle_tenants_bulk(count: int, *, prefix: str, shard: str = "default") -> None:
    """Many idle tenants at once (no API keys: they never submit), synced to Redis."""
    shard_row, _ = Shard.objects.get_or_create(name=shard, defaults={"capacity": 100})
    Tenant.objects.bulk_create(
        [Tenant(slug=f"{prefix}{i:04d}", name=f"Idle {i}", shard=shard_row, floor=1) for i in range(count)]
    )
    policy_sync_all()
    policy_invalidate()


@override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "DASHBOARD_TOP_TENANTS": 6})
class PictureTests(RedisTestCase):
    def setUp(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            for i in range(12):
                make_tenant(f"idle{i:02d}")
            self.late, _ = make_tenant("late")  # waits past twice its objective: red
            self.over, _ = make_tenant("over")  # past its objective: orange
            self.deep, _ = make_tenant("deep")  # the most jobs waiting, none late
            self.full, _ = make_tenant("full", max_concurrency=1)  # at its limit, jobs parked
        with self.captureOnCommitCallbacks(execute=True):
            for _ in range(3):  # one admitted (in flight), two parked
                job_submit(tenant=self.full, req=JobRequest(task="demo.sleep", args={"seconds": 5}))
        waiting_job(self.late, "critical", 130)  # objective 60 s
        waiting_job(self.over, "high", 400)  # objective 300 s
        for _ in range(5):
            waiting_job(self.deep, "default", 10)
        cells.cells_rebuild()

    def test_the_top_tenants_by_attention_then_the_idle_by_slug(self) -> None:
        snap = snapshot_build(with_history=False)
        picture = picture_make(snap, top_n=6, watched=set())
        self.assertEqual(picture["top"], ["late", "over", "deep", "full", "idle00", "idle01"])
        self.assertEqual(picture_build()["top"], picture["top"])  # the setting's N
        self.assertEqual(set(picture["rows"]), set(picture["top"]))
        late = picture["rows"]["late"]
        self.assertGreaterEqual(late["oldest_wait_ratio"], 2.0)
        self.assertAlmostEqual(late["oldest_wait_s"], 130, delta=3)
        self.assertEqual(picture_make(snap, top_n=2, watched=set())["top"], ["late", "over"])

    def test_totals_are_exact_over_every_tenant(self) -> None:
        snap = snapshot_build(with_history=False)
        picture = picture_make(snap, top_n=2, watched=set())
        rows = snap["tenants"]
        self.assertEqual(
            picture["totals"],
            {
                "tenants": 16,
                "active": 16,
                "busy": 4,
                "in_flight": sum(r["in_flight"] for r in rows),
                "waiting": sum(r["waiting"] for r in rows),
                "parked": sum(r["parked"] for r in rows),
                "throttled": 1,
                "red": 1,
                "orange": 1,
            },
        )
        self.assertEqual((picture["totals"]["in_flight"], picture["totals"]["waiting"]), (1, 10))

    def test_watched_tenants_ride_along_and_their_watch_ends(self) -> None:
        watched_add(["idle07"])
        picture = picture_build()
        self.assertIn("idle07", picture["rows"])
        self.assertNotIn("idle07", picture["top"])
        self.assertEqual(watched_read(now=time.time() + WATCH_SECONDS + 1), set())  # nobody renewed it
        self.assertNotIn("idle07", picture_build()["rows"])

    def test_a_recorded_build_keeps_each_shown_tenants_history_and_the_picture(self) -> None:
        first = picture_build(record=True)
        picture_build(record=True)
        points = tenant_history_read("deep")
        self.assertEqual(len(points), 2)
        self.assertEqual(points[0][0], first["ts"])
        self.assertEqual(points[-1][1:3], [0, 5])  # in flight, waiting
        self.assertAlmostEqual(points[-1][3], 10, delta=3)  # oldest wait
        self.assertFalse(self.redis.exists(tenant_history_key("idle11")), "an unseen tenant has no history")
        # A page that opens now starts from the tick's picture, not a build of its own.
        stored = json.loads(self.redis.get(LATEST_KEY))
        self.assertEqual(picture_latest(), stored)
        self.redis.delete(LATEST_KEY)
        self.assertGreater(picture_latest()["ts"], stored["ts"])

    def test_idle_tenants_cost_nothing(self) -> None:
        before = frame_encode(PageView().first(picture_make(snapshot_build(), top_n=6, watched=set())))
        idle_tenants_bulk(500, prefix="zz")
        after_picture = picture_make(snapshot_build(), top_n=6, watched=set())
        after = frame_encode(PageView().first(after_picture))
        self.assertEqual(after_picture["totals"]["tenants"], 516)
        self.assertEqual(len(after_picture["rows"]), 6)
        # The same rows; only the totals' and the times' digits differ.
        self.assertLess(abs(len(after) - len(before)), 40, (len(before), len(after)))


class GridTests(RedisTestCase):
    SHARDS = 25

    def setUp(self) -> None:
        self.tenants: dict[str, Tenant] = {}
        with self.captureOnCommitCallbacks(execute=True):
            for i in range(self.SHARDS):
                shard = f"s{i:02d}"
                self.tenants[shard], _ = make_tenant(f"t{i:02d}", shard_name=shard)
        waiting_job(self.tenants["s17"], "critical", 130)  # red
        waiting_job(self.tenants["s23"], "high", 400)  # orange
        waiting_job(self.tenants["s05"], "default", 10)  # green, waiting
        cells.cells_rebuild()

    def test_the_worst_shards_first_and_every_cell_counted(self) -> None:
        snap = snapshot_build()
        picture = picture_make(snap, top_n=5, watched=set())
        grid = picture["grid"]
        self.assertEqual(grid["shards"][:2], ["s17", "s23"])
        self.assertEqual(len(grid["shards"]), GRID_SHARDS)
        self.assertEqual(grid["shards_total"], len(snap["shards"]))
        self.assertGreater(grid["shards_total"], GRID_SHARDS)
        cells_all = len(snap["cells"])
        self.assertEqual(grid["counts"], {"red": 1, "orange": 1, "green": cells_all - 2})
        shown = {key.split("/")[0] for key in grid["cells"]}
        self.assertEqual(shown, set(grid["shards"]))
        self.assertEqual(len(grid["cells"]), GRID_SHARDS * len(grid["classes"]))
        red = grid["cells"]["s17/critical"]
        self.assertEqual((red["state"], red["waiting"]), ("red", 1))
        self.assertIsInstance(red["history_runs"], list)
        self.assertEqual(
            [(c["shard"], c["class"]) for c in picture["red"]["cells"]], [("s17", "critical")], picture["red"]
        )
        self.assertEqual(picture["red"]["total"], 1)
        self.assertNotIn("history", picture["red"]["cells"][0])


class HistoryRunsTests(SimpleTestCase):
    def test_a_history_as_runs_of_equal_steps(self) -> None:
        self.assertEqual(history_runs([]), [])
        self.assertEqual(history_runs([0.0] * 120), [0, 0, 119])  # an empty cell: three numbers
        growing = [286.3 + i for i in range(120)]  # an oldest wait, a second older every tick
        self.assertEqual(history_runs(growing), [286, 1, 119])
        jumpy = [10.2, 11.4, 0.0, 0.0, 1.1, 2.0, 3.0]  # the oldest job started, a new one waits
        self.assertEqual(history_runs(jumpy), [10, 1, 1, -11, 1, 0, 1, 1, 3])
        self.assertEqual(runs_decode(history_runs(jumpy)), [10, 11, 0, 0, 1, 2, 3])
