"""Cells: the waiting jobs per (shard, class) and (tenant, class), kept in Redis as jobs
move (fairqueue.jobs.cells), against the database's truth."""

from __future__ import annotations

from datetime import timedelta

import redis
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from fairqueue.jobs import cells
from fairqueue.jobs.cancellation import job_cancel
from fairqueue.jobs.due import jobs_promote_due
from fairqueue.jobs.execution import job_execute
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.runtime import redis_client
from fairqueue.jobs.submission import JobRequest, job_submit
from tenants.models import Shard
from tests.base import RedisTestCase
from tests.factories import make_tenant


def _from_database() -> dict[str, tuple[int, float]]:
    """Every cell as the database says: (waiting, oldest time a job became due; 0 for a
    tenant's parked cell, which is a count alone)."""
    found: dict[str, list[float]] = {}
    for job in Job.objects.select_related("tenant__shard").filter(status__in=[JobStatus.QUEUED, JobStatus.PARKED]):
        cls = cells.job_class(job)
        names = [cells.shard_cell(job.tenant.shard.name, cls), cells.tenant_cell(job.tenant.slug, cls)]
        if job.status == JobStatus.PARKED:
            names.append(cells.parked_cell(job.tenant.slug, cls))
        for name in names:
            found.setdefault(name, []).append((job.due_at or job.submitted_at).timestamp())
    return {name: (len(ts), 0.0 if name.startswith("p|") else min(ts)) for name, ts in found.items()}


class CellsTestCase(RedisTestCase):
    """The cells as read from Redis, and the check that they agree with the job rows."""

    def view(self) -> dict[str, tuple[int, float]]:
        return {name: (c.waiting, c.oldest_ts or 0.0) for name, c in cells.cells_read().cells.items()}

    def assert_matches_database(self) -> None:
        got, want = self.view(), _from_database()
        self.assertEqual(set(got), set(want))
        for name, (n, oldest) in want.items():
            self.assertEqual(got[name][0], n, name)
            self.assertAlmostEqual(got[name][1], oldest, delta=0.001, msg=name)


