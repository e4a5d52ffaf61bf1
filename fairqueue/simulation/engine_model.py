"""The engine's semantics as a fast in-memory model, for the what-if simulation.

Same rules as the Lua (lua/_lib.lua, docs/engine.md) and as the test suite's reference
model (tests/test_engine_model.Model, which states them naively; tests/test_simulation
checks that this one agrees with it on random operations):

- a job takes its keys in canonical (sorted) order and parks on the first full one,
  keeping what it holds;
- a key's waiters are served by priority, then by virtual start tag (start-time fair
  queueing across flows, weighted by cost), then by the start of their flow's backlog,
  then by arrival: FIFO within a flow;
- a release hands each freed slot to the key's head waiter in the same step, which goes on
  to its later keys; a raised limit hands on too, in reverse canonical order;
- an idle key forgets its limit and the next job to use it brings its own.

What the simulation does not need is left out: leases (nothing dies in a replay), data,
inspection. Where the reference model keeps sorted lists, this one keeps one heap per
(key, priority) and withdraws a cancelled waiter lazily, so every operation costs O(log n).
Job ids are ints.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

# A virtual tag stops growing here: TAG_MAX in lua/_lib.lua (exact in a double's 53 bits).
TAG_MAX = 2**53 - 1
# A job's keys as the engine takes them: (name, limit, flow, cost), sorted by name
# (fairqueue.engine.ops.key_specs builds them from KeyLimits, with flow_cost).
KeySpec = tuple[str, int, str, int]
Entry = tuple[int, int, int, int]  # (virtual start tag, backlog start, arrival seq, job)


class _Job:
    __slots__ = ("entry", "n", "p", "running", "specs")

    def __init__(self, specs: Sequence[KeySpec], p: int) -> None:
        self.specs = specs
        self.p = p  # 255 - priority: lower is served first
        self.n = 0  # index of the next key to take; len(specs) once it holds them all
        self.running = False
        self.entry: Entry | None = None  # its wait entry while parked


class EngineModel:
    """Keys, limits, waiter queues and flow records of one engine tag."""

    def __init__(self) -> None:
        self.limits: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        # key -> 255-priority -> heap of entries; a heap may hold withdrawn entries (their
        # job's `entry` is no longer that tuple), skipped when met.
        self.queues: dict[str, dict[int, list[Entry]]] = {}
        # (key, 255-priority, flow) -> [finish tag, backlog start, waiters]: only while waiters > 0
        self.flows: dict[tuple[str, int, str], list[int]] = {}
        self.jobs: dict[int, _Job] = {}
        self.seq = 0

    # --- operations -------------------------------------------------------------------
    def admit(self, job_id: int, specs: Sequence[KeySpec], priority: int, woken: list[int]) -> bool:
        """Admit a new job on all its keys (True) or park it on the first full one (False).
        Changed limits of keys in use are stored first; where one rose, its waiters are
        served before the newcomer competes. Jobs that got their last key meanwhile are
        appended to `woken`."""
        limits = self.limits
        changed = [(name, limit) for name, limit, _, _ in specs if name in limits and limits[name] != limit]
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

    def set_limits(self, limits: dict[str, int], woken: list[int]) -> None:
        """Store limits; where one rose, hand on (in reverse canonical order)."""
        self._store(sorted(limits.items()), woken)

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
    def _store(self, items: Sequence[tuple[str, int]], woken: list[int]) -> None:
        limits = self.limits
        raised = [name for name, limit in items if name not in limits or limit > limits[name]]
        limits.update(items)
        for name in reversed(raised):
            self._handoff(name, woken)

    def _grant(self, job_id: int, job: _Job) -> bool:
        specs, limits, counts = job.specs, self.limits, self.counts
        while job.n < len(specs):
            name, limit, flow, cost = specs[job.n]
            # An idle key has forgotten its limit: the job brings the one it passed.
            held_limit = limits.setdefault(name, limit)
            c = counts.get(name, 0)
            if c >= held_limit:
                self._park(job_id, job, name, flow, cost)
                return False
            counts[name] = c + 1
            job.n += 1
        job.running = True
        return True

    def _park(self, job_id: int, job: _Job, key: str, flow: str, cost: int) -> None:
        self.seq += 1
        p = job.p
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
        fk = (key, job.p, job.specs[job.n][2])
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
        counts, jobs = self.counts, self.jobs
        c = counts.get(key, 0)
        while c < limit and by_p:
            p = min(by_p)
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
        counts, limits = self.counts, self.limits
        for i in range(job.n):
            key = specs[i][0]
            counts[key] -= 1
            self._handoff(key, woken)
            if not counts[key]:
                del counts[key]
                if limits[key] > 0:  # idle (nobody can wait): its limit is forgotten
                    del limits[key]
