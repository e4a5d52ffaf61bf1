"""Group commit of the job record's writes in a worker process: the claims (and, apart,
the outcomes) that its task threads make at about the same moment go to the database as
one conditional UPDATE in one transaction, and each thread learns whether its own
compare-and-set (id, generation, status) won, exactly as its own statement would have told it.

Why: a no-op job's time on a worker went mostly to waiting for two commits (the claim, the
outcome), each its own transaction and WAL flush. A batch of k turns those into 2/k. The
deliveries' row reads are gathered the same way (one SELECT for the batch).

How a batch forms (classic leader/follower group commit, no thread of its own): the
first thread to arrive leads; it sends the batch when no batch of this kind is in flight
in the process and no thread announced as on its way (`expecting`) is still to come, or
after WINDOW at most; threads arriving meanwhile join it. A lone thread waits for nothing.
The leader runs the statement on its own connection; the others wait for its answer.

A batch of one is sent the same way, a statement of one row (built by hand, it costs less
CPU than the caller's own ORM statement, `alone`, which runs when batching is off). If a
batch's transaction fails (a database error), nothing of it committed, and every member
runs its own single statement instead, so a member's bad value, a deadlock or a lost
connection ends each member as its own statement would have.
If the process dies mid-batch, no member's change or all of them committed, and each is
then what a worker killed before or after that one change leaves today (the hold runs out
on the running lease; the job is delivered again).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

from django.db import connections, router, transaction
from django.db.models import F, Field, Value
from django.db.models.functions import Coalesce

from fairqueue.conf import fq_settings
from fairqueue.jobs import cells, jobrows, stats
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.models import WAITING_STATUSES, Job, JobStatus
from fairqueue.jobs.prepared import hot_cursor
from webhooks.outbox import event_record, job_finish, webhook_target

log = logging.getLogger("fairqueue.jobs.groupcommit")

T = TypeVar("T")
R = TypeVar("R")
MAX_BATCH = 64  # rows per statement: the process's threads, with room to spare
CTE = "fq_v"  # the VALUES list's name in the statement
ID_COL, GEN_COL, LINES_COL = "fq_id", "fq_gen", "fq_lines"


def window_seconds() -> float:
    """How long a leader waits at most for threads on their way; 0 turns batching off."""
    return float(fq_settings().GROUP_COMMIT_MS) / 1000.0


@dataclass
class _Batch(Generic[T, R]):
    items: list[T] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    results: list[R] | None = None


class Batcher(Generic[T, R]):
    """Gathers items from the process's threads into batches for `flush`, which returns
    each item's answer in order, e.g. whether its compare-and-set won (or raises: then
    each member runs its `alone`)."""

    def __init__(self, name: str, flush: Callable[[list[T]], list[R]], *, max_batch: int = MAX_BATCH) -> None:
        self.name = name
        self._flush = flush
        self._max = max_batch
        self._cond = threading.Condition()
        self._open: _Batch[T, R] | None = None
        self._flushing = False
        self._coming = 0  # threads announced (`expecting`) that have not arrived yet

    @contextmanager
    def expecting(self) -> Iterator[Callable[[], None]]:
        """Announce this thread as on its way to `submit` (a leader waits for it up to the
        window); the yielded callable, or leaving the block, withdraws the announcement."""
        state = {"on": True}
        with self._cond:
            self._coming += 1

        def withdraw() -> None:
            if state["on"]:
                state["on"] = False
                with self._cond:
                    self._coming -= 1
                    # A leader waits for the last announced thread only (see `submit`): waking
                    # it on every arrival cost each thread a wake-up for nothing.
                    if self._coming == 0:
                        self._cond.notify_all()

        try:
            yield withdraw
        finally:
            withdraw()

    def submit(self, item: T, *, alone: Callable[[], R], arrived: Callable[[], None] | None = None) -> R:
        """`item`'s answer (whether its compare-and-set won), sent in a batch with other
        threads' items when there are any; `alone` is the item's own single statement.
        `arrived` withdraws this thread's `expecting` announcement."""
        window = window_seconds()
        if window <= 0:
            if arrived is not None:
                arrived()
            return alone()
        with self._cond:
            if arrived is not None:
                arrived()  # under the (reentrant) lock: a leader cannot go without this item
            batch = self._open
            leader = batch is None
            if batch is None:
                batch = self._open = _Batch()
            index = len(batch.items)
            batch.items.append(item)
            if len(batch.items) >= self._max:
                self._open = None  # full: later arrivals start the next one
                self._cond.notify_all()  # its leader waits no more
            if leader:
                deadline = time.monotonic() + window
                while True:
                    left = deadline - time.monotonic()
                    if not self._flushing and (self._coming == 0 or left <= 0 or self._open is not batch):
                        break
                    # A batch in flight is waited out whatever the window: its commit is
                    # when the next batch would go anyway.
                    self._cond.wait(left if left > 0 and not self._flushing else 0.05)
                if self._open is batch:
                    self._open = None
                self._flushing = True
        if leader:
            try:
                # A batch of one too: sent as this kind's one in flight, threads arriving
                # meanwhile gather for the next batch (what makes batches under load). It
                # goes through `flush` as well, whose statement is built by hand, cheaper
                # in CPU than `alone`'s ORM statement compiled per call.
                try:
                    batch.results = self._flush(batch.items)
                except Exception:  # nothing committed: every member runs its own statement instead
                    stats.count(f"groupcommit:{self.name}:failed")
                    log.warning("%s batch of %d failed; each runs alone", self.name, len(batch.items), exc_info=True)
                else:
                    if len(batch.items) > 1:
                        stats.count(f"groupcommit:{self.name}:batches")
                        stats.count(f"groupcommit:{self.name}:rows", len(batch.items))
            finally:  # also on a BaseException (the process stopping): no member waits forever
                with self._cond:
                    self._flushing = False
                    self._cond.notify_all()
                batch.done.set()
        else:
            batch.done.wait()
        if batch.results is None:  # nothing of the batch committed
            return alone()
        return batch.results[index]


