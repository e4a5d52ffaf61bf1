"""A plain-Python reference model of the engine's semantics (issue 3, fair order: issue 16,
reserves and guarantees: issue 41), and checks that the real scripts agree with it on
hand-written scenarios. The stateful test (test_engine_stateful) drives both with random
operations.

The model is deliberately naive (lists and sets, O(n) everywhere): it states *what*
must happen, the Lua states *how* to do it cheaply.

Fair order: a key's waiters are served by priority, then by virtual start tag, then by the
start of their flow's backlog, then by arrival. A job that parks on a key at priority p in
flow f gets the tag max(V, F): V is the tag of the key's head at p (0 when none waits there),
F the finish tag of f's last job there, kept only while f has waiters there; f's finish tag
becomes tag + cost (ops.flow_cost of the job's weight). The model also logs every park,
service and withdrawal per (key, priority, flow) so the fairness bound can be checked on
any run (fairness_violations).

Reserves and guarantees: a key with limit L keeps R = min(reserve, L) slots for jobs within
their guarantee (holding their guard key, whose holder count, theirs included, is at most
their guarantee): such a job takes the key while its count is below L, any other below
L - R. A job that parks within its guarantee waits in the floor band, before every other
waiter of the key, whatever the priorities; its band is decided when it parks. A handoff
serves the head while the count is below L, but a head of the general band only below
L - R. The band is part of the queue's first sort field: 255-p, less FLOOR_BAND in the floor
band (the engine writes the floor band's priority hex digits as characters below '0').
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from django.conf import settings

from fairqueue.engine import Engine, KeyLimit
from fairqueue.engine.keys import key_name
from fairqueue.engine.ops import DEFAULT_COST, INLINE_RECLAIM, flow_cost
from tests.base import RedisTestCase

Pair = tuple[str, str]  # (job_id, data)
# (band and 255-p, tag, backlog start, seq, job): a key's queue order; the first field is
# 255-p, less FLOOR_BAND for a waiter of the floor band
Entry = tuple[int, int, int, int, str]
FlowKey = tuple[str, int, str]  # (key, band and 255-p, flow)
Event = tuple[str, str, int, str]  # ("park" | "serve" | "withdraw", key, band and 255-p, flow)
TAG_MAX = 2**53 - 1  # TAG_MAX in lua/_lib.lua
FLOOR_BAND = 256
Guard = tuple[str, int]  # (guard key, guarantee)


def order_prefix(bp: int) -> str:
    """The first two order bytes of a waiter: 255-p in hex, or in the floor band (bp < 0)
    each hex digit d written as the character 0x20 + d (below every hex digit)."""
    if bp >= 0:
        return f"{bp:02x}"
    return "".join(chr(0x20 + int(d, 16)) for d in f"{bp + FLOOR_BAND:02x}")


@dataclass
class MJob:
    keys: list[str]
    priority: int
    data: str
    n: int = 0  # 0-based index of the next key to take; len(keys) = holds all
    running: bool = False
    expired: bool = False
    entry: Entry | None = None  # its wait entry while parked
    limits: dict[str, int] = field(default_factory=dict)  # as its admit passed them
    flows: dict[str, tuple[str, int]] = field(default_factory=dict)  # key -> (flow, cost) as passed
    reserves: dict[str, int] = field(default_factory=dict)  # key -> effective reserve as passed
    guards: dict[str, Guard] = field(default_factory=dict)  # key -> (guard key, guarantee) as passed


@dataclass
class MResult:
    admitted: bool = False
    parked_on: str | None = None
    position: int | None = None
    found: bool = False
    duplicate: bool = False
    woken: list[Pair] = field(default_factory=list)
    reclaimed: list[Pair] = field(default_factory=list)


class Model:
    """Semantics: safety, direct handoff (head = floor band first, then highest priority,
    then fair order across flows, FIFO within a flow), reserves kept for jobs within their
    guarantee, no barging, canonical multi-key order holding earlier keys while parked,
    leases."""

    def __init__(self) -> None:
        self.limits: dict[str, int] = {}
        self.reserves: dict[str, int] = {}  # effective (min(reserve, limit)), exactly with the limit
        self.holders: dict[str, set[str]] = {}
        self.waits: dict[str, list[Entry]] = {}  # key -> sorted entries, head first
        self.jobs: dict[str, MJob] = {}
        self.seq = 0
        # (key, 255-p, flow) -> [finish tag, backlog start, waiters]: only while waiters > 0
        self.flow_records: dict[FlowKey, list[int]] = {}
        self.log: list[Event] = []

    def _within(self, job_id: str, key: str) -> bool:
        """Whether the job (holding every key before `key`) is within its guarantee at key."""
        guard = self.jobs[job_id].guards.get(key)
        return guard is not None and job_id in self.holders.get(guard[0], ()) and self._count(guard[0]) <= guard[1]

    def _bp(self, job: MJob, key: str) -> int:
        """The queue field of job's wait at key: 255-p, less FLOOR_BAND in the floor band."""
        assert job.entry is not None
        return job.entry[0]

    def _park(self, job_id: str, key: str) -> None:
        job = self.jobs[job_id]
        flow, cost = job.flows.get(key, ("", DEFAULT_COST))
        p = 255 - job.priority - (FLOOR_BAND if self._within(job_id, key) else 0)
        self.seq += 1
        rec = self.flow_records.get((key, p, flow))
        if rec:  # the flow has waiters here: it goes on from its last finish tag
            tag, start = rec[0], rec[1]
        else:  # a new backlog: at the key's virtual time (its head's tag at this priority)
            at_p = [e for e in self.waits.get(key, []) if e[0] == p]
            tag, start = (at_p[0][1] if at_p else 0), self.seq
        self.flow_records[(key, p, flow)] = [min(tag + cost, TAG_MAX), start, (rec[2] if rec else 0) + 1]
        job.entry = (p, tag, start, self.seq, job_id)
        job.running = False
        bisect.insort(self.waits.setdefault(key, []), job.entry)
        self.log.append(("park", key, p, flow))

    def _left(self, job_id: str, key: str, event: str) -> None:
        """A waiter left key's queue (served, or withdrawn): its flow has one fewer there."""
        job = self.jobs[job_id]
        flow = job.flows.get(key, ("", DEFAULT_COST))[0]
        p = self._bp(job, key)
        rec = self.flow_records[(key, p, flow)]
        rec[2] -= 1
        if not rec[2]:
            del self.flow_records[(key, p, flow)]
        job.entry = None
        self.log.append((event, key, p, flow))

    # --- internals mirroring lua/_lib.lua -------------------------------------------
    def _count(self, key: str) -> int:
        return len(self.holders.get(key, ()))

    def _hold(self, key: str, job: str, floor: bool) -> None:
        # Safety, exactly: a job only ever becomes a holder while the key is below its
        # current limit (a lowered limit evicts nobody, but admits nobody either), and below
        # its limit less its reserve unless the job is within its guarantee there.
        room = self.limits.get(key, 0) - (0 if floor else self.reserves.get(key, 0))
        assert self._count(key) < room, (key, job, self.holders.get(key), self.limits.get(key), floor)
        self.holders.setdefault(key, set()).add(job)

    def _grant(self, job_id: str) -> bool:
        job = self.jobs[job_id]
        while job.n < len(job.keys):
            key = job.keys[job.n]
            # An idle key has forgotten its limit and reserve: the job brings the ones its
            # admit passed.
            if key not in self.limits:
                self.limits[key], self.reserves[key] = job.limits[key], job.reserves.get(key, 0)
            c, limit = self._count(key), self.limits[key]
            within = self._within(job_id, key)
            if c >= limit - (0 if within else self.reserves[key]):
                self._park(job_id, key)
                return False
            self._hold(key, job_id, within)
            job.n += 1
        job.running = True
        job.expired = False
        return True

    def _handoff(self, key: str, woken: list[Pair]) -> None:
        queue = self.waits.get(key, [])
        while self._count(key) < self.limits.get(key, 0) and queue:
            floor = queue[0][0] < 0
            if not floor and self._count(key) >= self.limits[key] - self.reserves[key]:
                break  # a head of the general band: the reserved slots stay kept
            job_id = queue[0][-1]
            self._left(job_id, key, "serve")
            queue.pop(0)
            job = self.jobs[job_id]
            self._hold(key, job_id, floor)
            job.n += 1
            if self._grant(job_id):
                woken.append((job_id, job.data))

    def _drop(self, job_id: str, woken: list[Pair]) -> None:
        job = self.jobs[job_id]
        if not job.running:
            assert job.entry is not None
            self.waits[job.keys[job.n]].remove(job.entry)
            self._left(job_id, job.keys[job.n], "withdraw")
        del self.jobs[job_id]
        for key in job.keys[: job.n]:
            self.holders[key].discard(job_id)
            self._handoff(key, woken)
            # Idle, unless every slot is reserved (then general waiters may stay): nobody can
            # wait, and its limit and reserve are forgotten.
            if not self._count(key) and self.limits[key] > self.reserves[key]:
                del self.limits[key], self.reserves[key]

    def _reclaim(self, max_jobs: int, woken: list[Pair], reclaimed: list[Pair]) -> None:
        # expire_now gives every expired lease the score 0: Redis then orders by member.
        due = sorted((j for j, job in self.jobs.items() if job.expired), key=lambda j: j.encode())[:max_jobs]
        for job_id in due:
            reclaimed.append((job_id, self.jobs[job_id].data))
            self._drop(job_id, woken)

    def _store_limits(self, limits: dict[str, int], reserves: dict[str, int], woken: list[Pair]) -> None:
        # All limits and reserves change at once; keys where a waiter may now fit (a raised
        # limit, or a raised limit less reserve) are then served in reverse canonical order
        # (a woken job only moves on to later keys, whose queues are then already served).
        new = {k: min(reserves.get(k, 0), limits[k]) for k in limits}
        raised = [
            k
            for k in sorted(limits)
            if self.limits.get(k) is None
            or limits[k] > self.limits[k]
            or limits[k] - new[k] > self.limits[k] - self.reserves[k]
        ]
        self.limits.update(limits)
        self.reserves.update(new)
        for key in reversed(raised):
            self._handoff(key, woken)

    def _state(self, job_id: str, res: MResult) -> MResult:
        job = self.jobs[job_id]
        res.admitted = job.running
        if not job.running:
            res.parked_on = job.keys[job.n]
            res.position = self.position(job_id)
        return res

    # --- operations -----------------------------------------------------------------
    def admit(
        self,
        job_id: str,
        limits: dict[str, int],
        priority: int,
        data: str,
        flows: dict[str, tuple[str, float]] | None = None,
        reserves: dict[str, int] | None = None,
        guards: dict[str, Guard] | None = None,
    ) -> MResult:
        """``flows``: key -> (flow, weight) for the keys not in the default flow;
        ``reserves``: key -> reserve (0 when missing); ``guards``: key -> (guard key,
        guarantee) for the keys where the job passes a guard."""
        res = MResult()
        self._reclaim(INLINE_RECLAIM, res.woken, res.reclaimed)
        if job_id in self.jobs:
            res.duplicate = True
            return self._state(job_id, res)
        reserves = {k: min((reserves or {}).get(k, 0), v) for k, v in limits.items()}
        # Changed limits and reserves of keys in use are stored (where room appears it is
        # handed on first); an idle key's are stored when the job takes or parks on it (_grant).
        changed = {k: v for k, v in limits.items() if k in self.limits and (v, reserves[k]) != self.stored(k)}
        self._store_limits(changed, reserves, res.woken)
        costs = {k: (f, flow_cost(w)) for k, (f, w) in (flows or {}).items()}
        self.jobs[job_id] = MJob(
            sorted(limits),
            priority,
            data,
            limits=dict(limits),
            flows=costs,
            reserves=reserves,
            guards=dict(guards or {}),
        )
        self._grant(job_id)
        return self._state(job_id, res)

    def release(self, job_id: str) -> MResult:
        res = MResult()
        if job_id in self.jobs:
            res.found = True
            self._drop(job_id, res.woken)
        self._reclaim(INLINE_RECLAIM, res.woken, res.reclaimed)
        return res

    def cancel(self, job_id: str) -> MResult:
        res = MResult()
        if job_id in self.jobs and not self.jobs[job_id].running:
            res.found = True
            self._drop(job_id, res.woken)
        self._reclaim(INLINE_RECLAIM, res.woken, res.reclaimed)
        return res

    def renew(self, job_id: str) -> bool:
        job = self.jobs.get(job_id)
        return bool(job and job.running and not job.expired)

    def expire_now(self, job_id: str) -> bool:
        job = self.jobs.get(job_id)
        if job and job.running and not job.expired:
            job.expired = True
            return True
        return False

    def reclaim(self, max_jobs: int) -> MResult:
        res = MResult()
        self._reclaim(max_jobs, res.woken, res.reclaimed)
        return res

    def set_limits(self, limits: dict[str, int], reserves: dict[str, int] | None = None) -> list[Pair]:
        """A key missing from ``reserves`` gets none (as an admit passing no reserve)."""
        woken: list[Pair] = []
        self._store_limits(limits, reserves or {}, woken)
        return woken

    def stored(self, key: str) -> tuple[int, int] | None:
        """(limit, effective reserve) stored for a key in use, None for an idle one."""
        return (self.limits[key], self.reserves[key]) if key in self.limits else None

    # --- views ----------------------------------------------------------------------
    def position(self, job_id: str) -> int:
        job = self.jobs[job_id]
        assert job.entry is not None
        return self.waits[job.keys[job.n]].index(job.entry) + 1

    def waiting_order(self, key: str) -> list[str]:
        return [e[-1] for e in self.waits.get(key, [])]

    def queue_orders(self, key: str) -> list[tuple[str, str]]:
        """(job, order bytes as the engine writes them: band and 255-p, tag, backlog start, seq)."""
        return [
            (j, f"{order_prefix(p)}{tag:016x}{start:012x}{seq:012x}")
            for p, tag, start, seq, j in self.waits.get(key, [])
        ]

    def floor_waiting(self, key: str) -> int:
        """How many of key's waiters are in the floor band."""
        return sum(1 for e in self.waits.get(key, []) if e[0] < 0)

    def records(self) -> dict[tuple[str, str], tuple[str, int]]:
        """(key, fp) -> (finish tag and backlog start as stored, waiters), fp = the band and
        255-p as the order bytes write them, then the flow."""
        return {
            (key, f"{order_prefix(p)}{flow}"): (f"{fin:016x}{start:012x}", n)
            for (key, p, flow), (fin, start, n) in self.flow_records.items()
        }

    def holders_of(self, key: str) -> list[str]:
        return sorted(self.holders.get(key, ()))


