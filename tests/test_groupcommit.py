"""Group commit in a worker process (fairqueue.jobs.groupcommit): the claims (and the
outcomes) that several threads make at once go out as one statement, each thread learns
whether its own compare-and-set won, a conflicting member loses only itself, and a batch
the database refuses ends each member as its own statement would have.

Real threads, each with its own database connection, on the suite's database (SQLite or
PostgreSQL); the statements are counted by an execute wrapper on every thread's connection.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection
from django.test import override_settings
from django.utils import timezone

from fairqueue.jobs import groupcommit
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.models import Job, JobStatus
from tests.base import RedisTransactionTestCase
from tests.factories import make_tenant
from webhooks.models import WebhookEvent

# Long enough that a batch always waits for every announced thread (the test's threads
# all announce before any of them arrives), never so long that a failure hangs the suite.
WINDOW_MS = {"GROUP_COMMIT_MS": 20_000.0}
JOIN_SECONDS = 60


REFUSED_WORKER = "refused-worker"


def refuse_trigger(worker: str) -> None:
    """Make the database refuse any UPDATE of a job row that sets `worker` to this name."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "CREATE FUNCTION fq_test_refuse() RETURNS trigger AS $$ BEGIN "
                f"IF NEW.worker = '{worker}' THEN RAISE EXCEPTION 'refused by the test'; END IF; "
                "RETURN NEW; END $$ LANGUAGE plpgsql"
            )
            cursor.execute(
                "CREATE TRIGGER fq_test_refuse BEFORE UPDATE ON jobs_job FOR EACH ROW EXECUTE FUNCTION fq_test_refuse()"
            )
        else:
            cursor.execute(
                f"CREATE TRIGGER fq_test_refuse BEFORE UPDATE ON jobs_job WHEN NEW.worker = '{worker}' "
                "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
            )


def drop_refuse_trigger() -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("DROP TRIGGER IF EXISTS fq_test_refuse ON jobs_job")
            cursor.execute("DROP FUNCTION IF EXISTS fq_test_refuse()")
        else:
            cursor.execute("DROP TRIGGER IF EXISTS fq_test_refuse")


def together(
    calls: list[Callable[[Callable[[], None]], Any]], batcher: groupcommit.Batcher[Any, Any]
) -> tuple[list[Any], list[str]]:
    """Run each call in its own thread, all announced to `batcher` before any starts; each
    gets its `arrived`. Returns their results (an exception where one raised) and every
    statement any thread's connection sent."""
    results: list[Any] = [None] * len(calls)
    statements: list[str] = []
    ready = threading.Barrier(len(calls))

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements.append(sql)
        return execute(sql, params, many, context)

    def one(i: int) -> None:
        try:
            with batcher.expecting() as arrived, connection.execute_wrapper(record):
                ready.wait(timeout=JOIN_SECONDS)
                results[i] = calls[i](arrived)
        except Exception as exc:
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_SECONDS)
    return results, statements


def claim(job_id: str, generation: int, worker: str = "w1") -> Callable[[Callable[[], None]], bool]:
    now = timezone.now()
    return lambda arrived: groupcommit.job_claim(
        job_id=job_id,
        generation=generation,
        worker=worker,
        now=now,
        lines=tl.line(tl.STARTED, worker, at=now),
        arrived=arrived,
    )


