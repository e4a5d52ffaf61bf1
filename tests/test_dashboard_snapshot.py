"""The snapshot builder: its documented shape and the cell colours from jobs of known age."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from dashboard.snapshot import BATCH_CLASS, cell_state, history_key, snapshot_build
from fairqueue.jobs import cells
from fairqueue.jobs.models import Job, JobStatus
from tests.base import RedisTestCase
from tests.factories import make_tenant

POOL_KEYS = {"slots", "busy", "busy_batch", "workers", "in_flight", "batch_in_flight", "utilisation", "batch_share"}
TENANT_KEYS = {
    "slug",
    "shard",
    "floor",
    "limit",
    "in_flight",
    "parked_by_class",
    "parked",
    "oldest_wait_s",
    "rate_per_min",
    "mean_job_s",
}
CELL_KEYS = {"shard", "class", "objective_s", "oldest_age_s", "state", "waiting", "history"}


def assert_snapshot_shape(test, snap: dict) -> None:  # type: ignore[no-untyped-def]
    """Shared with the consumer tests: every documented key is present."""
    test.assertTrue({"generated_at", "pool", "tenants", "cells", "red", "shards", "classes"} <= set(snap))
    test.assertTrue(POOL_KEYS | {"target"} <= set(snap["pool"]))
    for tenant in snap["tenants"]:
        test.assertTrue(set(tenant) >= TENANT_KEYS, tenant)
    for cell in snap["cells"]:
        test.assertTrue(set(cell) >= CELL_KEYS, cell)
        test.assertIn(cell["state"], ("green", "orange", "red"))
    test.assertEqual(snap["red"], [c for c in snap["cells"] if c["state"] == "red"])


class CellStateTests(RedisTestCase):
    def test_thresholds(self) -> None:
        self.assertEqual(cell_state(oldest_age_s=None, objective_s=60), "green")
        self.assertEqual(cell_state(oldest_age_s=59.9, objective_s=60), "green")
        self.assertEqual(cell_state(oldest_age_s=60, objective_s=60), "orange")
        self.assertEqual(cell_state(oldest_age_s=119.9, objective_s=60), "orange")
        self.assertEqual(cell_state(oldest_age_s=120, objective_s=60), "red")


class SnapshotTests(RedisTestCase):
    def setUp(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, _ = make_tenant("acme")

    def waiting_job(self, latency_class: str, age_s: float, **fields: object) -> Job:
        job = Job.objects.create(tenant=self.tenant, task="demo.sleep", latency_class=latency_class, **fields)
        Job.objects.filter(id=job.id).update(submitted_at=timezone.now() - timedelta(seconds=age_s))
        # Rows written straight to the database reach the cells as a rebuild reads them.
        cells.cells_rebuild()
        return job

    def cell(self, snap: dict, latency_class: str) -> dict:
        return next(c for c in snap["cells"] if c["shard"] == "default" and c["class"] == latency_class)

    def test_shape_of_an_empty_system(self) -> None:
        snap = snapshot_build()
        assert_snapshot_shape(self, snap)
        self.assertEqual(snap["shards"], ["default"])
        self.assertEqual(snap["classes"], ["critical", "high", "default", "low", BATCH_CLASS])
        self.assertEqual([t["slug"] for t in snap["tenants"]], ["acme"])
        self.assertTrue(all(c["state"] == "green" and c["oldest_age_s"] is None for c in snap["cells"]))
        self.assertEqual(snap["red"], [])

    def test_colours_against_the_objective(self) -> None:
        # Objectives from the seeded classes: critical 60 s, high 300 s, default 3600 s, low 1 day.
        self.waiting_job("critical", 30)  # under -> green
        self.waiting_job("critical", 10)
        self.waiting_job("high", 400, status=JobStatus.PARKED)  # over -> orange
        self.waiting_job("default", 7300)  # twice over -> red
        self.waiting_job("default", 8000, batch=True)  # batch lane: measured against 12 h
        self.waiting_job("low", 200_000, status=JobStatus.RUNNING)  # started: not waiting
        snap = snapshot_build()

        critical = self.cell(snap, "critical")
        self.assertEqual((critical["state"], critical["waiting"]), ("green", 2))
        self.assertAlmostEqual(critical["oldest_age_s"], 30, delta=2)
        self.assertEqual(critical["objective_s"], 60)
        self.assertEqual(self.cell(snap, "high")["state"], "orange")
        default = self.cell(snap, "default")
        self.assertEqual((default["state"], default["waiting"]), ("red", 1))
        self.assertAlmostEqual(default["oldest_age_s"], 7300, delta=2)
        low = self.cell(snap, "low")
        self.assertEqual((low["state"], low["oldest_age_s"], low["waiting"]), ("green", None, 0))
        batch = self.cell(snap, BATCH_CLASS)
        self.assertEqual((batch["state"], batch["waiting"], batch["objective_s"]), ("green", 1, 12 * 3600))
        self.assertEqual([(c["shard"], c["class"]) for c in snap["red"]], [("default", "default")])

        acme = snap["tenants"][0]
        self.assertEqual(acme["parked_by_class"], {"high": 1})
        self.assertEqual(acme["parked"], 1)
        self.assertAlmostEqual(acme["oldest_wait_s"], 7300, delta=2)  # the batch lane is not counted

    def test_history_is_kept_in_redis_and_capped(self) -> None:
        self.waiting_job("critical", 5)
        for _ in range(3):
            snap = snapshot_build(record=True)
        history = self.cell(snap, "critical")["history"]
        self.assertEqual(len(history), 3)
        self.assertTrue(all(4 <= age <= 10 for age in history))
        self.assertEqual(self.cell(snap, "low")["history"], [0.0, 0.0, 0.0])
        # Another process (or a restarted server) reads the same history.
        self.assertEqual(self.redis.llen(history_key("default", "critical")), 3)
        self.assertEqual(self.cell(snapshot_build(), "critical")["history"], history)
        for _ in range(125):
            snapshot_build(record=True)
        self.assertEqual(len(self.cell(snapshot_build(), "critical")["history"]), 120)
