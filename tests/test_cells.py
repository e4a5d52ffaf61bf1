"""Cells: the waiting jobs per (shard, class) and (tenant, class), kept in Redis as jobs
move (fairqueue.jobs.cells), against the database's truth."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from fairqueue.jobs import cells
from fairqueue.jobs.cancellation import job_cancel
from fairqueue.jobs.execution import job_execute
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.submission import JobRequest, job_submit
from tests.base import RedisTestCase
from tests.factories import make_tenant


def _from_database() -> dict[str, tuple[int, float]]:
    """Every cell as the database says: (waiting, oldest time a job became due)."""
    found: dict[str, list[float]] = {}
    for job in Job.objects.select_related("tenant__shard").filter(status__in=[JobStatus.QUEUED, JobStatus.PARKED]):
        cls = cells.job_class(job)
        names = [cells.shard_cell(job.tenant.shard.name, cls), cells.tenant_cell(job.tenant.slug, cls)]
        if job.status == JobStatus.PARKED:
            names.append(cells.parked_cell(job.tenant.slug, cls))
        for name in names:
            found.setdefault(name, []).append((job.due_at or job.submitted_at).timestamp())
    return {name: (len(ts), min(ts)) for name, ts in found.items()}


class CellsTests(RedisTestCase):
    def setUp(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, _ = make_tenant("acme", max_concurrency=1)

    def submit(self, n: int, latency_class: str = "default") -> list[Job]:
        with self.captureOnCommitCallbacks(execute=True):
            return [
                job_submit(tenant=self.tenant, req=JobRequest(task="demo.noop", priority=latency_class)).job
                for _ in range(n)
            ]

    def view(self) -> dict[str, tuple[int, float]]:
        return {name: (c.waiting, c.oldest_ts or 0.0) for name, c in cells.cells_read().cells.items()}

    def assert_matches_database(self) -> None:
        got, want = self.view(), _from_database()
        self.assertEqual(set(got), set(want))
        for name, (n, oldest) in want.items():
            self.assertEqual(got[name][0], n, name)
            self.assertAlmostEqual(got[name][1], oldest, delta=0.001, msg=name)

    def test_submit_park_start_cancel_keep_the_cells(self) -> None:
        jobs = self.submit(3)
        self.submit(1, latency_class="critical")
        # max_concurrency 1: one admitted, the others parked behind it.
        self.assertEqual(Job.objects.filter(status=JobStatus.PARKED).count(), 3)
        self.assert_matches_database()
        view = cells.cells_read()
        self.assertEqual(view.get(cells.shard_cell("default", "default")).waiting, 3)
        self.assertEqual(view.get(cells.parked_cell("acme", "default")).waiting, 2)
        # The admitted one starts and runs: it waits no more.
        job_execute(job_id=str(jobs[0].id), generation=jobs[0].generation, worker="w1")
        self.assert_matches_database()
        parked = Job.objects.filter(status=JobStatus.PARKED, latency_class="default").first()
        assert parked is not None
        job_cancel(job=parked)
        self.assert_matches_database()
        self.assertEqual(cells.cells_read().get(cells.shard_cell("default", "default")).waiting, 1)

    def test_rebuild_from_the_database_after_redis_lost_the_cells(self) -> None:
        self.submit(4)
        before = self.view()
        for key in self.redis.scan_iter(match="fq:{cells}:*"):
            self.redis.delete(key)
        self.assertEqual(cells.cells_read().cells, {})
        self.assertGreaterEqual(cells.cells_ensure(), 4)
        self.assertEqual(self.view(), before)
        self.assertEqual(cells.cells_ensure(), -1)  # built: nothing to do

    def test_audit_takes_out_a_job_whose_leaving_was_lost(self) -> None:
        jobs = self.submit(2)
        oldest = min(jobs, key=lambda j: j.submitted_at)
        # The row says cancelled, but the cells never heard (a Redis error at that moment).
        Job.objects.filter(id=oldest.id).update(status=JobStatus.CANCELLED, finished_at=timezone.now())
        self.assertEqual(cells.cells_audit(), 1)
        self.assert_matches_database()

    def test_reading_costs_one_command_whatever_the_backlog(self) -> None:
        self.submit(5)
        old = timezone.now() - timedelta(hours=1)
        Job.objects.update(submitted_at=old)
        cells.cells_rebuild()
        self.redis.config_resetstat()
        view = cells.cells_read()
        stats = self.redis.info("commandstats")
        # A new connection's handshake (CLIENT, HELLO) and the counting itself aside.
        plumbing = ("cmdstat_config", "cmdstat_info", "cmdstat_client", "cmdstat_hello")
        self.assertEqual(sum(v["calls"] for k, v in stats.items() if not k.startswith(plumbing)), 1, stats)
        self.assertAlmostEqual(
            view.get(cells.shard_cell("default", "default")).oldest_ts or 0, old.timestamp(), delta=0.01
        )
