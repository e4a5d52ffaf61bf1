"""The engine's semantics as a fast in-memory model, for the what-if simulation.

Same rules as the Lua (lua/_lib.lua, docs/engine.md) and as the test suite's reference
model (tests/test_engine_model.Model, which states them naively; tests/test_simulation
checks that this one agrees with it on random operations):

- a job takes its keys in canonical (sorted) order and parks on the first full one,
  keeping what it holds;
- a key's waiters are served by band (the floor band first, see below), then priority,
  then by virtual start tag (start-time fair queueing across flows, weighted by cost), then
  by the start of their flow's backlog, then by arrival: FIFO within a flow;
- reserves and guarantees (docs/engine.md, "Reserves and guarantees"): a key with limit L
  keeps R = min(reserve, L) of its slots for jobs *within their guarantee* there (holding
  their guard key, whose holder count, theirs included, is at most their guarantee). Such a
  job takes the key while its count is below L, any other only below L - R. A job that
  parks within its guarantee waits in the key's floor band, served before every other
  waiter; its band is decided when it parks and kept while it waits;
- a release hands each freed slot to the key's head waiter in the same step (a head of the
  general band only while the count is below L - R), which goes on to its later keys; a
  raised limit or a lowered reserve hands on too, in reverse canonical order;
- an idle key forgets its limit and reserve, and the next job to use it brings its own.

What the simulation does not need is left out: leases (nothing dies in a replay), data,
inspection. Where the reference model keeps sorted lists, this one keeps one heap per
(key, band and priority) and withdraws a cancelled waiter lazily, so every operation costs
O(log n). Job ids are ints.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from fairqueue.engine.ops import KeySpec

# A virtual tag stops growing here: TAG_MAX in lua/_lib.lua (exact in a double's 53 bits).
TAG_MAX = 2**53 - 1
# The floor band's queues sort before every general one: a waiter's queue is keyed by
# 255 - priority, less FLOOR_BAND when it parked within its guarantee (the Lua's floor
# band priority characters sort below every hex digit in the same way).
FLOOR_BAND = 256
# A job's keys are KeySpecs as the engine takes them, (name, limit, flow, cost, reserve,
# guard, guarantee), sorted by name (fairqueue.engine.ops.key_specs builds them from
# KeyLimits, with flow_cost; guard is the name of an earlier key of the job, or None).
Entry = tuple[int, int, int, int]  # (virtual start tag, backlog start, arrival seq, job)


class _Job:
    __slots__ = ("bp", "entry", "n", "p", "running", "specs")

    def __init__(self, specs: Sequence[KeySpec], p: int) -> None:
        self.specs = specs
        self.p = p  # 255 - priority: lower is served first
        self.bp = p  # the queue it waits in: p, or p - FLOOR_BAND in the floor band
        self.n = 0  # index of the next key to take; len(specs) once it holds them all
        self.running = False
        self.entry: Entry | None = None  # its wait entry while parked


class EngineModel:
    """Keys, limits, reserves, waiter queues and flow records of one engine tag."""

    def __init__(self) -> None:
        self.limits: dict[str, int] = {}
        # key -> effective reserve (min(reserve, limit)), stored exactly with the limit
        self.reserves: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        # key -> band and 255-priority -> heap of entries; a heap may hold withdrawn entries
        # (their job's `entry` is no longer that tuple), skipped when met.
        self.queues: dict[str, dict[int, list[Entry]]] = {}
        # (key, band and 255-priority, flow) -> [finish tag, backlog start, waiters]: only
        # while waiters > 0
        self.flows: dict[tuple[str, int, str], list[int]] = {}
        self.jobs: dict[int, _Job] = {}
        self.seq = 0

    # --- operations -------------------------------------------------------------------
    def admit(self, job_id: int, specs: Sequence[KeySpec], priority: int, woken: list[int]) -> bool:
        """Admit a new job on all its keys (True) or park it on the first full one (False).
        Changed limits and reserves of keys in use are stored first; where room appeared,
        waiters are served before the newcomer competes. Jobs that got their last key
        meanwhile are appended to `woken`."""
        limits, reserves = self.limits, self.reserves
        changed = [
            (spec[0], spec[1], min(spec[4], spec[1]))
            for spec in specs
            if spec[0] in limits and (limits[spec[0]] != spec[1] or reserves[spec[0]] != min(spec[4], spec[1]))
        ]
        if changed:
            self._store(changed, woken)
        job = _Job(specs, 255 - priority)
        self.jobs[job_id] = job
        return self._grant(job_id, job)

    def release(self, job_id: int, woken: list[int]) -> bool:
        """Free every key the job holds (or withdraw it, if parked), handing slots on."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return False
        self._drop(job, woken)
        return True

    def cancel(self, job_id: int, woken: list[int]) -> bool:
        """Withdraw a parked job (an admitted one stays), handing on what it held."""
        job = self.jobs.get(job_id)
        if job is None or job.running:
            return False
        del self.jobs[job_id]
        self._drop(job, woken)
        return True

    def set_limits(self, limits: dict[str, int], woken: list[int], reserves: dict[str, int] | None = None) -> None:
        """Store limits and reserves (a key missing from `reserves` gets none, as a limit
        passed without one does); where room appeared, hand on (reverse canonical order)."""
        reserves = reserves or {}
        self._store(sorted((k, v, min(reserves.get(k, 0), v)) for k, v in limits.items()), woken)

    def is_parked(self, job_id: int) -> bool:
        job = self.jobs.get(job_id)
        return job is not None and not job.running

    def count(self, key: str) -> int:
        return self.counts.get(key, 0)

    def waiting_order(self, key: str) -> list[int]:
        """A key's waiters, head first (O(n log n): tests)."""
        jobs = self.jobs
        entries = [
            (p, e)
            for p, heap in self.queues.get(key, {}).items()
            for e in heap
            if e[3] in jobs and jobs[e[3]].entry is e
        ]
        return [e[3] for _, e in sorted(entries)]

    # --- internals ----------------------------------------------------------------------
    def _store(self, items: Sequence[tuple[str, int, int]], woken: list[int]) -> None:
        """Store (key, limit, effective reserve) items; hand on each key where a waiter may
        now fit: its limit rose (the floor band's room) or its limit less its reserve did
        (the general band's)."""
        limits, reserves = self.limits, self.reserves
        raised = [
            name
            for name, limit, reserve in items
            if name not in limits or limit > limits[name] or limit - reserve > limits[name] - reserves[name]
        ]
        for name, limit, reserve in items:
            limits[name] = limit
            reserves[name] = reserve
        for name in reversed(raised):
            self._handoff(name, woken)

    def _within(self, spec: KeySpec) -> bool:
        """Whether a job now holding the keys before `spec`'s is within its guarantee there."""
        guard = spec[5]
        return guard is not None and self.counts[guard] <= spec[6]

    def _grant(self, job_id: int, job: _Job) -> bool:
        specs, limits, reserves, counts = job.specs, self.limits, self.reserves, self.counts
        while job.n < len(specs):
            spec = specs[job.n]
            name = spec[0]
            # An idle key has forgotten its limit and reserve: the job brings the ones it passed.
            if name not in limits:
                limits[name] = spec[1]
                reserves[name] = min(spec[4], spec[1])
            limit = limits[name]
            c = counts.get(name, 0)
            if c >= limit - reserves[name] and not (c < limit and self._within(spec)):
                self._park(job_id, job, name, spec[2], spec[3], self._within(spec))
                return False
            counts[name] = c + 1
            job.n += 1
        job.running = True
        return True

    def _park(self, job_id: int, job: _Job, key: str, flow: str, cost: int, floor: bool) -> None:
        self.seq += 1
        p = job.bp = job.p - FLOOR_BAND if floor else job.p
        fk = (key, p, flow)
        rec = self.flows.get(fk)
        if rec is not None:  # the flow has waiters here: it goes on from its last finish tag
            tag, start = rec[0], rec[1]
            rec[0] = min(tag + cost, TAG_MAX)
            rec[2] += 1
        else:  # a new backlog: at the key's virtual time (its head's tag at this priority)
            head = self._head(key, p)
            tag, start = (head[0] if head is not None else 0), self.seq
            self.flows[fk] = [min(tag + cost, TAG_MAX), start, 1]
        entry = (tag, start, self.seq, job_id)
        job.entry = entry
        by_p = self.queues.get(key)
        if by_p is None:
            by_p = self.queues[key] = {}
        heap = by_p.get(p)
        if heap is None:
            by_p[p] = [entry]
        else:
            heapq.heappush(heap, entry)

    def _head(self, key: str, p: int) -> Entry | None:
        """The live head of key's queue at priority p (drops withdrawn entries on top)."""
        by_p = self.queues.get(key)
        if not by_p or p not in by_p:
            return None
        heap = by_p[p]
        while heap:
            e = heap[0]
            job = self.jobs.get(e[3])
            if job is not None and job.entry is e:
                return e
            heapq.heappop(heap)
        del by_p[p]
        if not by_p:
            del self.queues[key]
        return None

    def _left(self, job: _Job, key: str) -> None:
        """One waiter of job's flow left key's queue (served or withdrawn)."""
        fk = (key, job.bp, job.specs[job.n][2])
        rec = self.flows[fk]
        rec[2] -= 1
        if not rec[2]:
            del self.flows[fk]
        job.entry = None

    def _handoff(self, key: str, woken: list[int]) -> None:
        by_p = self.queues.get(key)
        if not by_p:
            return
        limit = self.limits.get(key, 0)
        kept = limit - self.reserves.get(key, 0)  # the general band's room ends here
        counts, jobs = self.counts, self.jobs
        c = counts.get(key, 0)
        while c < limit and by_p:
            p = min(by_p)
            if p >= 0 and c >= kept:
                break  # the head is of the general band: the reserved slots stay kept
            heap = by_p[p]
            e = heapq.heappop(heap)
            if not heap:
                del by_p[p]
            job_id = e[3]
            job = jobs.get(job_id)
            if job is None or job.entry is not e:
                continue  # withdrawn
            self._left(job, key)
            c += 1
            counts[key] = c
            job.n += 1
            if self._grant(job_id, job):
                woken.append(job_id)
        if not by_p:
            del self.queues[key]

    def _drop(self, job: _Job, woken: list[int]) -> None:
        specs = job.specs
        if not job.running:  # parked: its entry is withdrawn (lazily, see _head)
            self._left(job, specs[job.n][0])
        counts, limits, reserves = self.counts, self.limits, self.reserves
        for i in range(job.n):
            key = specs[i][0]
            counts[key] -= 1
            self._handoff(key, woken)
            if not counts[key]:
                del counts[key]
                # Idle unless every slot is reserved (then floor-less waiters may remain):
                # nobody can wait, and its limit and reserve are forgotten.
                if limits[key] > reserves[key]:
                    del limits[key], reserves[key]