@dataclass(frozen=True)
class RowChange:
    """One member of a batched conditional UPDATE of a job row: where (id, generation,
    and status in the batch's statuses), the literal column values it sets, the timeline
    lines it appends."""

    job_id: str
    generation: int
    values: Mapping[str, Any]
    lines: str


def rows_update(
    changes: Sequence[RowChange], *, statuses: Sequence[str], expressions: Mapping[str, str] | None = None
) -> list[bool]:
    """Per group of changes setting the same columns, one `WITH fq_v(...) AS (VALUES ...)
    UPDATE job SET ... FROM fq_v WHERE id, generation and status match RETURNING id`;
    returns, per change, whether its row was updated. More than one group runs in one
    transaction; one group is one statement, atomic on its own (no BEGIN/COMMIT round
    trips). `expressions`: column -> SQL set for every row, a template where `{t}` is the
    job table and `{v}` the VALUES list (column names double-quoted)."""
    db = router.db_for_write(Job)
    connection = connections[db]
    # Two members for one row (two deliveries of one job, say) would both see its id
    # returned: only the first is sent; the others lose, as the second of two single
    # statements would (the first one's change took the row out of `statuses`).
    first: dict[uuid.UUID, int] = {}
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, change in enumerate(changes):
        if first.setdefault(jobrows.job_uuid(change.job_id), i) == i:
            groups.setdefault(tuple(sorted(change.values)), []).append(i)
    won: set[uuid.UUID] = set()
    # Prepared on PostgreSQL: each shape's statement is planned once per connection.
    with _atomic_if(len(groups) > 1, db), hot_cursor(connection) as cursor:
        for names, members in groups.items():
            sql, params = _statement(connection, [changes[i] for i in members], names, statuses, expressions or {})
            cursor.execute(sql, params)
            won.update(jobrows.job_uuid(row[0]) for row in cursor.fetchall())
    return [first[key] == i and key in won for i, key in enumerate(jobrows.job_uuid(c.job_id) for c in changes)]


def _field(name: str) -> Field[Any, Any]:
    found = Job._meta.get_field(name)
    if not isinstance(found, Field):  # a relation's reverse side: never one of these columns
        raise TypeError(f"Job.{name} is not a column")
    return found