class CellsTests(CellsTestCase):
    def setUp(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, _ = make_tenant("acme", max_concurrency=1)

    def submit(self, n: int, latency_class: str = "default") -> list[Job]:
        with self.captureOnCommitCallbacks(execute=True):
            return [
                job_submit(tenant=self.tenant, req=JobRequest(task="demo.noop", priority=latency_class)).job
                for _ in range(n)
            ]

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

    def test_the_ticks_audit_checks_a_head_once_then_again_when_due(self) -> None:
        cells._audit_next.clear()
        jobs = self.submit(3)
        oldest = min(jobs, key=lambda j: j.submitted_at)
        self.assertEqual(cells.cells_audit(incremental=True), 0)  # new heads: checked, all waiting
        with CaptureQueriesContext(connection) as queries:
            self.assertEqual(cells.cells_audit(incremental=True), 0)
        self.assertEqual(len(queries), 0)  # nothing new and none due again: no query
        Job.objects.filter(id=oldest.id).update(status=JobStatus.CANCELLED, finished_at=timezone.now())
        for job_id in cells._audit_next:  # AUDIT_RECHECK_SECONDS later
            cells._audit_next[job_id] = 0.0
        self.assertEqual(cells.cells_audit(incremental=True), 1)
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


class CellsScriptBulkTests(RedisTestCase):
    """lua/cells.lua writes a changed cell's summary once per call: a bulk's worth of
    operations on a few cells, under a prefix of the test's own, leaves the same summary
    as when each operation is a call of its own."""

    def apply(self, prefix: str, ops: list[list[object]], *, one_call: bool) -> None:
        calls = [[a for op in ops for a in op]] if one_call else ops
        for args in calls:
            self.redis.eval(cells.SOURCE, 1, prefix, *args)

    def state(self, prefix: str) -> dict[str, object]:
        out: dict[str, object] = {"summary": self.redis.hgetall(prefix + "summary")}
        out["of"] = self.redis.hgetall(prefix + "of")
        out["counted"] = self.redis.hgetall(prefix + "counted")
        for key in self.redis.scan_iter(match=prefix.replace("{", "[{]").replace("}", "[}]") + "z:*"):
            out[key.decode()[len(prefix) :]] = self.redis.zrange(key, 0, -1, withscores=True)
        out["changes"] = self.redis.zrange(prefix + "changes", 0, -1)
        return out

    def test_one_call_of_many_operations_leaves_what_one_call_each_leaves(self) -> None:
        ops: list[list[object]] = [
            ["set", f"j{n}", f"{100 + n % 7}.5", 2, "c|s|default", f"t|{'ab'[n % 2]}|default"] for n in range(40)
        ]
        ops += [["park", f"j{n}", f"{100 + n % 7}.5", "p|a|default"] for n in range(0, 40, 4)]
        ops += [["del", "j0"], ["del", "j3"], ["unpark", "j4"], ["reset", "j5", "99.0", 1, "c|s|batch"]]
        ops += [["del", f"j{n}"] for n in range(20, 40)]
        ops += [["del", "j5"]]  # c|s|batch had j5 alone: left empty, its summary goes
        self.apply("x:{cells}:", ops, one_call=True)
        self.apply("y:{cells}:", ops, one_call=False)
        one, each = self.state("x:{cells}:"), self.state("y:{cells}:")
        self.assertEqual(one, {**each, "changes": one["changes"]})
        self.assertEqual(sorted(one["changes"]), sorted(each["changes"]))  # the same cells changed
        self.assertEqual(one["summary"][b"c|s|default"], b"17 100.5")
        self.assertEqual(one["summary"][b"p|a|default"], b"3")  # a parked cell: a count alone
        self.assertNotIn("z:p|a|default", one)
        self.assertNotIn(b"c|s|batch", one["summary"])
        self.assertIn("z:c|s|default", one)


class CellsOnMainTransitionsTests(CellsTestCase):
    """Transitions beside submit/park/start/cancel: delayed and retried jobs (which wait
    from when they became due), moves between shards, and marks that arrive late."""

    def setUp(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, _ = make_tenant("acme", max_concurrency=1)

    def submit(self, **fields: object) -> Job:
        with self.captureOnCommitCallbacks(execute=True):
            return job_submit(tenant=self.tenant, req=JobRequest(task="demo.noop", **fields)).job  # type: ignore[arg-type]

    def test_a_delayed_job_waits_in_no_cell_until_due_then_from_its_due_time(self) -> None:
        self.submit()  # holds the tenant's one slot, so the next ones park
        delayed = self.submit(delay_seconds=3600)
        self.assertEqual(delayed.status, JobStatus.SCHEDULED)
        self.assert_matches_database()  # the scheduled job is in no cell
        self.assertEqual(cells.cells_read().get(cells.tenant_cell("acme", "default")).waiting, 1)  # the first
        due_at = timezone.now() - timedelta(seconds=30)
        Job.objects.filter(id=delayed.id).update(due_at=due_at)
        self.assertEqual(jobs_promote_due(), 1)
        self.assertEqual(Job.objects.get(id=delayed.id).status, JobStatus.PARKED)
        self.assert_matches_database()
        cell = cells.cells_read().get(cells.shard_cell("default", "default"))
        # Its wait started at its due time, before the first job's submit (the oldest now),
        # not at its own submit (after that one's).
        self.assertEqual(cell.waiting, 2)
        self.assertAlmostEqual(cell.oldest_ts or 0, due_at.timestamp(), delta=0.001)
        self.assertEqual(cells.cells_read().get(cells.parked_cell("acme", "default")).waiting, 1)

    def test_a_retrying_job_reenters_its_cells_when_its_backoff_is_over(self) -> None:
        job = self.submit()
        job_execute(job_id=str(job.id), generation=job.generation, worker="w1")
        # A failed attempt the policy retries leaves the row `retrying` until due_at
        # (fairqueue.jobs.retries.failure_fields): written here as that path writes it.
        due_at = timezone.now() - timedelta(seconds=5)
        Job.objects.filter(id=job.id).update(status=JobStatus.RETRYING, due_at=due_at, finished_at=None)
        self.assert_matches_database()
        self.assertEqual(jobs_promote_due(), 1)
        self.assert_matches_database()
        cell = cells.cells_read().get(cells.tenant_cell("acme", "default"))
        self.assertEqual(cell.waiting, 1)
        self.assertAlmostEqual(cell.oldest_ts or 0, due_at.timestamp(), delta=0.001)

    def test_a_moved_tenants_waiting_jobs_follow_it_to_its_new_shard(self) -> None:
        self.submit()
        self.submit()
        self.submit()
        self.assertEqual(cells.cells_read().get(cells.shard_cell("default", "default")).waiting, 3)
        with self.captureOnCommitCallbacks(execute=True):
            other = Shard.objects.create(name="other", capacity=100)
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant.shard = other
            self.tenant.save()
        self.assert_matches_database()
        view = cells.cells_read()
        self.assertEqual(view.get(cells.shard_cell("default", "default")).waiting, 0)
        self.assertEqual(view.get(cells.shard_cell("other", "default")).waiting, 3)

    def test_a_late_parked_mark_does_not_bring_back_a_job_that_left(self) -> None:
        self.submit()
        parked = self.submit()
        self.assertEqual(parked.status, JobStatus.PARKED)
        # Woken and started by another process before this one's mark arrived.
        cells.jobs_leave([str(parked.id)])
        cells.jobs_park([parked])
        cells.jobs_replace([parked])
        view = cells.cells_read()
        self.assertEqual(view.get(cells.parked_cell("acme", "default")).waiting, 0)
        self.assertEqual(view.get(cells.tenant_cell("acme", "default")).waiting, 1)  # the first one


class CellsVersionTests(CellsTestCase):
    """The summary's (epoch, version) moves with every change and only then, and a parse
    from an earlier view equals one from nothing."""

    def setUp(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, _ = make_tenant("acme", max_concurrency=1)
            self.other, _ = make_tenant("other", max_concurrency=1)

    def submit(self, n: int, tenant: object = None, latency_class: str = "default") -> list[Job]:
        with self.captureOnCommitCallbacks(execute=True):
            return [
                job_submit(tenant=tenant or self.tenant, req=JobRequest(task="demo.noop", priority=latency_class)).job
                for _ in range(n)
            ]

    def version(self) -> list[str | None]:
        return self.redis.mget(cells.EPOCH_KEY, cells.VERSION_KEY)  # type: ignore[return-value]

    def test_the_version_moves_with_every_change_and_only_then(self) -> None:
        jobs = self.submit(2)
        first = self.version()
        self.assertNotIn(None, first)
        cells.jobs_leave(["no-such-job"])  # nothing to change
        self.assertEqual(self.version(), first)
        cells.jobs_leave([str(jobs[0].id)])
        second = self.version()
        self.assertEqual(second[0], first[0])
        self.assertNotEqual(second[1], first[1])
        # Redis lost the cells (or they were rebuilt): the count starts again, in a new epoch.
        for key in self.redis.scan_iter(match="fq:{cells}:*"):
            self.redis.delete(key)
        cells.cells_rebuild()
        third = self.version()
        self.assertNotEqual(third[0], first[0])

    def test_a_parse_from_an_earlier_view_equals_one_from_nothing(self) -> None:
        jobs = self.submit(3) + self.submit(2, latency_class="critical") + self.submit(2, tenant=self.other)
        before = cells.cells_read()
        steps = [
            lambda: cells.jobs_leave([str(jobs[0].id)]),  # acme: a default job leaves
            lambda: cells.jobs_unpark([str(jobs[4].id)]),  # acme: a critical one unparked
            lambda: cells.jobs_leave([str(j.id) for j in jobs[5:]]),  # other: everything leaves
            lambda: self.submit(1, tenant=self.other, latency_class="low"),  # other: back, in a new class
        ]
        for step in steps:
            step()
            raw: dict[str, str] = redis_client().hgetall(cells.SUMMARY_KEY)  # type: ignore[assignment]  # text mode
            kept, fresh = cells.cells_parse(raw, before), cells.cells_parse(raw)
            self.assertEqual(kept.cells, fresh.cells)
            self.assertEqual(kept.tenants, fresh.tenants)
            # A tenant none of whose cells changed keeps its objects; `before` is left as it was.
            for kind, by_tenant in kept.tenants.items():
                for slug, classes in by_tenant.items():
                    old = before.tenants[kind].get(slug)
                    if old == classes:
                        self.assertIs(old, classes)
            self.assertEqual(before.cells, cells.cells_parse(before.raw).cells)
            before = kept

    def test_a_refresh_reads_the_cells_changed_since_a_kept_view(self) -> None:
        jobs = self.submit(3) + self.submit(2, tenant=self.other, latency_class="critical")
        view = cells.cells_refresh()
        self.assertIs(cells.cells_refresh(view), view)  # nothing changed: the same view
        steps = [
            lambda: cells.jobs_leave([str(jobs[0].id)]),
            lambda: cells.jobs_unpark([str(jobs[1].id), str(jobs[4].id)]),
            lambda: cells.jobs_leave([str(j.id) for j in jobs[3:]]),
            lambda: self.submit(2, tenant=self.other, latency_class="low"),
        ]
        for step in steps:
            step()
            refreshed, fresh = cells.cells_refresh(view), cells.cells_read()
            self.assertEqual(refreshed.cells, fresh.cells)
            self.assertEqual(refreshed.tenants, fresh.tenants)
            self.assertEqual(refreshed.based_on, view.serial)  # from the changes log, not a full read
            view = refreshed
        # The log lost changes older than the kept view (trimmed): everything is read again.
        cells.jobs_leave([str(jobs[2].id)])
        version = self.redis.get(cells.VERSION_KEY)
        self.redis.delete(cells.CHANGES_KEY)
        self.redis.set(cells.TRIMMED_KEY, version)  # type: ignore[arg-type]
        refreshed = cells.cells_refresh(view)
        self.assertEqual(refreshed.cells, cells.cells_read().cells)
        self.assertEqual(refreshed.tenants, cells.cells_read().tenants)


class CellsScriptTests(RedisTestCase):
    """lua/cells.lua writes a cell's summary once per call, after all its operations: the
    same summary and cell sets as the operations applied one call each."""

    OPS = [
        ["set", "j1", "10.5", 2, "c|s|a", "t|x|a"],
        ["set", "j2", "9.25", 2, "c|s|a", "t|y|a"],
        ["set", "j3", "11", 2, "c|s|a", "t|x|a"],
        ["park", "j1", "10.5", "p|x|a"],
        ["park", "j3", "11", "p|x|a"],
        ["del", "j2"],  # the oldest of c|s|a leaves: its oldest moves to j1
        ["unpark", "j3"],
        ["reset", "j2", "9.25", 2, "c|s|a", "t|y|a"],  # left: stays out
        ["reset", "j3", "12", 2, "c|s|b", "t|x|b"],  # moves cells
        ["set", "j4", "8", 1, "t|y|a"],
        ["del", "j4"],  # t|y|a empties: no summary
        ["del", "nobody"],
    ]

    def state(self) -> tuple[dict[str, str], dict[str, list[tuple[str, float]]], dict[str, str]]:
        client = redis_client()
        summary = client.hgetall(cells.SUMMARY_KEY)
        sets = {key: client.zrange(key, 0, -1, withscores=True) for key in client.scan_iter(match=cells.PREFIX + "z:*")}
        of = client.hgetall(cells.OF_KEY)
        return summary, sets, of

    def apply(self, *calls: list[list[object]]) -> None:
        client = redis_client()
        for ops in calls:
            client.eval(cells.SOURCE, 1, cells.PREFIX, *(a for op in ops for a in op))

    def test_operations_in_one_call_leave_what_one_call_each_leaves(self) -> None:
        self.apply(*[[op] for op in self.OPS])
        one_each = self.state()
        redis_client().flushdb()
        self.apply(self.OPS)
        self.assertEqual(self.state(), one_each)
        summary = one_each[0]
        self.assertEqual(summary["c|s|a"], "1 10.5")  # j1 only (j2 left, j3 moved)
        self.assertEqual(summary["p|x|a"], "1")  # j1 (j3 unparked): a count alone
        self.assertEqual(summary["c|s|b"], "1 12")
        self.assertNotIn("t|y|a", summary)

    def test_a_parked_cell_counts_each_job_once_whatever_repeats(self) -> None:
        self.apply(
            [
                ["set", "j1", "10", 3, "c|s|a", "t|x|a", "p|x|a"],
                ["set", "j1", "10", 3, "c|s|a", "t|x|a", "p|x|a"],  # a repeated entry
                ["park", "j1", "10", "p|x|a"],  # a late mark of a job counted already
                ["set", "j2", "11", 2, "c|s|a", "t|x|a"],
                ["park", "j2", "11", "p|x|a"],
                ["park", "gone", "12", "p|x|a"],  # in no cell: not counted
            ]
        )
        self.assertEqual(self.state()[0]["p|x|a"], "2")
        self.apply([["unpark", "j1"], ["unpark", "j1"], ["del", "j2"], ["del", "j2"]])
        summary, sets, _ = self.state()
        self.assertNotIn("p|x|a", summary)
        self.assertEqual(redis_client().hgetall(cells.PREFIX + "counted"), {})
        self.assertNotIn(cells.PREFIX + "z:p|x|a", sets)

    def test_a_call_stopped_by_an_unknown_operation_keeps_its_applied_operations_summaries(self) -> None:
        applied = self.OPS[:3]
        self.apply(*[[op] for op in applied])
        one_each = self.state()
        redis_client().flushdb()
        with self.assertRaises(redis.ResponseError):
            self.apply([*applied, ["bogus", "j9"]])
        self.assertEqual(self.state(), one_each)
        self.assertEqual(one_each[0]["c|s|a"], "3 9.25")
