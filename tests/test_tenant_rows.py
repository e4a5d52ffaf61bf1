"""What a process keeps from one snapshot (and /metrics scrape) to the next — the tenant
rows (dashboard.tenant_rows), the cells' summary and the tick's shares read at a version,
the per-tenant metric text — never hides a change: after each change, the next build
equals one made from nothing, and the scrape says what the snapshot says."""

from __future__ import annotations

import time
from typing import Any

import redis
from django.conf import settings
from prometheus_client import CollectorRegistry, generate_latest

from dashboard.metrics import FairQueueCollector, metrics_render
from dashboard.snapshot import snapshot_build, snapshot_forget
from fairqueue.jobs import cells, live
from fairqueue.jobs.fleet import worker_heartbeat
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.runtime import engine
from fairqueue.jobs.submission import JobRequest, job_submit
from tenants.models import Tenant
from tenants.policy import policy_invalidate
from tests.base import RedisTestCase
from tests.factories import make_tenant
from tests.test_metrics import samples

PER_BUILD = ("oldest_wait_s", "oldest_wait_ratio")  # ages as of each build's clock


def _comparable(snap: dict[str, Any]) -> dict[str, Any]:
    rows = [{k: v for k, v in row.items() if k not in PER_BUILD} for row in snap["tenants"]]
    grid = [{k: v for k, v in c.items() if k != "oldest_age_s"} for c in snap["cells"]]
    return {"tenants": rows, "cells": grid, "pool": snap["pool"]}


