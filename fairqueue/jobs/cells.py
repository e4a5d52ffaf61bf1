"""Cells: the waiting jobs of each (shard, class) and each (tenant, class), summarised in
Redis as jobs move, so the dashboard and /metrics read every cell's count and oldest job
in one round trip, whatever the backlog (lua/cells.lua keeps the summaries).

Cell names (opaque to the script): "c|<shard>|<class>" every waiting job of a shard and
class, "t|<tenant>|<class>" a tenant's waiting jobs, "p|<tenant>|<class>" those parked (a
count alone: no oldest job, and no sorted set of its jobs, which would cost every parked
job a third member), "q|<shard>|quarantine" the waiting jobs of the shard's quarantine
lane (fairqueue.jobs.quarantine).
The class of a job in the batch lane is BATCH_CLASS; the shard is the tenant's current
one. Waiting means `queued` or `parked`: a `scheduled` or `retrying` job is in no cell
until it is due and promoted (fairqueue.jobs.due), and it waits from its `due_at` (the
SLO age of a delayed or retried job starts when it became due; `wait_score`).

A job enters its cells when it starts to wait (accepted, promoted when due, re-delivered,
requeued, retried by an operator), before it is admitted, so no later transition can
overtake the entry; it enters its parked cell when the engine parks it and leaves that
when it is woken; it leaves every cell when it starts, is cancelled or fails before it
started. Its cells change with its class lane (a promoted batch job) or its tenant's
place (fairqueue.jobs.moves). Every update is idempotent (sorted-set membership), and
those that follow the entry ("reset", "park") do nothing to a job that left meanwhile, so
a repeated or crossed update leaves the cells right; one lost to a Redis error is put
right by `cells_audit` (the oldest jobs: a new one at the next tick, each again within
about AUDIT_RECHECK_SECONDS) or `cells_rebuild` (everything, when Redis lost its state).

Cost: each of those transitions is one more Redis round trip (an EVALSHA of a small
script, all the jobs of one call in it), beside the engine call it follows.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis

from fairqueue.engine.scripts import LUA_DIR
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.runtime import redis_client
from tenants.policy import PolicySnapshot, policy_snapshot

log = logging.getLogger("fairqueue.jobs.cells")

BATCH_CLASS = "batch"  # pseudo-class of the batch lane
PREFIX = "fq:{cells}:"
SUMMARY_KEY = PREFIX + "summary"
OF_KEY = PREFIX + "of"
BUILT_KEY = PREFIX + "built"  # set once the cells were built from the database
# Bumped by every script call that changes the summary, with an epoch that changes when
# the count starts afresh: (epoch, version) equal means the summary is as it was. The
# changes log scores each cell by the version of its last change (lua/cells.lua).
VERSION_KEY = PREFIX + "version"
EPOCH_KEY = PREFIX + "epoch"
CHANGES_KEY = PREFIX + "changes"
TRIMMED_KEY = PREFIX + "trimmed"  # the newest version that left the changes log
OPS_PER_CALL = 500
AUDIT_OLDEST = 5  # members of each shard cell checked against the database per audit
# The tick's audit (incremental) checks a head job when it becomes one, then again about
# this often (spread: each check picks its next time between half and one and a half of
# it), not every head every tick: a steady backlog's heads cost no query most ticks.
AUDIT_RECHECK_SECONDS = 10.0
REBUILD_CHUNK = 5000

SOURCE = (LUA_DIR / "cells.lua").read_text()
_SHA = hashlib.sha1(SOURCE.encode()).hexdigest()


def shard_cell(shard: str, latency_class: str) -> str:
    return f"c|{shard}|{latency_class}"


def tenant_cell(slug: str, latency_class: str) -> str:
    return f"t|{slug}|{latency_class}"


def parked_cell(slug: str, latency_class: str) -> str:
    return f"p|{slug}|{latency_class}"


QUARANTINE_CLASS = "quarantine"  # the lane's cells' third part (every cell name has three)


def quarantine_cell(shard: str) -> str:
    return f"q|{shard}|{QUARANTINE_CLASS}"


def job_class(job: Job) -> str:
    return BATCH_CLASS if job.in_batch_lane else job.latency_class


def wait_score(job: Job) -> str:
    """When the job started to wait, as the SLO age counts it: its due time for a delayed
    or retried job, else its submit time (as fairqueue.jobs.due and recovery order them)."""
    return f"{(job.due_at or job.submitted_at).timestamp():.6f}"


def _set_op(job: Job, policy: PolicySnapshot, *, parked: bool, op: str = "set") -> list[Any] | None:
    tp = policy.tenants.get(job.tenant.slug)
    if tp is None:
        return None
    cls = job_class(job)
    cells = [shard_cell(tp.shard, cls), tenant_cell(tp.slug, cls)]
    if parked:
        cells.append(parked_cell(tp.slug, cls))
    if job.quarantined:
        cells.append(quarantine_cell(tp.shard))
    return [op, str(job.id), wait_score(job), len(cells), *cells]


def _commands(ops: Sequence[list[Any]]) -> list[list[Any]]:
    """The EVALSHA commands that apply `ops`, OPS_PER_CALL to a call."""
    return [
        ["EVALSHA", _SHA, 1, PREFIX, *(a for op in ops[i : i + OPS_PER_CALL] for a in op)]
        for i in range(0, len(ops), OPS_PER_CALL)
    ]


def _apply(ops: Sequence[list[Any]]) -> None:
    """Send the operations, OPS_PER_CALL to a script call, all in one pipelined round trip."""
    if not ops:
        return
    client = redis_client()
    commands = _commands(ops)
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    results = pipe.execute(raise_on_error=False)
    if any(isinstance(r, redis.exceptions.NoScriptError) for r in results):
        client.script_load(SOURCE)
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        results = pipe.execute(raise_on_error=False)
    for r in results:
        if isinstance(r, Exception):
            raise r


@dataclass(frozen=True)
class Entry:
    """Jobs entering their cells in the round trip of their admission
    (fairqueue.jobs.dispatch: the engine's `admit_many_after`)."""

    ops: list[list[Any]]
    commands: list[list[Any]]


def entry_prepare(jobs: Iterable[Job], *, policy: PolicySnapshot) -> Entry:
    """The commands that place `jobs` (as `jobs_place`), to send before their admission."""
    ops = [op for job in jobs if (op := _set_op(job, policy, parked=False)) is not None]
    return Entry(ops=ops, commands=_commands(ops))


def entry_done(entry: Entry, replies: Sequence[Any]) -> None:
    """Check the replies of an entry sent with the admission; if one failed (the script not
    loaded on this server yet, after a restart), place the jobs on their own now, before
    the admitted ones are published (a parked one woken and started by another process in
    between would be counted again until the audit finds it: a window once per restart)."""
    if any(isinstance(r, Exception) for r in replies):
        _safely("place", entry.ops)


@dataclass(frozen=True)
class Check:
    """A check lua/cells.lua decides before a call's entries, all or none: "quota" (the jobs
    waiting in `cells` plus `n` stay within `limit`), "guard" (the same against the memory
    guard's cap; `limit` "1" exempts the jobs) or "rate" (`limit` jobs/s, a bucket of `burst`)."""

    check: str
    name: str
    n: int
    limit: float
    cells: tuple[str, ...] = ()
    burst: int = 0

    def args(self) -> list[Any]:
        if self.check == "rate":
            return ["rate", self.name, self.n, repr(float(self.limit)), self.burst]
        return [self.check, self.name, self.n, int(self.limit), len(self.cells), *self.cells]


@dataclass(frozen=True)
class Refusal:
    """A check that failed: for "quota" and "guard" the jobs counted and the cap; for
    "rate" the seconds until the bucket holds enough tokens (`count`)."""

    check: str
    name: str
    count: float
    cap: int


def tenant_cells(slug: str, classes: Iterable[str]) -> tuple[str, ...]:
    """The cells of a tenant's waiting jobs in these classes."""
    return tuple(tenant_cell(slug, c) for c in sorted(set(classes)))


def jobs_enter_checked(jobs: Sequence[Job], *, policy: PolicySnapshot, checks: Sequence[Check]) -> Refusal | None:
    """The jobs start to wait (as `entry_prepare`'s entries; their rows are not written yet,
    but their submit time is set), in one script call with `checks` first: when one fails,
    nothing is entered and its refusal is returned. The count and the entry are one atomic step, so two
    requests at once cannot both pass a quota that has room for one. Redis errors raise."""
    ops: list[Any] = [a for c in checks for a in c.args()]
    for job in jobs:
        tp = policy.tenants.get(job.tenant.slug)
        if tp is None:
            continue
        cls = job_class(job)
        ops += ["set", str(job.id), wait_score(job), 2, shard_cell(tp.shard, cls), tenant_cell(tp.slug, cls)]
    client = redis_client()
    command = ["EVALSHA", _SHA, 1, PREFIX, *ops]
    try:
        reply = client.execute_command(*command)
    except redis.exceptions.NoScriptError:
        client.script_load(SOURCE)
        reply = client.execute_command(*command)
    if not isinstance(reply, list):
        return None
    what, name, count, cap = ([*(_text(v) for v in reply), "0"])[:4]
    return Refusal(what, name, float(count), int(float(cap)))


def cells_count(names: Sequence[str]) -> dict[str, int]:
    """The waiting count of each cell named (one HMGET of the summary)."""
    if not names:
        return {}
    raw = redis_client().hmget(SUMMARY_KEY, list(names))
    return {n: int(_text(v).split(" ", 1)[0]) if v is not None else 0 for n, v in zip(names, raw, strict=True)}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _safely(what: str, ops: Sequence[list[Any]]) -> None:
    # A cell update never fails the transition it follows: the audit or the rebuild puts
    # the cells right.
    try:
        _apply(ops)
    except redis.RedisError:
        log.warning("could not update the cells (%s) of %d job(s)", what, len(ops), exc_info=True)


def jobs_place(jobs: Iterable[Job], *, policy: PolicySnapshot | None = None, parked: bool = False) -> None:
    """The jobs start to wait (parked or not) in the cells of their tenant, shard and class
    now; call it before the admission, so nothing that follows can overtake it."""
    policy = policy or policy_snapshot()
    ops = [op for job in jobs if (op := _set_op(job, policy, parked=parked)) is not None]
    _safely("place", ops)


def jobs_replace(jobs: Iterable[Job], *, policy: PolicySnapshot | None = None) -> None:
    """The jobs, if they still wait, wait in the cells of their tenant's place, lane and
    status now (a move, a promotion out of the batch lane); those that left stay out."""
    policy = policy or policy_snapshot()
    ops = [
        op
        for job in jobs
        if (op := _set_op(job, policy, parked=job.status == JobStatus.PARKED, op="reset")) is not None
    ]
    _safely("replace", ops)


def jobs_park(jobs: Iterable[Job], *, policy: PolicySnapshot | None = None) -> None:
    """The engine parked the jobs: they are counted parked too, unless they left already
    (woken and started by another process in between)."""
    policy = policy or policy_snapshot()
    ops: list[list[Any]] = []
    for job in jobs:
        tp = policy.tenants.get(job.tenant.slug)
        if tp is not None:
            ops.append(["park", str(job.id), wait_score(job), parked_cell(tp.slug, job_class(job))])
    _safely("park", ops)


def jobs_unpark(job_ids: Iterable[str]) -> None:
    """The jobs (row ids) are no longer parked; they still wait."""
    _safely("unpark", [["unpark", str(i)] for i in job_ids])


def jobs_leave(job_ids: Iterable[str]) -> None:
    """The jobs (row ids) wait no more: started, cancelled, failed."""
    _safely("leave", [["del", str(i)] for i in job_ids])


_serials: Iterator[int] = itertools.count()  # CellsView.serial


class Cell(NamedTuple):
    # A tuple, not a dataclass: cells_parse makes one per cell, twenty thousand a second
    # at ten thousand tenants, and a frozen dataclass's constructor costs three times more.
    waiting: int
    oldest_ts: float | None


@dataclass(frozen=True)
class CellsView:
    cells: dict[str, Cell] = field(default_factory=dict)
    # Tenant -> class -> cell, of its waiting ("t") and parked ("p") cells that hold a job:
    # a tenant with nothing waiting is absent (names are slugs: no "|").
    tenants: dict[str, dict[str, dict[str, Cell]]] = field(default_factory=dict)
    raw: dict[str, str] = field(default_factory=dict)  # the summary as read (see cells_parse)
    at: tuple[str, int] | None = None  # (epoch, version) it is as of, when known (cells_refresh)
    serial: int = field(default_factory=lambda: next(_serials))
    # The view this one was made from, by serial, and the (kind, tenant) pairs whose
    # class dicts differ from that view's; None: made from nothing.
    based_on: int | None = None
    changed: frozenset[tuple[str, str]] | None = None

    def get(self, name: str) -> Cell:
        return self.cells.get(name, _EMPTY)

    def of_tenants(self, kind: str) -> dict[str, dict[str, Cell]]:
        """Tenant -> class -> cell for the cells of `kind` ("t" waiting, "p" parked)."""
        return self.tenants.get(kind, {})


_EMPTY = Cell(0, None)


def _cell(value: str) -> Cell:
    n, _, oldest = value.partition(" ")
    return Cell(int(n), float(oldest) if oldest else None)


def cells_parse(raw: dict[str, str], previous: CellsView | None = None) -> CellsView:
    """The summary hash (HGETALL SUMMARY_KEY: cell -> "<count> <oldest score>") as cells,
    in one pass (ten thousand tenants' cells each second).

    With `previous` (the view of an earlier read), only the fields whose text changed are
    parsed; the rest, and the class dicts of every tenant none of whose cells changed, are
    `previous`'s own objects (a reader may compare them by identity). `previous` itself is
    left as it was."""
    if previous is not None and previous.raw:
        changed = raw.items() - previous.raw.items()  # (name, value) pairs new or different
        return _cells_update(previous, raw, changed, previous.raw.keys() - raw.keys(), at=None)
    out: dict[str, Cell] = {}
    tenants: dict[str, dict[str, dict[str, Cell]]] = {"t": {}, "p": {}}
    for name, value in raw.items():
        n, _, oldest = value.partition(" ")
        cell = out[name] = Cell(int(n), float(oldest) if oldest else None)
        kind, owner, cls = name.split("|", 2)
        by_tenant = tenants.get(kind)
        if by_tenant is not None:
            of_tenant = by_tenant.get(owner)
            if of_tenant is None:
                by_tenant[owner] = {cls: cell}
            else:
                of_tenant[cls] = cell
    return CellsView(out, tenants, raw)


def _cells_update(
    previous: CellsView,
    raw: dict[str, str],
    changed: Iterable[tuple[str, str]],
    gone: Iterable[str],
    *,
    at: tuple[str, int] | None,
) -> CellsView:
    out = dict(previous.cells)
    tenants = {kind: dict(by_tenant) for kind, by_tenant in previous.tenants.items()}
    copied: set[tuple[str, str]] = set()  # (kind, tenant) whose class dict is already a copy
    updates: list[tuple[str, Cell | None]] = [(name, _cell(value)) for name, value in changed]
    updates += [(name, None) for name in gone]
    for name, cell in updates:
        if cell is None:
            out.pop(name, None)
        else:
            out[name] = cell
        kind, owner, cls = name.split("|", 2)
        by_tenant = tenants.get(kind)
        if by_tenant is None:
            continue
        if (kind, owner) in copied:
            of_tenant = by_tenant[owner]
        else:  # previous's dict stays as it was
            copied.add((kind, owner))
            of_tenant = by_tenant[owner] = dict(by_tenant.get(owner) or {})
        if cell is None:
            of_tenant.pop(cls, None)
        else:
            of_tenant[cls] = cell
    for kind, owner in copied:
        if not tenants[kind][owner]:
            del tenants[kind][owner]
    return CellsView(out, tenants, raw, at, based_on=previous.serial, changed=frozenset(copied))


def cells_refresh(previous: CellsView | None = None) -> CellsView:
    """The cells now, read and parsed only as far as they changed since `previous` (a view
    this function returned earlier, from any process's changes): one round trip when
    nothing changed (the version), three when some cells did (the version, the changes
    log since `previous`'s version, those cells), else one more read of the whole summary."""
    client = redis_client()
    epoch, version, trimmed = client.mget(EPOCH_KEY, VERSION_KEY, TRIMMED_KEY)  # type: ignore[misc]  # sync client
    at = (str(epoch), int(version)) if epoch is not None and version is not None else None
    kept = previous.at if previous is not None else None
    if at is None or kept is None or previous is None or kept[0] != at[0] or kept[1] < int(trimmed or 0):
        raw: dict[str, str] = client.hgetall(SUMMARY_KEY)  # type: ignore[assignment]  # a text-mode client
        view = cells_parse(raw, previous)
        return CellsView(view.cells, view.tenants, raw, at, based_on=view.based_on, changed=view.changed)
    if kept[1] == at[1]:
        return previous
    # Cells changed after `kept` score above it (a change after `at` may be read too: it is
    # read again next time, since the view is kept as of `at`).
    names: list[str] = client.zrangebyscore(CHANGES_KEY, f"({kept[1]}", "+inf")  # type: ignore[assignment]
    values: list[str | None] = client.hmget(SUMMARY_KEY, names) if names else []  # type: ignore[assignment]
    raw = dict(previous.raw)
    changed: list[tuple[str, str]] = []
    gone: list[str] = []
    for name, value in zip(names, values, strict=True):
        if value is None:
            if raw.pop(name, None) is not None:
                gone.append(name)
        elif raw.get(name) != value:
            raw[name] = value
            changed.append((name, value))
    return _cells_update(previous, raw, changed, gone, at=at)


def cells_read() -> CellsView:
    raw: dict[str, str] = redis_client().hgetall(SUMMARY_KEY)  # type: ignore[assignment]  # a text-mode client
    return cells_parse(raw)


def cells_rebuild() -> int:
    """Build every cell from the database's waiting rows (after Redis lost them); returns
    how many jobs were placed. O(waiting): for recovery, never a per-second path."""
    client = redis_client()
    stale = list(client.scan_iter(match=PREFIX + "*", count=1000))
    if stale:
        client.delete(*stale)
    policy = policy_snapshot()
    placed = 0
    waiting = Job.objects.select_related("tenant").filter(status__in=[JobStatus.QUEUED, JobStatus.PARKED])
    ops: list[list[Any]] = []
    for job in waiting.order_by("id").iterator(chunk_size=REBUILD_CHUNK):
        op = _set_op(job, policy, parked=job.status == JobStatus.PARKED)
        if op is not None:
            ops.append(op)
        if len(ops) >= REBUILD_CHUNK:
            _apply(ops)
            placed += len(ops)
            ops = []
    _apply(ops)
    placed += len(ops)
    client.set(BUILT_KEY, "1")
    return placed


def cells_ensure() -> int:
    """Rebuild the cells if Redis has none built (a new or a flushed Redis): -1 if they
    were there, else how many jobs were placed."""
    if redis_client().exists(BUILT_KEY):
        return -1
    return cells_rebuild()


_audit_next: dict[str, float] = {}  # head job id -> when (monotonic) the incremental audit checks it again


def cells_audit(*, policy: PolicySnapshot | None = None, incremental: bool = False) -> int:
    """Check the oldest AUDIT_OLDEST jobs of every shard cell against the database and
    take out those that wait no more (an update lost to an error): the oldest age shown
    is then right within a tick. One pipelined read, one query; returns jobs removed.

    `incremental` (the tick): only the heads not checked yet or due again (see
    AUDIT_RECHECK_SECONDS), so a lost update at a head that was already checked shows
    within that time rather than a tick; no query when none is due."""
    policy = policy or policy_snapshot()
    classes = [*policy.classes, BATCH_CLASS]
    names = [shard_cell(s, c) for s in policy.shards for c in classes]
    pipe = redis_client().pipeline(transaction=False)
    for name in names:
        pipe.zrange(PREFIX + "z:" + name, 0, AUDIT_OLDEST - 1)
    ids = {i for members in pipe.execute() for i in members}
    now = time.monotonic()
    if incremental:
        for job_id in [i for i in _audit_next if i not in ids]:
            del _audit_next[job_id]  # no longer a head: checked again if it becomes one
        checking = {i for i in ids if _audit_next.get(i, now) <= now}
    else:
        checking = ids
    if not checking:
        return 0
    still = {
        str(i)
        for i in Job.objects.filter(id__in=list(checking), status__in=[JobStatus.QUEUED, JobStatus.PARKED]).values_list(
            "id", flat=True
        )
    }
    gone = sorted(checking - still)
    jobs_leave(gone)
    if incremental:
        for job_id in still:
            _audit_next[job_id] = now + AUDIT_RECHECK_SECONDS * random.uniform(0.5, 1.5)
    return len(gone)
