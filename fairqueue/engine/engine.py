"""Sync and asyncio front ends of the throttle engine.

Both build the same ``ops.Call`` objects (validation, encoding and decoding live in
``ops``) and differ only in how they send them: one FCALL per operation, one pipelined
round trip for ``admit_many`` and ``sweep``. A server without our Functions library gets
it loaded on the first "function not found" and the call is retried once.

``Engine`` also takes a ``redis.cluster.RedisCluster`` (``cluster.connect`` picks one by
itself): each call goes to the primary of its tag's slot, and pipelines are split per node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis.asyncio
from redis.cluster import RedisCluster
from redis.exceptions import ResponseError

from . import ops
from .cluster import Client, node_client, node_clients, server_identity
from .keys import READY_FIELD, SPEC_PREFIX, STAMP_FIELD, key_name, tag_keys, validate_prefix
from .results import (
    Admission,
    AdmitRequest,
    CancelResult,
    JobState,
    KeysArg,
    KeyState,
    ReclaimResult,
    ReleaseResult,
    TagHealth,
    Woken,
)
from .scripts import function_name, is_already_loaded, is_missing_function, library

T = TypeVar("T")

#: ``INFO`` sections that name a server's process and replication history.
IDENTITY_SECTIONS = ("server", "replication")
COUNTS_MEMO_SIZE = 1024  # key lists and replies remembered by counts (then all forgotten at once)
COUNTS_MEMO_MIN_KEYS = 64  # shorter key lists are checked on every call (it costs little)
#: Jobs admitted by one call of ``admit_many``: Redis runs nothing else while a function
#: runs, so this bounds how long a bulk holds the server at a time.
ADMITS_PER_CALL = 250


def fcall_args(call: ops.Call[Any]) -> tuple[Any, ...]:
    """Arguments of ``FCALL`` for one call (the function, numkeys, KEYS, ARGV): the engines
    send them, the benchmark pipelines them raw."""
    return (function_name(call.script), len(call.keys), *call.keys, *call.args)


def _expire_now(pipe: Any, prefix: str, tag: str, job_id: str) -> None:
    # The lease and the "earliest expiry" hint move together, as every script keeps them.
    pipe.zadd(key_name(prefix, tag, "leases"), {job_id: 0}, xx=True, ch=True)
    pipe.hset(key_name(prefix, tag, "state"), "\1due", 0)


def _collect(pending: list[int], results: list[Any], raws: list[Any], *, last: bool) -> list[int]:
    """Store the replies of a pipelined batch; return the indexes to retry (library missing)."""
    missing = []
    for i, r in zip(pending, results, strict=True):
        if isinstance(r, ResponseError) and is_missing_function(r) and not last:
            missing.append(i)
        elif isinstance(r, Exception):
            raise r
        else:
            raws[i] = r
    return missing


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _is_redirect(error: ResponseError) -> bool:
    """A cluster node says another one now holds the slot (after a failover or a reshard)."""
    return str(error).startswith(("MOVED", "ASK"))


def _health(raw: Any, identity: str) -> TagHealth:
    ready, stamp = raw
    if not ready:
        return TagHealth.NOT_READY
    return TagHealth.READY if stamp is not None and _text(stamp) == identity else TagHealth.FOREIGN


class _Base:
    """Builds calls; subclasses send them."""

    def __init__(self, prefix: str = "fq") -> None:
        validate_prefix(prefix)
        self.prefix = prefix
        # ``counts`` calls that ask for the very same list of keys again (a periodic read of
        # thousands of keys): the checked names, and the last reply with its decoding.
        self._counts_memo: dict[tuple[str, int], tuple[Sequence[str], str, list[str]]] = {}
        self._decoded: dict[tuple[str, int], tuple[list[str], list[Any], dict[str, int]]] = {}

    def _admit(
        self,
        tag: str,
        job_id: str,
        keys: KeysArg,
        priority: int,
        lease_seconds: float,
        data: str,
        require_ready: bool,
    ) -> ops.Call[Admission]:
        return ops.admit(
            self.prefix,
            tag=tag,
            job_id=job_id,
            keys=keys,
            priority=priority,
            lease_seconds=lease_seconds,
            data=data,
            require_ready=require_ready,
        )

    def _admit_calls(
        self, items: Iterable[AdmitRequest], require_ready: bool
    ) -> tuple[list[ops.Call[list[Admission]]], list[list[int]]]:
        """The admits as one call per tag (``ops.admit_batch``, at most ADMITS_PER_CALL jobs
        each), and for each call the indexes of its items. A tag's jobs keep their order
        (calls on other tags touch none of its state, so their order does not matter); jobs
        alike in a row share one encoded shape, computed once per keys object."""
        shapes: dict[tuple[int, int, float, bool], ops.Shape] = {}
        by_tag: dict[str, tuple[list[ops.Run], list[int]]] = {}
        calls: list[ops.Call[list[Admission]]] = []
        indexes: list[list[int]] = []

        def flush(tag: str) -> None:
            runs, where = by_tag.pop(tag)
            calls.append(ops.admit_batch(self.prefix, tag=tag, runs=runs))
            indexes.append(where)

        # A list, so every item (and its keys object, named by id below) lives until the end.
        for n, item in enumerate(list(items)):
            ready = require_ready or item.require_ready
            # Keyed by the keys object's identity: the items hold it for this whole call, so
            # its id names no other object meanwhile (jobs alike share one, as dispatch does).
            memo = (id(item.keys), item.priority, item.lease_seconds, ready)
            shape = shapes.get(memo)
            if shape is None:
                shape = shapes[memo] = ops.admit_shape(
                    item.keys, priority=item.priority, lease_seconds=item.lease_seconds, require_ready=ready
                )
            runs, where = by_tag.setdefault(item.tag, ([], []))
            if runs and runs[-1][0] == shape:
                runs[-1][1].append((item.job_id, item.data))
            else:
                runs.append((shape, [(item.job_id, item.data)]))
            where.append(n)
            if len(where) >= ADMITS_PER_CALL:
                flush(item.tag)
        for tag in list(by_tag):
            flush(tag)
        return calls, indexes

    @staticmethod
    def _admissions(indexes: list[list[int]], batches: list[list[Admission]]) -> list[Admission]:
        """The admissions of ``_admit_calls``'s calls back in the items' order."""
        out: list[Admission | None] = [None] * sum(len(where) for where in indexes)
        for where, batch in zip(indexes, batches, strict=True):
            for n, admission in zip(where, batch, strict=True):
                out[n] = admission
        return [a for a in out if a is not None]

    def _sweep_calls(
        self, tags: Iterable[str], max_jobs_per_tag: int
    ) -> tuple[list[str], list[ops.Call[ReclaimResult]]]:
        tag_list = list(dict.fromkeys(tags))
        return tag_list, [ops.reclaim(self.prefix, tag=t, max_jobs=max_jobs_per_tag) for t in tag_list]

    def _counts_args(self, tag: str, keys: Sequence[str]) -> tuple[str, list[str]]:
        found = self._counts_memo.get((tag, id(keys)))
        if found is not None and found[0] is keys:
            return found[1], found[2]
        names = [ops._check_key_name(k) for k in keys]
        name = key_name(self.prefix, tag, "state")
        if len(names) >= COUNTS_MEMO_MIN_KEYS:
            if len(self._counts_memo) >= COUNTS_MEMO_SIZE:
                self._counts_memo.clear()
            # The entry holds `keys`, so its id is not reused while it lives. A list changed
            # in place would be read with its old names: callers pass a new list for new keys.
            self._counts_memo[(tag, id(keys))] = (keys, name, names)
        return name, names

    @staticmethod
    def _counts_decode(names: Sequence[str], raw: Sequence[Any]) -> dict[str, int]:
        return {n: int(v) if v is not None else 0 for n, v in zip(names, raw, strict=True)}


class Engine(_Base):
    """Blocking API (Celery workers, management commands). Thread-safe like its client,
    which may be a plain ``redis.Redis`` or a ``redis.cluster.RedisCluster``."""

    def __init__(self, client: Client, prefix: str = "fq") -> None:
        super().__init__(prefix)
        self.client = client

    def _load(self, server: Any = None) -> None:
        """Load the library where a call found it missing: on ``server`` if given, else on
        the client's server, or on every primary of a cluster (one by one: a primary that
        has it already must not stop the others from getting it)."""
        if server is None and isinstance(self.client, RedisCluster):
            cluster: Any = self.client  # redis-py leaves get_primaries untyped
            for node in cluster.get_primaries():
                self._load_on(node.redis_connection)
        else:
            self._load_on(self.client if server is None else server)

    @staticmethod
    def _load_on(server: Any) -> None:
        try:
            server.function_load(library().source)
        except ResponseError as e:
            if not is_already_loaded(e):
                raise

    def _run(self, call: ops.Call[T], server: Any = None) -> T:
        """Send one call, through the client or straight to ``server`` (a node's client)."""
        client = self.client if server is None else server
        args = fcall_args(call)
        try:
            raw = client.fcall(*args)
        except ResponseError as e:
            if not is_missing_function(e):
                raise
            self._load(server)
            raw = client.fcall(*args)
        return call.decode(raw)

    def _on_server(self, tag: str, action: Callable[[Any], T]) -> T:
        """Run ``action`` with a client of the one server that holds ``tag`` (so what it
        reads and writes there is about that server); once more if the slot just moved."""
        state = key_name(self.prefix, tag, "state")
        for attempt in range(2):
            try:
                return action(node_client(self.client, state))
            except ResponseError as e:
                if attempt or not _is_redirect(e) or not isinstance(self.client, RedisCluster):
                    raise
                self.client.nodes_manager.initialize()
        raise AssertionError("unreachable")

    def _run_many(self, calls: Sequence[ops.Call[T]]) -> list[T]:
        return self._run_many_after(calls, ())[1]

    def _run_many_after(
        self, calls: Sequence[ops.Call[T]], before: Sequence[Sequence[Any]]
    ) -> tuple[list[Any], list[T]]:
        """The calls pipelined in one round trip, after the caller's `before` commands (sent
        once, first; their replies, errors included, returned as they came)."""
        if not calls and not before:
            return [], []
        pending = list(range(len(calls)))
        raws: list[Any] = [None] * len(calls)
        head: list[Any] = []
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            sent = before if attempt == 0 else ()
            for command in sent:
                pipe.execute_command(*command)
            for i in pending:
                pipe.fcall(*fcall_args(calls[i]))
            results = pipe.execute(raise_on_error=False)
            if attempt == 0:
                head, results = list(results[: len(sent)]), results[len(sent) :]
            pending = _collect(pending, results, raws, last=attempt == 1)
            if not pending:
                break
            self._load()
        return head, [c.decode(r) for c, r in zip(calls, raws, strict=True)]

    def admit(
        self,
        *,
        tag: str,
        job_id: str,
        keys: KeysArg,
        priority: int = 0,
        lease_seconds: float,
        data: str = "",
        require_ready: bool = False,
    ) -> Admission:
        """Admit a job on all its keys, or park it on the first full one (one round trip).

        A parked job waits by priority, then in fair order across the flows waiting on
        that key (``KeyLimit(name, limit, flow, weight)``; the default flow ``""`` at weight
        1 for plain ``{name: limit}``), FIFO within its flow (docs/engine.md). A key's
        ``reserve`` keeps slots for jobs within their ``guarantee`` on their ``guard`` key,
        which also wait first (docs/engine.md, "Reserves and guarantees")."""
        return self._run(self._admit(tag, job_id, keys, priority, lease_seconds, data, require_ready))

    def admit_many(self, items: Iterable[AdmitRequest], *, require_ready: bool = False) -> list[Admission]:
        """Bulk submit: the admits of each tag in one call (up to ADMITS_PER_CALL), all calls
        pipelined in one round trip; each job admitted exactly as its own ``admit`` would
        be, in order within its tag (lua/admit_jobs.lua)."""
        return self.admit_many_after((), items, require_ready=require_ready)[1]

    def admit_many_after(
        self, before: Sequence[Sequence[Any]], items: Iterable[AdmitRequest], *, require_ready: bool = False
    ) -> tuple[list[Any], list[Admission]]:
        """``admit_many``, with the caller's own commands (argument lists, opaque to the
        engine) sent first in the same round trip: bookkeeping of its own that must reach
        Redis before the admissions and should cost no round trip of its own. Returns their
        replies as they came (an error is a value, not raised: the admissions stand either
        way) and the admissions. On a Redis Cluster, commands on other nodes than an
        admission's are not ordered with it."""
        calls, indexes = self._admit_calls(items, require_ready)
        replies, batches = self._run_many_after(calls, before)
        return replies, self._admissions(indexes, batches)

    def release(self, *, tag: str, job_id: str, keys: Iterable[str] | None = None) -> ReleaseResult:
        """Free the job's keys; the woken jobs returned must be dispatched by the caller.

        ``keys``, the names the job was admitted with, is an optional hint that saves the
        script a read; a wrong hint is ignored, never trusted."""
        return self._run(ops.release(self.prefix, tag=tag, job_id=job_id, keys=keys))

    def renew(self, *, tag: str, job_id: str, lease_seconds: float) -> bool:
        """Heartbeat. False means the hold is gone (reclaimed, expired or never admitted)."""
        return self._run(ops.renew(self.prefix, tag=tag, job_id=job_id, lease_seconds=lease_seconds))

    def cancel(self, *, tag: str, job_id: str) -> CancelResult:
        """Withdraw a parked job, handing on the keys it held while parked."""
        return self._run(ops.cancel(self.prefix, tag=tag, job_id=job_id))

    def reclaim(self, *, tag: str, max_jobs: int = 100) -> ReclaimResult:
        """Release up to ``max_jobs`` jobs whose lease ran out; re-deliver the reclaimed."""
        return self._run(ops.reclaim(self.prefix, tag=tag, max_jobs=max_jobs))

    def sweep(self, tags: Iterable[str], max_jobs_per_tag: int = 100) -> dict[str, ReclaimResult]:
        """Reclaim across many tags in one pipelined round trip."""
        tag_list, calls = self._sweep_calls(tags, max_jobs_per_tag)
        return dict(zip(tag_list, self._run_many(calls), strict=True))

    def set_limits(self, *, tag: str, limits: KeysArg, require_ready: bool = False) -> list[Woken]:
        """Store limits now (an operator change); a raised limit wakes waiters at once.
        Each key's reserve is set with its limit (``KeyLimit(name, limit, reserve=r)``; 0
        for ``{name: limit}``), and a lowered one wakes waiters at once too. With
        ``require_ready`` a tag not ready (see ``init_tag``) is left untouched."""
        return self._run(ops.set_limits(self.prefix, tag=tag, limits=limits, require_ready=require_ready))

    def inspect_key(self, *, tag: str, key: str, holders: bool = True) -> KeyState:
        """Limit, holders and waiters per priority of one key. Listing the holders scans
        the tag's jobs (O(state)); ``holders=False`` skips it (``held`` still counts them)."""
        return self._run(ops.inspect_key(self.prefix, tag=tag, key=key, holders=holders))

    def inspect_job(self, *, tag: str, job_id: str) -> JobState:
        """Status, held keys, parked key and position of one job."""
        return self._run(ops.inspect_job(self.prefix, tag=tag, job_id=job_id))

    def counts(self, *, tag: str, keys: Sequence[str]) -> dict[str, int]:
        """Holders per key with one HMGET (cheap, for metrics)."""
        name, names = self._counts_args(tag, keys)
        if not names:
            return {}
        return self._counts_decode(names, self.client.hmget(name, names))

    def counts_many(self, requests: dict[str, Sequence[str]]) -> dict[str, dict[str, int]]:
        """``counts`` for many tags (tag -> key names) in one pipelined round trip."""
        asked = [(tag, *self._counts_args(tag, keys)) for tag, keys in requests.items() if keys]
        if not asked:
            return {tag: {} for tag in requests}
        pipe = self.client.pipeline(transaction=False)
        for _, name, names in asked:
            pipe.hmget(name, names)
        raws = pipe.execute()
        out: dict[str, dict[str, int]] = {tag: {} for tag in requests}
        for (tag, _, names), raw in zip(asked, raws, strict=True):
            if len(names) < COUNTS_MEMO_MIN_KEYS:
                out[tag] = self._counts_decode(names, raw)
                continue
            last = self._decoded.get((tag, id(names)))
            if last is not None and last[0] is names and last[1] == raw:
                decoded = last[2]  # the same reply to the same names: most counts stay put
            else:
                decoded = self._counts_decode(names, raw)
                if len(self._decoded) >= COUNTS_MEMO_SIZE:
                    self._decoded.clear()
                self._decoded[(tag, id(names))] = (names, raw, decoded)
            out[tag] = dict(decoded)
        return out

    def set_limits_many(self, limits: dict[str, KeysArg], *, require_ready: bool = False) -> dict[str, list[Woken]]:
        """``set_limits`` for many tags (tag -> limits, with their reserves) in one pipelined
        round trip, each call atomic on its own tag."""
        tags = list(limits)
        calls = [ops.set_limits(self.prefix, tag=t, limits=limits[t], require_ready=require_ready) for t in tags]
        return dict(zip(tags, self._run_many(calls), strict=True))

    def init_tag(self, *, tag: str) -> bool:
        """Mark a tag ready (idempotent): its state is complete. True if this call did it.

        ``require_ready`` admits store nothing on a tag that is not ready, which is what keeps
        a newcomer out of a tag whose state Redis lost until the caller has rebuilt it.
        The tag is also stamped with the identity of the server that holds it (see
        ``tags_health``), before it is marked: a ready tag always carries a stamp."""

        def mark(server: Any) -> bool:
            identity = server_identity(server.info(*IDENTITY_SECTIONS))
            server.hset(key_name(self.prefix, tag, "state"), STAMP_FIELD, identity)
            return self._run(ops.init_tag(self.prefix, tag=tag), server)

        return self._on_server(tag, mark)

    def tags_health(self, tags: Iterable[str]) -> dict[str, TagHealth]:
        """Whether each tag's state can be trusted (``TagHealth``): one pipelined round trip
        per server, reading the server's identity and each tag's ready mark and stamp
        together. A tag whose server could not answer (down, or its slot just moved) is
        left out: ask again later."""
        by_state = {key_name(self.prefix, tag, "state"): tag for tag in dict.fromkeys(tags)}
        health: dict[str, TagHealth] = {}
        for server, states in node_clients(self.client, by_state).items():
            pipe = server.pipeline(transaction=False)
            pipe.info(*IDENTITY_SECTIONS)
            for state in states:
                pipe.hmget(state, [READY_FIELD, STAMP_FIELD])
            try:
                info, *raws = pipe.execute(raise_on_error=False)
            except redis.RedisError:
                continue
            if isinstance(info, Exception):
                continue
            identity = server_identity(info)
            for state, raw in zip(states, raws, strict=True):
                if not isinstance(raw, Exception):
                    health[by_state[state]] = _health(raw, identity)
        if len(health) < len(by_state) and isinstance(self.client, RedisCluster):
            # A server that did not answer, or answered MOVED: the slot map is stale (a
            # failover). Ask the cluster for the current one, for the next call.
            with contextlib.suppress(redis.RedisError):
                self.client.nodes_manager.initialize()
        return health

    def known_jobs(self, *, tag: str) -> dict[str, str]:
        """Every job the tag knows: job id -> "admitted" (holding all its keys, with a lease)
        or "parked". O(state), read in batches: for audits and recovery, never a hot path."""
        state, leases = key_name(self.prefix, tag, "state"), key_name(self.prefix, tag, "leases")
        fields = (f for f, _ in self.client.hscan_iter(state, match=f"{SPEC_PREFIX}*", count=1000))
        known = dict.fromkeys((_text(f)[1:] for f in fields), "parked")
        for job, _ in self.client.zscan_iter(leases, count=1000):
            known[_text(job)] = "admitted"
        return known

    def reset_tag(self, *, tag: str) -> int:
        """Delete all of a tag's state (before rebuilding a FOREIGN tag from the source of
        truth); the tag then reads NOT_READY. Returns how many of its keys existed."""
        return int(self.client.delete(*tag_keys(self.prefix, tag)))

    def ready_tags(self, tags: Iterable[str]) -> set[str]:
        """Which of `tags` are ready (see init_tag): one pipelined round trip."""
        tags = list(tags)
        pipe = self.client.pipeline(transaction=False)
        for tag in tags:
            pipe.hexists(key_name(self.prefix, tag, "state"), READY_FIELD)
        return {tag for tag, ready in zip(tags, pipe.execute(), strict=True) if ready}

    def check_invariants(self, *, tag: str) -> list[str]:
        """O(state) audit of one tag's consistency; empty when sound. Tests and ops only."""
        return self._run(ops.check_invariants(self.prefix, tag=tag))

    def expire_now(self, *, tag: str, job_id: str) -> bool:
        """Testing aid: make an admitted job's lease run out now (no sleeping)."""
        pipe = self.client.pipeline(transaction=True)
        _expire_now(pipe, self.prefix, tag, job_id)
        return bool(pipe.execute()[0])


class AsyncEngine(_Base):
    """asyncio API (ASGI views) over the same scripts and the same encoding."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str = "fq") -> None:
        super().__init__(prefix)
        self.client = client

    async def _load(self) -> None:
        try:
            await self.client.function_load(library().source)
        except ResponseError as e:
            if not is_already_loaded(e):
                raise

    async def _run(self, call: ops.Call[T]) -> T:
        args = fcall_args(call)
        try:
            raw = await self.client.fcall(*args)
        except ResponseError as e:
            if not is_missing_function(e):
                raise
            await self._load()
            raw = await self.client.fcall(*args)
        return call.decode(raw)

    async def _run_many(self, calls: Sequence[ops.Call[T]]) -> list[T]:
        return (await self._run_many_after(calls, ()))[1]

    async def _run_many_after(
        self, calls: Sequence[ops.Call[T]], before: Sequence[Sequence[Any]]
    ) -> tuple[list[Any], list[T]]:
        """See ``Engine._run_many_after``."""
        if not calls and not before:
            return [], []
        pending = list(range(len(calls)))
        raws: list[Any] = [None] * len(calls)
        head: list[Any] = []
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            sent = before if attempt == 0 else ()
            for command in sent:
                pipe.execute_command(*command)
            for i in pending:
                pipe.fcall(*fcall_args(calls[i]))
            results = await pipe.execute(raise_on_error=False)
            if attempt == 0:
                head, results = list(results[: len(sent)]), results[len(sent) :]
            pending = _collect(pending, results, raws, last=attempt == 1)
            if not pending:
                break
            await self._load()
        return head, [c.decode(r) for c, r in zip(calls, raws, strict=True)]

    async def admit(
        self,
        *,
        tag: str,
        job_id: str,
        keys: KeysArg,
        priority: int = 0,
        lease_seconds: float,
        data: str = "",
        require_ready: bool = False,
    ) -> Admission:
        """See ``Engine.admit``."""
        return await self._run(self._admit(tag, job_id, keys, priority, lease_seconds, data, require_ready))

    async def admit_many(self, items: Iterable[AdmitRequest], *, require_ready: bool = False) -> list[Admission]:
        """See ``Engine.admit_many``."""
        return (await self.admit_many_after((), items, require_ready=require_ready))[1]

    async def admit_many_after(
        self, before: Sequence[Sequence[Any]], items: Iterable[AdmitRequest], *, require_ready: bool = False
    ) -> tuple[list[Any], list[Admission]]:
        """See ``Engine.admit_many_after``."""
        calls, indexes = self._admit_calls(items, require_ready)
        replies, batches = await self._run_many_after(calls, before)
        return replies, self._admissions(indexes, batches)

    async def release(self, *, tag: str, job_id: str, keys: Iterable[str] | None = None) -> ReleaseResult:
        """See ``Engine.release``."""
        return await self._run(ops.release(self.prefix, tag=tag, job_id=job_id, keys=keys))

    async def renew(self, *, tag: str, job_id: str, lease_seconds: float) -> bool:
        """See ``Engine.renew``."""
        return await self._run(ops.renew(self.prefix, tag=tag, job_id=job_id, lease_seconds=lease_seconds))

    async def cancel(self, *, tag: str, job_id: str) -> CancelResult:
        """See ``Engine.cancel``."""
        return await self._run(ops.cancel(self.prefix, tag=tag, job_id=job_id))

    async def reclaim(self, *, tag: str, max_jobs: int = 100) -> ReclaimResult:
        """See ``Engine.reclaim``."""
        return await self._run(ops.reclaim(self.prefix, tag=tag, max_jobs=max_jobs))

    async def sweep(self, tags: Iterable[str], max_jobs_per_tag: int = 100) -> dict[str, ReclaimResult]:
        """See ``Engine.sweep``."""
        tag_list, calls = self._sweep_calls(tags, max_jobs_per_tag)
        return dict(zip(tag_list, await self._run_many(calls), strict=True))

    async def set_limits(self, *, tag: str, limits: KeysArg, require_ready: bool = False) -> list[Woken]:
        """See ``Engine.set_limits``."""
        return await self._run(ops.set_limits(self.prefix, tag=tag, limits=limits, require_ready=require_ready))

    async def inspect_key(self, *, tag: str, key: str, holders: bool = True) -> KeyState:
        """See ``Engine.inspect_key``."""
        return await self._run(ops.inspect_key(self.prefix, tag=tag, key=key, holders=holders))

    async def inspect_job(self, *, tag: str, job_id: str) -> JobState:
        """See ``Engine.inspect_job``."""
        return await self._run(ops.inspect_job(self.prefix, tag=tag, job_id=job_id))

    async def counts(self, *, tag: str, keys: Sequence[str]) -> dict[str, int]:
        """See ``Engine.counts``."""
        name, names = self._counts_args(tag, keys)
        if not names:
            return {}
        return self._counts_decode(names, await self.client.hmget(name, names))

    async def init_tag(self, *, tag: str) -> bool:
        """See ``Engine.init_tag``."""
        return await self._run(ops.init_tag(self.prefix, tag=tag))

    async def check_invariants(self, *, tag: str) -> list[str]:
        """See ``Engine.check_invariants``."""
        return await self._run(ops.check_invariants(self.prefix, tag=tag))

    async def expire_now(self, *, tag: str, job_id: str) -> bool:
        """See ``Engine.expire_now``."""
        pipe = self.client.pipeline(transaction=True)
        _expire_now(pipe, self.prefix, tag, job_id)
        return bool((await pipe.execute())[0])