def fairness_violations(log: list[Event], costs: dict[str, int]) -> list[str]:
    """Replay a model's log and check the fairness bound between every two flows that wait on
    one key at one priority, counting services from the moment both wait (the later of
    their backlog starts) for as long as both keep waiting without a withdrawal (a withdrawn
    waiter leaves a gap in its flow's tags until the flow's backlog ends): with n_f, n_g
    services and costs c_f, c_g (one weight per flow: `costs` maps flow -> cost),
    |n_f*c_f - n_g*c_g| < c_f + c_g, i.e. each flow's count stays strictly within one job
    of its weighted share n*c_g/(c_f+c_g) of the pair's n services; at equal weights the two
    counts never differ by more than one job (checked as such too)."""
    waiting: dict[FlowKey, int] = {}
    clean: dict[FlowKey, bool] = {}
    pairs: dict[tuple[FlowKey, FlowKey], list[int]] = {}  # both backlogged, clean -> [n_f, n_g]
    out: list[str] = []
    for i, (event, key, p, flow) in enumerate(log):
        fk = (key, p, flow)
        if event == "park":
            if not waiting.get(fk):
                clean[fk] = True
                for other, n in waiting.items():
                    if n and other[:2] == fk[:2] and clean.get(other):
                        pairs[(other, fk)] = [0, 0]
            waiting[fk] = waiting.get(fk, 0) + 1
            continue
        waiting[fk] -= 1
        if event == "withdraw":
            clean[fk] = False
        for (f, g), counts in list(pairs.items()):
            if fk not in (f, g):
                continue
            if event == "serve":
                counts[0 if fk == f else 1] += 1
                cf, cg = costs[f[2]], costs[g[2]]
                ok = abs(counts[0] * cf - counts[1] * cg) < cf + cg
                if cf == cg:
                    ok = ok and abs(counts[0] - counts[1]) <= 1
                if not ok:
                    out.append(f"event {i}: {f} and {g} served {counts} (costs {cf}, {cg})")
            if event == "withdraw" or not waiting[fk]:
                del pairs[(f, g)]
    return out