class KeptSnapshotTests(RedisTestCase):
    def setUp(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            self.acme, _ = make_tenant("acme", max_concurrency=1)
            make_tenant("other", floor=3)
        snapshot_build()  # what later builds keep from
        snapshot_build()

    def submit(self, n: int, tenant: Tenant | None = None, latency_class: str = "default") -> list[Job]:
        with self.captureOnCommitCallbacks(execute=True):
            return [
                job_submit(
                    tenant=tenant or self.acme,
                    req=JobRequest(task="demo.sleep", args={"seconds": 5}, priority=latency_class),
                ).job
                for _ in range(n)
            ]

    def row(self, snap: dict[str, Any], slug: str = "acme") -> dict[str, Any]:
        return next(r for r in snap["tenants"] if r["slug"] == slug)

    def build_checked(self) -> dict[str, Any]:
        """The next build (keeping what it can), checked against one made from nothing."""
        kept = snapshot_build(with_history=False)
        snapshot_forget()
        fresh = snapshot_build(with_history=False)
        self.assertEqual(_comparable(kept), _comparable(fresh))
        for a, b in zip(kept["tenants"], fresh["tenants"], strict=True):
            self.assertEqual(a["oldest_wait_s"] is None, b["oldest_wait_s"] is None, a["slug"])
        return kept

    def test_waiting_and_parked_counts_show_in_the_next_snapshot(self) -> None:
        self.submit(3)  # one admitted (max concurrency 1), two parked
        snap = self.build_checked()
        self.assertEqual((self.row(snap)["waiting"], self.row(snap)["parked"]), (3, 2))
        self.assertEqual(self.row(snap)["in_flight"], 1)
        self.assertIsNotNone(self.row(snap)["oldest_wait_s"])
        self.submit(1, latency_class="critical")
        snap = self.build_checked()
        self.assertEqual(self.row(snap)["parked_by_class"], {"default": 2, "critical": 1})
        # Jobs leave (started, cancelled): the counts go down, to nothing.
        waiting = list(Job.objects.filter(status__in=[JobStatus.QUEUED, JobStatus.PARKED]))
        cells.jobs_leave([str(waiting[0].id)])
        self.assertEqual(self.row(self.build_checked())["waiting"], 3)
        cells.jobs_leave([str(j.id) for j in waiting])
        snap = self.build_checked()
        self.assertEqual((self.row(snap)["waiting"], self.row(snap)["parked"]), (0, 0))
        self.assertIsNone(self.row(snap)["oldest_wait_s"])
        self.assertEqual(self.row(snap, "other")["waiting"], 0)

    def test_a_change_made_by_another_process_shows(self) -> None:
        self.submit(2)
        self.assertEqual(self.row(self.build_checked())["waiting"], 2)
        # Another process's own connection runs the cells' script: nothing this process
        # holds knew of it, only Redis's version of the summary moved.
        other = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
        job = Job.objects.filter(status=JobStatus.PARKED).first()
        assert job is not None
        other.eval(cells.SOURCE, 1, cells.PREFIX, "del", str(job.id))
        other.close()
        self.assertEqual(self.row(snapshot_build(with_history=False))["waiting"], 1)

    def test_the_policy_changes_the_limit_in_the_next_snapshot(self) -> None:
        self.assertEqual(self.row(self.build_checked())["limit"], 1)
        with self.captureOnCommitCallbacks(execute=True):
            self.acme.max_concurrency, self.acme.floor = None, 4
            self.acme.save()
        policy_invalidate()  # what every process does on its next policy check (a new snapshot)
        snap = self.build_checked()
        self.assertGreaterEqual(self.row(snap)["limit"], 4)
        self.assertEqual(self.row(snap)["floor"], 4)
        with self.captureOnCommitCallbacks(execute=True):
            self.acme.name = "Acme Corp"
            self.acme.save()
        policy_invalidate()
        self.assertEqual(self.row(self.build_checked())["name"], "Acme Corp")

    def test_the_ticks_published_limit_shows_in_the_next_snapshot(self) -> None:
        before = self.row(self.build_checked(), "other")["limit"]
        live.shares_publish({"other": 2}, limits={"other": (before + 2, 0)})
        self.assertEqual(self.row(self.build_checked(), "other")["limit"], before + 2)
        live.shares_publish({"other": 1}, limits={"other": (before + 1, 0)})
        self.assertEqual(self.row(self.build_checked(), "other")["limit"], before + 1)
        live.shares_publish({}, limits={})  # the tick no longer sets one
        self.assertEqual(self.row(self.build_checked(), "other")["limit"], before)

    def test_the_pool_changes_the_limits_in_the_next_snapshot(self) -> None:
        # No worker: the formula does not squeeze or stretch. Slots and nothing running: it
        # stretches (f_max), with no other input of the tenant's row changed.
        before = self.row(self.build_checked(), "other")["limit"]
        worker_heartbeat(hostname="w1", slots=10, running=0, running_batch=0)
        snap = self.build_checked()
        self.assertEqual(snap["pool"]["slots"], 10)
        self.assertGreater(self.row(snap, "other")["limit"], before)

    def test_a_tenants_submission_rate_shows_in_the_next_snapshot(self) -> None:
        self.assertEqual(self.row(self.build_checked(), "other")["rate_per_min"], 0)
        now, bucket = time.time(), live._bucket_seconds(live._window())
        for back in range(1, live.RING_BUCKETS + 1):  # completed buckets only
            live.record_submissions(tenant_slug="other", count=10, now=now - back * bucket)
        snap = self.build_checked()
        self.assertGreater(self.row(snap, "other")["rate_per_min"], 0)
        self.assertEqual(self.row(snap)["rate_per_min"], 0)

    def test_in_flight_shows_in_the_next_snapshot(self) -> None:
        [job] = self.submit(1)
        snap = self.build_checked()
        self.assertEqual((self.row(snap)["in_flight"], snap["pool"]["in_flight"]), (1, 1))
        job.refresh_from_db()
        engine().release(tag=job.engine_tag, job_id=job.engine_id)
        snap = self.build_checked()
        self.assertEqual((self.row(snap)["in_flight"], snap["pool"]["in_flight"]), (0, 0))

    def test_the_scrape_follows_the_snapshot(self) -> None:
        collector = FairQueueCollector(cache_seconds=3600)  # one set of families per state
        registry = CollectorRegistry()
        registry.register(collector)
        parked = (("tenant", "acme"),)

        def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            collector.invalidate()
            rendered = samples(metrics_render(registry).decode())
            # prometheus_client writes the same families from their samples, none of the text kept.
            self.assertEqual(rendered, samples(generate_latest(registry).decode()))
            return rendered

        self.assertEqual(scrape()[("fairqueue_tenant_parked", parked)], 0)
        self.submit(3)
        s = scrape()
        self.assertEqual(s[("fairqueue_tenant_parked", parked)], 2)
        self.assertEqual(s[("fairqueue_tenant_in_flight", parked)], 1)
        with self.captureOnCommitCallbacks(execute=True):
            self.acme.max_concurrency, self.acme.floor = None, 4
            self.acme.save()
        policy_invalidate()  # what every process does on its next policy check (a new snapshot)
        self.assertGreaterEqual(scrape()[("fairqueue_tenant_limit", parked)], 4)
        cells.jobs_leave([str(j.id) for j in Job.objects.filter(status=JobStatus.PARKED)])
        self.assertEqual(scrape()[("fairqueue_tenant_parked", parked)], 0)