@override_settings(FAIRQUEUE={**settings.FAIRQUEUE, **WINDOW_MS})
class GroupCommitTests(RedisTransactionTestCase):
    serialized_rollback = True  # the rows the migrations seed survive the flush, as other such tests expect

    def setUp(self) -> None:
        super().setUp()
        self.tenant, _ = make_tenant("gc")

    def jobs(self, n: int, **fields: Any) -> list[Job]:
        return [
            Job.objects.create(tenant=self.tenant, task="demo.noop", latency_class="standard", **fields)
            for _ in range(n)
        ]

    def test_claims_made_at_once_go_as_one_statement_and_each_wins(self) -> None:
        admitted = timezone.now() - timedelta(seconds=5)
        jobs = self.jobs(3, admitted_at=admitted) + self.jobs(1, status=JobStatus.PARKED)
        results, statements = together([claim(str(j.id), j.generation) for j in jobs], groupcommit.claims)
        self.assertEqual(results, [True] * 4)
        self.assertEqual(len(statements), 1, statements)
        self.assertIn("UPDATE", statements[0].upper())
        for job in Job.objects.filter(id__in=[j.id for j in jobs]):
            with self.subTest(job=job.id):
                self.assertEqual((job.status, job.attempts, job.worker), (JobStatus.RUNNING, 1, "w1"))
                self.assertIsNotNone(job.started_at)
                self.assertEqual([s.event for s in tl.steps(job.timeline)], [tl.STARTED])
                # The single statement's Coalesce: the admission's time kept, else the start's.
                expected = job.started_at if job.id == jobs[3].id else admitted
                self.assertEqual(job.admitted_at, expected)

    def test_a_conflicting_claim_in_a_batch_loses_only_itself(self) -> None:
        ok, stale, running, twice = self.jobs(4)
        Job.objects.filter(id=stale.id).update(generation=1)  # re-delivered since
        Job.objects.filter(id=running.id).update(status=JobStatus.RUNNING, attempts=1, worker="other")
        calls = [
            claim(str(ok.id), 0),
            claim(str(stale.id), 0),
            claim(str(running.id), 0),
            claim(str(twice.id), 0, worker="a"),
            claim(str(twice.id), 0, worker="b"),
        ]
        results, statements = together(calls, groupcommit.claims)
        self.assertEqual(results[:3], [True, False, False])
        self.assertEqual(sorted(results[3:]), [False, True], "two deliveries of one job: exactly one wins")
        self.assertEqual(len(statements), 1, statements)
        rows = {j.id: j for j in Job.objects.filter(id__in=[ok.id, stale.id, running.id, twice.id])}
        self.assertEqual((rows[ok.id].status, rows[ok.id].attempts), (JobStatus.RUNNING, 1))
        self.assertEqual(
            (rows[stale.id].status, rows[stale.id].attempts, rows[stale.id].timeline), (JobStatus.QUEUED, 0, "")
        )
        self.assertEqual((rows[running.id].worker, rows[running.id].attempts), ("other", 1))
        self.assertEqual(rows[twice.id].attempts, 1)
        self.assertEqual(rows[twice.id].worker, "a" if results[3] else "b")
        self.assertEqual(len(tl.steps(rows[twice.id].timeline)), 1)

    def test_deliveries_read_at_once_read_their_rows_in_one_select(self) -> None:
        fresh, stale, started, twice = self.jobs(4)
        Job.objects.filter(id=stale.id).update(generation=1)
        Job.objects.filter(id=started.id).update(status=JobStatus.RUNNING)
        keys = [(fresh.id, 0), (stale.id, 0), (started.id, 0), (twice.id, 0), (twice.id, 0)]

        def read(job_id: Any) -> Callable[[Callable[[], None]], Job | None]:
            def call(arrived: Callable[[], None]) -> Job | None:
                return groupcommit.reads.submit(
                    (str(job_id), 0),
                    alone=lambda: groupcommit.job_waiting(job_id=str(job_id), generation=0),
                    arrived=arrived,
                )

            return call

        results, statements = together([read(k) for k, _ in keys], groupcommit.reads)
        self.assertEqual(len(statements), 1, statements)
        self.assertEqual([r.id if r is not None else None for r in results], [fresh.id, None, None, twice.id, twice.id])
        self.assertIsNot(results[3], results[4], "each thread changes its own instance")
        self.assertEqual(results[0].tenant.shard.name, "default")  # read with its tenant and shard

    def test_a_lone_claim_sends_one_statement_and_wins_only_its_generation(self) -> None:
        # A batch of one: the batch statement of one row (not the ORM's `alone`).
        job, stale = self.jobs(2)
        Job.objects.filter(id=stale.id).update(generation=1)
        for expected, target in ((True, job), (False, stale)):
            results, statements = together([claim(str(target.id), 0)], groupcommit.claims)
            self.assertEqual(results, [expected])
            self.assertEqual(len(statements), 1, statements)
        rows = {j.id: j for j in Job.objects.filter(id__in=[job.id, stale.id])}
        self.assertEqual(
            (rows[job.id].status, rows[job.id].attempts, rows[job.id].worker), (JobStatus.RUNNING, 1, "w1")
        )
        self.assertEqual([s.event for s in tl.steps(rows[job.id].timeline)], [tl.STARTED])
        self.assertEqual((rows[stale.id].status, rows[stale.id].attempts), (JobStatus.QUEUED, 0))

    def test_a_lone_outcome_writes_its_webhook_event_with_it(self) -> None:
        (hooked,) = self.jobs(1, callback_url="https://hooks.example.com/done", status=JobStatus.RUNNING, attempts=1)
        finished = timezone.now()
        fields = {"status": JobStatus.FAILED, "error": "E", "error_reason": "exception", "finished_at": finished}
        lines = [tl.line(tl.FINISHED, "failed", at=finished)]
        results, _ = together(
            [lambda arrived: groupcommit.job_outcome(hooked, fields=fields, lines=lines, arrived=arrived)],
            groupcommit.outcomes,
        )
        self.assertEqual(results, [True])
        row = Job.objects.get(id=hooked.id)
        self.assertEqual(
            (row.status, row.error, row.error_reason, row.finished_at), (JobStatus.FAILED, "E", "exception", finished)
        )
        self.assertEqual(list(WebhookEvent.objects.values_list("job_id", "type")), [(hooked.id, "job.failed")])

    def test_outcomes_recorded_at_once_go_as_one_transaction_with_their_webhook_events(self) -> None:
        running = {"status": JobStatus.RUNNING, "attempts": 1}
        (plain,) = self.jobs(1, **running)
        (hooked,) = self.jobs(1, callback_url="https://hooks.example.com/done", **running)
        (redelivered,) = self.jobs(1, generation=1, **running)  # a newer delivery owns it
        redelivered.generation = 0  # this thread's delivery is the old one
        jobs = [plain, hooked, redelivered]
        finished = timezone.now()

        def outcome(job: Job, result: Any) -> Callable[[Callable[[], None]], bool]:
            fields = {
                "status": JobStatus.SUCCEEDED,
                "result": result,
                "finished_at": finished,
                "attempt_history": [{"attempt": 1}],
            }
            lines = [tl.line(tl.FINISHED, "succeeded", at=finished)]
            return lambda arrived: groupcommit.job_outcome(job, fields=fields, lines=lines, arrived=arrived)

        results, statements = together(
            [outcome(plain, {"n": 1}), outcome(hooked, None), outcome(redelivered, {"n": 3})], groupcommit.outcomes
        )
        self.assertEqual(results, [True, True, False])
        updates = [s for s in statements if s.upper().lstrip().startswith(("WITH", "UPDATE"))]
        self.assertEqual(len(updates), 1, statements)
        rows = {j.id: j for j in Job.objects.filter(id__in=[j.id for j in jobs])}
        self.assertEqual((rows[plain.id].status, rows[plain.id].result), (JobStatus.SUCCEEDED, {"n": 1}))
        self.assertEqual(rows[plain.id].attempt_history, [{"attempt": 1}])
        self.assertEqual(rows[plain.id].finished_at, finished)
        self.assertEqual([s.event for s in tl.steps(rows[plain.id].timeline)], [tl.FINISHED])
        self.assertEqual((rows[hooked.id].status, rows[hooked.id].result), (JobStatus.SUCCEEDED, None))
        self.assertEqual((rows[redelivered.id].status, rows[redelivered.id].timeline), (JobStatus.RUNNING, ""))
        # The event exists exactly for the change that won and has a target.
        self.assertEqual(list(WebhookEvent.objects.values_list("job_id", "type")), [(hooked.id, "job.succeeded")])

    def test_a_batch_the_database_refuses_ends_each_member_as_its_own_statement_would(self) -> None:
        # A trigger that refuses one worker's name: the database then refuses the whole
        # batched statement, and only that member's own statement.
        refuse_trigger(REFUSED_WORKER)
        self.addCleanup(drop_refuse_trigger)
        jobs = self.jobs(3)
        calls = [claim(str(jobs[0].id), 0), claim(str(jobs[1].id), 0, worker=REFUSED_WORKER), claim(str(jobs[2].id), 0)]
        results, statements = together(calls, groupcommit.claims)
        self.assertEqual(results[0], True)
        self.assertIsInstance(results[1], DatabaseError)
        self.assertEqual(results[2], True)
        self.assertEqual(len(statements), 4, "the batch, then each member's own statement")
        rows = {j.id: j for j in Job.objects.filter(id__in=[j.id for j in jobs])}
        self.assertEqual([rows[j.id].status for j in jobs], [JobStatus.RUNNING, JobStatus.QUEUED, JobStatus.RUNNING])
        self.assertEqual([rows[j.id].attempts for j in jobs], [1, 0, 1])

    @override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "GROUP_COMMIT_MS": 0.0})
    def test_a_window_of_zero_sends_each_claim_alone(self) -> None:
        jobs = self.jobs(3)
        results, statements = together([claim(str(j.id), 0) for j in jobs], groupcommit.claims)
        self.assertEqual(results, [True] * 3)
        self.assertEqual(len(statements), 3)
        self.assertTrue(all("VALUES" not in s.upper() for s in statements))