def engine_queue(engine: Engine, tag: str, key: str) -> list[tuple[str, str]]:
    """The real queue of a key, head first, straight from the waits ZSET: (job, order bytes)."""
    raw = engine.client.zrangebylex(
        key_name(engine.prefix, tag, "waits"), b"[" + key.encode() + b"\0", b"(" + key.encode() + b"\1"
    )
    parts = [m.split(b"\0", 3) for m in raw]  # key, order, job, flow part and spec
    return [(p[2].decode(), p[1].decode()) for p in parts]


def engine_waiting_order(engine: Engine, tag: str, key: str) -> list[str]:
    """The real queue of a key, head first."""
    return [job for job, _ in engine_queue(engine, tag, key)]


def engine_records(engine: Engine, tag: str) -> dict[tuple[str, str], tuple[str, int]]:
    """The flow records of a tag, as Model.records() gives them."""
    fields = engine.client.hgetall(key_name(engine.prefix, tag, "state"))
    out: dict[tuple[str, str], tuple[str, int]] = {}
    for f, v in fields.items():
        if f[:1] == b"\4" and b"\1" in f[1:]:
            key, fp = f[1:].decode().split("\1", 1)
            out[(key, fp)] = (v.decode(), int(fields[b"\5" + f[1:]]))
    return out


