"""A plain-Python reference model of the engine's semantics (issue 3), and checks that
the real scripts agree with it on hand-written scenarios. The stateful test
(test_engine_stateful) drives both with random operations.

The model is deliberately naive (lists and sets, O(n) everywhere): it states *what*
must happen, the Lua states *how* to do it cheaply.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from django.conf import settings

from fairqueue.engine import Engine
from fairqueue.engine.keys import key_name
from fairqueue.engine.ops import INLINE_RECLAIM  # expired leases admit/release/cancel reclaim
from tests.base import RedisTestCase

Pair = tuple[str, str]  # (job_id, data)


@dataclass
class MJob:
    keys: list[str]
    priority: int
    data: str
    n: int = 0  # 0-based index of the next key to take; len(keys) = holds all
    running: bool = False
    expired: bool = False
    seq: int = 0
    limits: dict[str, int] = field(default_factory=dict)  # as its admit passed them


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
    """Semantics: safety, direct handoff (head = highest priority, then FIFO), no barging,
    canonical multi-key order holding earlier keys while parked, leases."""

    def __init__(self) -> None:
        self.limits: dict[str, int] = {}
        self.holders: dict[str, set[str]] = {}
        self.waits: dict[str, list[tuple[int, int, str]]] = {}  # key -> sorted (255-p, seq, job)
        self.jobs: dict[str, MJob] = {}
        self.seq = 0

    # --- internals mirroring lua/_lib.lua -------------------------------------------
    def _count(self, key: str) -> int:
        return len(self.holders.get(key, ()))

    def _hold(self, key: str, job: str) -> None:
        # Safety, exactly: a job only ever becomes a holder while the key is below its
        # current limit (a lowered limit evicts nobody, but admits nobody either).
        assert self._count(key) < self.limits.get(key, 0), (key, job, self.holders.get(key), self.limits.get(key))
        self.holders.setdefault(key, set()).add(job)

    def _grant(self, job_id: str) -> bool:
        job = self.jobs[job_id]
        while job.n < len(job.keys):
            key = job.keys[job.n]
            # An idle key has forgotten its limit: the job brings the one its admit passed.
            self.limits.setdefault(key, job.limits[key])
            if self._count(key) >= self.limits[key]:
                self.seq += 1
                job.seq = self.seq
                job.running = False
                bisect.insort(self.waits.setdefault(key, []), (255 - job.priority, self.seq, job_id))
                return False
            self._hold(key, job_id)
            job.n += 1
        job.running = True
        job.expired = False
        return True

    def _handoff(self, key: str, woken: list[Pair]) -> None:
        queue = self.waits.get(key, [])
        while self._count(key) < self.limits.get(key, 0) and queue:
            _, _, job_id = queue.pop(0)
            job = self.jobs[job_id]
            self._hold(key, job_id)
            job.n += 1
            if self._grant(job_id):
                woken.append((job_id, job.data))

    def _drop(self, job_id: str, woken: list[Pair]) -> None:
        job = self.jobs.pop(job_id)
        if not job.running:
            self.waits[job.keys[job.n]].remove((255 - job.priority, job.seq, job_id))
        for key in job.keys[: job.n]:
            self.holders[key].discard(job_id)
            self._handoff(key, woken)
            if not self._count(key) and self.limits[key] > 0:  # idle (nobody can wait): forgotten
                del self.limits[key]

    def _reclaim(self, max_jobs: int, woken: list[Pair], reclaimed: list[Pair]) -> None:
        # expire_now gives every expired lease the score 0: Redis then orders by member.
        due = sorted((j for j, job in self.jobs.items() if job.expired), key=lambda j: j.encode())[:max_jobs]
        for job_id in due:
            reclaimed.append((job_id, self.jobs[job_id].data))
            self._drop(job_id, woken)

    def _store_limits(self, limits: dict[str, int], woken: list[Pair]) -> None:
        # All limits change at once; raised keys are then served in reverse canonical order
        # (a woken job only moves on to later keys, whose queues are then already served).
        raised = [k for k in sorted(limits) if self.limits.get(k) is None or limits[k] > self.limits[k]]
        self.limits.update(limits)
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
    def admit(self, job_id: str, limits: dict[str, int], priority: int, data: str) -> MResult:
        res = MResult()
        self._reclaim(INLINE_RECLAIM, res.woken, res.reclaimed)
        if job_id in self.jobs:
            res.duplicate = True
            return self._state(job_id, res)
        # Changed limits of keys in use are stored (a raise hands on first); an idle key's
        # limit is stored when the job takes or parks on it (_grant).
        self._store_limits({k: v for k, v in limits.items() if k in self.limits}, res.woken)
        self.jobs[job_id] = MJob(sorted(limits), priority, data, limits=dict(limits))
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

    def set_limits(self, limits: dict[str, int]) -> list[Pair]:
        woken: list[Pair] = []
        self._store_limits(limits, woken)
        return woken

    # --- views ----------------------------------------------------------------------
    def position(self, job_id: str) -> int:
        job = self.jobs[job_id]
        return self.waits[job.keys[job.n]].index((255 - job.priority, job.seq, job_id)) + 1

    def waiting_order(self, key: str) -> list[str]:
        return [j for _, _, j in self.waits.get(key, [])]

    def holders_of(self, key: str) -> list[str]:
        return sorted(self.holders.get(key, ()))


def engine_waiting_order(engine: Engine, tag: str, key: str) -> list[str]:
    """The real queue of a key, head first, straight from the waits ZSET."""
    raw = engine.client.zrangebylex(
        key_name(engine.prefix, tag, "waits"), b"[" + key.encode() + b"\0", b"(" + key.encode() + b"\1"
    )
    return [m.split(b"\0", 3)[2].decode() for m in raw]  # key, rank, job, rest of the spec


def assert_agree(case: RedisTestCase, engine: Engine, model: Model, tag: str, keys: list[str]) -> None:
    """Same holders, same queues (in order), same limits, and the scripts' own audit is clean."""
    for key in keys:
        state = engine.inspect_key(tag=tag, key=key)
        case.assertEqual(sorted(state.holders), model.holders_of(key), f"holders of {key}")
        case.assertEqual(engine_waiting_order(engine, tag, key), model.waiting_order(key), f"queue of {key}")
        case.assertEqual(state.limit, model.limits.get(key), f"limit of {key}")
        case.assertEqual(state.waiting, len(model.waiting_order(key)))
        if state.waiting:
            case.assertGreaterEqual(state.held, state.limit or 0, f"room with waiters on {key}")
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

    def _admit(self, job: str, limits: dict[str, int], priority: int = 0) -> None:
        real = self.engine.admit(tag="m", job_id=job, keys=limits, priority=priority, lease_seconds=60, data=job)
        want = self.model.admit(job, limits, priority, job)
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
