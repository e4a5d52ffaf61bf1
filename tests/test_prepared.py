"""The worker's per-job statements through fairqueue.jobs.prepared: on PostgreSQL they are
prepared on the connection (and still seen by its execute wrappers); on either database
the rows they read and write are those the plain statements read and write."""

from __future__ import annotations

from typing import Any

import psycopg
from django.conf import settings
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from fairqueue.jobs import groupcommit, jobrows
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.prepared import hot_cursor, prepared_enabled
from fairqueue.jobs.submission import JobRequest, job_submit
from tests.base import RedisTestCase, RedisTransactionTestCase
from tests.factories import make_tenant
from tests.test_jobrows import values

PLAIN = {**settings.FAIRQUEUE, "DB_PREPARED": False}
SAME_EXCEPT = ("id",)


def row(job_id: Any) -> dict[str, Any]:
    found = values(Job.objects.get(id=job_id))
    return {k: v for k, v in found.items() if k not in SAME_EXCEPT}


def deallocate_all() -> None:
    """Forget what the session prepared, on the server and in psycopg's own record of it
    (psycopg clears that when it sees DEALLOCATE ALL). Connections come from a pool, so a
    test's session may hold what earlier tests prepared."""
    connection.ensure_connection()
    with psycopg.Cursor(connection.connection) as cursor:
        cursor.execute("DEALLOCATE ALL")


class PreparedStatementTests(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.tenant, _ = make_tenant("prep")

    def job(self) -> Job:
        return Job.objects.create(
            tenant=self.tenant,
            sub_tenant="s",
            task="demo.noop",
            args={"n": [1, "two"]},
            latency_class="standard",
            status=JobStatus.QUEUED,
            generation=3,
            engine_tag="s:x",
            timeline="accepted\n",
        )

    def run_path(self, job: Job, now: Any) -> tuple[Job | None, bool, bool, list[str]]:
        """Read, claim and record the outcome of `job` as a delivery does; returns the read
        row, whether the claim and the outcome won, and the statements sent."""
        sent: list[str] = []

        def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            sent.append(sql)
            return execute(sql, params, many, context)

        with connection.execute_wrapper(record):
            read = groupcommit.job_waiting(job_id=str(job.id), generation=job.generation)
            line = tl.line(tl.STARTED, "w", at=now)
            claimed = groupcommit.job_claim(
                job_id=str(job.id), generation=job.generation, worker="w", now=now, lines=line
            )
            fields = {
                "status": JobStatus.SUCCEEDED,
                "result": {"ok": [1, None]},
                "finished_at": now,
                "attempt_history": [{"attempt": 1}],
            }
            recorded = groupcommit.job_outcome(job, fields=fields, lines=[tl.line(tl.FINISHED, "succeeded", at=now)])
        return read, claimed, recorded, sent

    def test_prepared_and_plain_statements_read_and_write_the_same_rows(self) -> None:
        now = timezone.now()
        fast, plain = self.job(), self.job()
        Job.objects.filter(id__in=[fast.id, plain.id]).update(submitted_at=now)  # alike but for their ids
        fast_read, *fast_won, fast_sent = self.run_path(fast, now)
        with override_settings(FAIRQUEUE=PLAIN):
            plain_read, *plain_won, plain_sent = self.run_path(plain, now)
        self.assertEqual(fast_won, [True, True])
        self.assertEqual(plain_won, [True, True])
        assert fast_read is not None and plain_read is not None
        strip = lambda v: {k: x for k, x in v.items() if k not in SAME_EXCEPT}  # noqa: E731
        self.assertEqual(strip(values(fast_read)), strip(values(plain_read)))
        self.assertEqual(values(fast_read.tenant), values(plain_read.tenant))
        self.assertEqual(row(fast.id), row(plain.id))
        self.assertEqual(Job.objects.get(id=fast.id).status, JobStatus.SUCCEEDED)
        # The same statements, each seen by the connection's execute wrappers either way.
        self.assertEqual(fast_sent, plain_sent)
        self.assertEqual(len(fast_sent), 3, fast_sent)

    def test_the_statements_are_prepared_on_postgresql_only(self) -> None:
        job = self.job()
        if connection.vendor == "postgresql":
            deallocate_all()
        self.run_path(job, timezone.now())
        self.assertEqual(prepared_enabled(connection), connection.vendor == "postgresql")
        if connection.vendor != "postgresql":
            with hot_cursor(connection) as cursor:  # the connection's own cursor
                cursor.execute("SELECT 1")
                self.assertEqual(cursor.fetchall(), [(1,)])
            return
        with connection.cursor() as cursor:
            cursor.execute("SELECT statement FROM pg_prepared_statements")
            prepared = [text for (text,) in cursor.fetchall()]
        starts = sorted({text.split(" ", 1)[0] for text in prepared})
        self.assertEqual(starts, ["SELECT", "WITH"], prepared)  # the row read; the claim and the outcome
        self.assertEqual(sum(text.startswith("WITH") for text in prepared), 2, prepared)
        self.assertTrue(any(jobrows._plan(connection.alias).select.split(" WHERE ")[0] in t for t in prepared))
        with override_settings(FAIRQUEUE=PLAIN):
            self.assertFalse(prepared_enabled(connection))

    def test_a_connection_logging_its_queries_logs_the_statements_sql(self) -> None:
        job = self.job()
        with CaptureQueriesContext(connection) as logged:
            self.run_path(job, timezone.now())
        sqls = [q["sql"] for q in logged.captured_queries]
        self.assertEqual(len(sqls), 3, sqls)
        # With its values (SQLite writes a UUID as its hex digits).
        self.assertTrue(all(str(job.id) in sql or job.id.hex in sql for sql in sqls), sqls)


class PreparedInsertTests(RedisTransactionTestCase):
    """A single submit's INSERT (fairqueue.jobs.copy_insert.row_insert) is prepared on the
    web process's connection too, unless prepared statements are turned off."""

    serialized_rollback = True  # the latency classes the migrations seed, back after the flush

    def inserts_prepared(self) -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'INSERT INTO %%'")
            (count,) = cursor.fetchone()
        return int(count)

    def test_a_single_submits_insert_is_prepared_on_postgresql(self) -> None:
        tenant, _ = make_tenant("prep-insert")  # autocommit: its policy sync runs at once
        if connection.vendor != "postgresql":  # SQLite writes the row with save(): nothing to prepare
            job_submit(tenant=tenant, req=JobRequest(task="demo.noop"))
            self.assertTrue(Job.objects.filter(tenant=tenant).exists())
            return
        deallocate_all()
        with override_settings(FAIRQUEUE=PLAIN):
            job_submit(tenant=tenant, req=JobRequest(task="demo.noop"))
        self.assertEqual(self.inserts_prepared(), 0)
        job_submit(tenant=tenant, req=JobRequest(task="demo.noop"))
        self.assertEqual(self.inserts_prepared(), 1)
        self.assertEqual(Job.objects.filter(tenant=tenant).count(), 2)