def assert_agree(case: RedisTestCase, engine: Engine, model: Model, tag: str, keys: list[str]) -> None:
    """Same holders, same queues (in order, bands included), same limits and reserves, the
    reserves' invariant, and the scripts' own audit is clean."""
    for key in keys:
        state = engine.inspect_key(tag=tag, key=key)
        case.assertEqual(sorted(state.holders), model.holders_of(key), f"holders of {key}")
        case.assertEqual(engine_queue(engine, tag, key), model.queue_orders(key), f"queue of {key}")
        case.assertEqual(state.limit, model.limits.get(key), f"limit of {key}")
        case.assertEqual(state.reserve, model.reserves.get(key, 0), f"reserve of {key}")
        case.assertEqual(state.waiting, len(model.waiting_order(key)))
        case.assertEqual(state.floor_waiting, model.floor_waiting(key), f"floor band of {key}")
        case.assertEqual(sum(state.waiters_by_priority.values()), state.waiting)
        # Waiters only where no slot is free for them: the general band's end at the limit
        # less the reserve, the floor band's at the limit.
        if state.waiting:
            case.assertGreaterEqual(state.held, (state.limit or 0) - state.reserve, f"room with waiters on {key}")
        if state.floor_waiting:
            case.assertGreaterEqual(state.held, state.limit or 0, f"room with floor-band waiters on {key}")
    case.assertEqual(engine_records(engine, tag), model.records(), "flow records")
    case.assertEqual(engine.check_invariants(tag=tag), [])
    case.assertEqual(
        sorted(f[1:].decode() for f in engine.client.hkeys(key_name(engine.prefix, tag, "state")) if f[:1] == b"\2"),
        sorted(model.jobs),
    )