def _atomic_if(needed: bool, db: str) -> AbstractContextManager[Any]:
    """A transaction when `needed`; else none: one statement is atomic on its own, and
    BEGIN and COMMIT would be two more round trips."""
    return transaction.atomic(using=db) if needed else nullcontext()


# The SQL of a batch statement by its shape: the same shapes recur (a claim's, an
# outcome's, for 1 to MAX_BATCH rows), so each is built once per process.
_statements: dict[tuple[Any, ...], str] = {}


def _statement(
    connection: Any,
    changes: Sequence[RowChange],
    names: tuple[str, ...],
    statuses: Sequence[str],
    expressions: Mapping[str, str],
) -> tuple[str, list[Any]]:
    fields = [_field(name) for name in names]
    pk = _field("id")
    params: list[Any] = []
    for change in changes:
        params.append(pk.get_db_prep_save(jobrows.job_uuid(change.job_id), connection))
        params.append(change.generation)
        params.extend(f.get_db_prep_save(change.values[f.name], connection) for f in fields)
        params.append(change.lines)
    shape = (connection.alias, names, len(changes), tuple(statuses), tuple(expressions.items()))
    sql = _statements.get(shape)
    if sql is None:
        sql = _statements[shape] = _statement_sql(connection, len(changes), fields, len(statuses), expressions)
    return sql, params + [str(s) for s in statuses]


def _statement_sql(
    connection: Any, rows: int, fields: list[Field[Any, Any]], statuses: int, expressions: Mapping[str, str]
) -> str:
    qn = connection.ops.quote_name
    table = qn(Job._meta.db_table)
    pk, gen, timeline = _field("id"), _field("generation"), _field("timeline")
    typed = connection.vendor == "postgresql"  # a VALUES list's columns take their type from it

    def slot(f: Any) -> str:
        if not typed:
            return "%s"
        # Text as text: an explicit cast to varchar(n) would cut a long value silently,
        # where the single statement's assignment refuses it.
        text = f.get_internal_type() in ("CharField", "TextField")
        return f"%s::{'text' if text else f.cast_db_type(connection)}"

    row_sql = "(" + ", ".join([slot(pk), slot(gen), *(slot(f) for f in fields), slot(timeline)]) + ")"
    columns = [ID_COL, GEN_COL, *(f.column for f in fields), LINES_COL]
    sets = [f"{qn(f.column)} = {CTE}.{qn(f.column)}" for f in fields]
    sets += [f"{qn(col)} = {sql.format(t=table, v=CTE)}" for col, sql in expressions.items()]
    sets.append(f"{qn(timeline.column)} = COALESCE({table}.{qn(timeline.column)}, '') || {CTE}.{LINES_COL}")
    return (
        f"WITH {CTE} ({', '.join(qn(c) if c in {f.column for f in fields} else c for c in columns)}) AS "
        f"(VALUES {', '.join([row_sql] * rows)}) "
        f"UPDATE {table} SET {', '.join(sets)} FROM {CTE} "
        f"WHERE {table}.{qn(pk.column)} = {CTE}.{ID_COL} AND {table}.{qn(gen.column)} = {CTE}.{GEN_COL} "
        f"AND {table}.{qn('status')} IN ({', '.join(['%s'] * statuses)}) "
        f"RETURNING {table}.{qn(pk.column)}"
    )


# --- the two batches a delivery joins -------------------------------------------------------

WAITING = sorted(WAITING_STATUSES)
# What a claim sets beyond its own values (status, started_at, worker) and timeline lines:
# the same as the single statement's Coalesce and F() + 1.
CLAIM_EXPRESSIONS = {
    "admitted_at": 'COALESCE({t}."admitted_at", {v}."started_at")',
    "attempts": '{t}."attempts" + 1',
}


def _claims_flush(changes: list[RowChange]) -> list[bool]:
    won = rows_update(changes, statuses=WAITING, expressions=CLAIM_EXPRESSIONS)
    # Started jobs wait no more: one cells round trip for the batch, not one per job. The
    # claims are committed: nothing may fail the batch now (its members would run their
    # statements again and find their rows taken).
    try:
        cells.jobs_leave([c.job_id for c, ok in zip(changes, won, strict=True) if ok])
    except Exception:
        log.warning("could not update the cells of %d started job(s)", sum(won), exc_info=True)
    return won