class ModelAgreesOnScenarios(RedisTestCase):
    """Deterministic scenarios run on both; the model is the executable spec."""

    def setUp(self) -> None:
        super().setUp()
        import redis

        self.engine = Engine(redis.Redis.from_url(settings.REDIS_URL))
        self.model = Model()

    def _admit(
        self, job: str, limits: dict[str, int], priority: int = 0, flows: dict[str, tuple[str, float]] | None = None
    ) -> None:
        flows = flows or {}
        keys = [KeyLimit(k, v, *flows.get(k, ("", 1.0))) for k, v in limits.items()]
        real = self.engine.admit(tag="m", job_id=job, keys=keys, priority=priority, lease_seconds=60, data=job)
        want = self.model.admit(job, limits, priority, job, flows)
        self.assertEqual((real.admitted, real.parked_on, real.position), (want.admitted, want.parked_on, want.position))
        self.assertEqual([(w.job_id, w.data) for w in real.woken], want.woken)

    def _release(self, job: str) -> None:
        real = self.engine.release(tag="m", job_id=job)
        want = self.model.release(job)
        self.assertEqual(real.found, want.found)
        self.assertEqual([(w.job_id, w.data) for w in real.woken], want.woken)

    def test_priorities_multi_keys_and_limits(self) -> None:
        self._admit("j1", {"a": 1, "b": 1})
        self._admit("j2", {"b": 1, "c": 2}, priority=5)
        self._admit("j3", {"a": 1}, priority=9)
        self._admit("j4", {"c": 2, "a": 1})
        self._admit("j5", {"c": 2})
        assert_agree(self, self.engine, self.model, "m", ["a", "b", "c"])
        self._release("j1")
        assert_agree(self, self.engine, self.model, "m", ["a", "b", "c"])
        self._admit("j6", {"a": 3, "c": 2})  # raised limit wakes waiters before j6 competes
        assert_agree(self, self.engine, self.model, "m", ["a", "b", "c"])
        for job in ["j2", "j3", "j4", "j5", "j6"]:
            self._release(job)
            assert_agree(self, self.engine, self.model, "m", ["a", "b", "c"])

    def test_flows_on_shared_keys(self) -> None:
        """Flows on two keys, weights, priorities, a cancel and a multi-key job that parks
        on its later key when woken: the engine orders and keeps records like the model."""
        keys = ["a", "b"]
        self._admit("h", {"a": 1, "b": 1})
        for i in range(4):
            self._admit(f"x{i}", {"a": 1}, flows={"a": ("X", 1.0)})
        self._admit("y0", {"a": 1, "b": 1}, flows={"a": ("Y", 2.0), "b": ("Y", 2.0)})
        self._admit("y1", {"a": 1}, flows={"a": ("Y", 2.0)})
        self._admit("z0", {"a": 1}, priority=3, flows={"a": ("X", 1.0)})
        self._admit("w0", {"b": 1}, flows={"b": ("W", 1.0)})
        assert_agree(self, self.engine, self.model, "m", keys)
        self.assertTrue(self.engine.cancel(tag="m", job_id="x1").cancelled)
        self.model.cancel("x1")
        assert_agree(self, self.engine, self.model, "m", keys)
        while self.model.jobs:
            self._release(min(j for j, job in self.model.jobs.items() if job.running))
            assert_agree(self, self.engine, self.model, "m", keys)
        costs = {"": DEFAULT_COST, "X": DEFAULT_COST, "W": DEFAULT_COST, "Y": flow_cost(2.0)}
        self.assertEqual(fairness_violations(self.model.log, costs), [])
        self.assertEqual(self.model.flow_records, {})  # nobody waits: no flow records left