@dataclass(frozen=True)
class Outcome:
    """A finished attempt's conditional UPDATE (on `running`), and the job as read, for
    its webhook event (written in the same transaction when the change wins)."""

    change: RowChange
    job: Job


def _outcomes_flush(items: list[Outcome]) -> list[bool]:
    db = router.db_for_write(Job)
    events = any(webhook_target(item.job) for item in items)
    with _atomic_if(events, db):
        won = rows_update([item.change for item in items], statuses=[JobStatus.RUNNING])
        for item, ok in zip(items, won, strict=True):
            if ok and webhook_target(item.job):
                finished = copy.copy(item.job)
                for name, value in item.change.values.items():
                    setattr(finished, name, value)
                event_record(finished)
    return won


def _reads_flush(keys: list[tuple[str, int]]) -> list[Job | None]:
    rows = jobrows.jobs_waiting({jobrows.job_uuid(job_id) for job_id, _ in keys})
    out: list[Job | None] = []
    given: set[uuid.UUID] = set()
    for job_id, generation in keys:
        key = jobrows.job_uuid(job_id)
        job = rows.get(key)
        if job is None or job.generation != generation:
            out.append(None)
            continue
        # Each thread gets its own instance to change (two deliveries of one job: rare).
        out.append(copy.copy(job) if key in given else job)
        given.add(key)
    return out


reads: Batcher[tuple[str, int], Job | None] = Batcher("reads", _reads_flush)
claims: Batcher[RowChange, bool] = Batcher("claims", _claims_flush)
outcomes: Batcher[Outcome, bool] = Batcher("outcomes", _outcomes_flush)


def job_waiting(*, job_id: str, generation: int) -> Job | None:
    """The row of a delivery, with its tenant and shard, if that generation still waits
    (queued or parked): its own SELECT (built once per process: fairqueue.jobs.jobrows)."""
    job = jobrows.jobs_waiting([job_id]).get(jobrows.job_uuid(job_id))
    return job if job is not None and job.generation == generation else None


def job_for_delivery(*, job_id: str, generation: int) -> Job | None:
    """`job_waiting`, read with the rows other threads read now, in one SELECT."""
    return reads.submit((job_id, generation), alone=lambda: job_waiting(job_id=job_id, generation=generation))


def job_claim(
    *, job_id: str, generation: int, worker: str, now: datetime, lines: str, arrived: Callable[[], None] | None = None
) -> bool:
    """The compare-and-set that starts a delivery: (id, generation) queued or parked ->
    running, attempts + 1, `lines` appended to the timeline; True if it won. Sent with
    the claims the process's other threads make now; alone, its own UPDATE. A job
    claimed leaves its waiting cell (fairqueue.jobs.cells)."""

    def alone() -> bool:
        won = Job.objects.filter(id=job_id, generation=generation, status__in=WAITING).update(
            status=JobStatus.RUNNING,
            started_at=now,
            admitted_at=Coalesce("admitted_at", Value(now)),
            attempts=F("attempts") + 1,
            worker=worker,
            timeline=tl.appended(lines),
        )
        if won:
            cells.jobs_leave([job_id])
        return bool(won)

    change = RowChange(
        job_id=job_id,
        generation=generation,
        values={"status": JobStatus.RUNNING, "started_at": now, "worker": worker},
        lines=lines,
    )
    return claims.submit(change, alone=alone, arrived=arrived)


def job_outcome(
    job: Job, *, fields: dict[str, Any], lines: Sequence[str], arrived: Callable[[], None] | None = None
) -> bool:
    """The compare-and-set that ends an attempt: the job's running generation gets
    `fields` (literal values) and `lines` on its timeline, with its webhook event in the
    same transaction (webhooks.outbox); True if it won. Sent with the outcomes the
    process's other threads record now; alone, `job_finish`."""
    where = {"id": str(job.id), "generation": job.generation, "status": JobStatus.RUNNING}

    def alone() -> bool:
        return job_finish(job, where=where, fields={**fields, "timeline": tl.appended(*lines)})

    change = RowChange(job_id=str(job.id), generation=job.generation, values=dict(fields), lines="".join(lines))
    return outcomes.submit(Outcome(change=change, job=job), alone=alone, arrived=arrived)
