"""Replay arrivals through a model of FairQueue's scheduling, event by event.

What is modelled, and with which code:

- **Admission** at submit: the job's keys, limits, flows and priority come from
  `fairqueue.jobs.admission.admission_plan` (sub-tenant, tenant or batch key, shard key),
  with the signals of the last limit refresh, as a web process caches them; the engine's
  decision is `engine_model.EngineModel` (same rules as the Lua).
- **The limit refresh** every `refresh_seconds` (the duty tick runs every 0.25 s; the model
  every IDLE_REFRESH_SECONDS while no job waits for a slot):
  `fairqueue.jobs.limits_plan.limits_plan` (fair shares, idle shares, the limit formula of
  tenants.limits) on simulated signals: submissions per rate-ring interval (median, as
  `live.rate_from_ring`), the exponentially weighted mean of finished durations, the slots,
  the engine's in-flight count; then `set_limits` on the shard's keys (the batch key's via
  `admission.batch_limits`), which hands on where a limit rose.
- **Dispatch**: a job admitted at submit reaches the broker an *admit* latency after it
  was submitted, a woken one at once (the process that woke it publishes it); workers'
  `slots` take messages by latency class (strict priority, FIFO within), the batch lane
  only when nothing else waits. A slot that was idle starts its message a *dispatch*
  latency later (fetch, claim); a slot is busy for the job's measured duration and is
  free again a *turnaround* after the job ends (ack, fetch, claim: a message that waited
  for it starts then). The job's keys are released when it ends (the release hands slots
  on in the same step). These latencies are drawn per job (seeded) from distributions
  measured on the replayed rows (`calibration.latencies_measure`).
- **Batch promotion**: a batch job still parked after BATCH_PROMOTE_AT of the batch
  objective leaves the batch lane and is admitted again like any job.

Not modelled: worker deaths and leases, Redis outages, moves, other shards' load on the
pool (give `slots` the share of the fleet this shard can use), the per-process caches'
staleness below one refresh period.

Speed: one heap of timed events (finish, slot free, broker arrival, promotion), arrivals
read in order, refreshes and samples at fixed periods; a refresh with nothing changed since
the last one (no admit, release or finish, same rate interval) is skipped, its plan being
the same. Every engine operation is O(log n).
"""

from __future__ import annotations

import collections
import heapq
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from fairqueue.engine.ops import KeySpec, key_specs
from fairqueue.jobs import live
from fairqueue.jobs.admission import (
    BATCH_KEY,
    SHARD_KEY,
    LiveSignals,
    admission_plan,
    batch_limits,
    class_level,
    pool_room,
    shard_reserve,
    tenant_key,
)
from fairqueue.jobs.duties import BATCH_PROMOTE_AT
from fairqueue.jobs.limits_plan import LimitsPlan, limits_plan
from fairqueue.simulation.calibration import ACTIVITY_WINDOW_S, Distribution, Latencies
from fairqueue.simulation.engine_model import EngineModel
from fairqueue.simulation.records import Arrival
from tenants.policy import PolicySnapshot

# The duty tick's period: fairqueue.jobs.worker.TICK_SECONDS (kept equal by hand: this
# model imports no worker), jittered like the worker's ticker (0.5x to 1.5x of it, uniformly).
REFRESH_SECONDS = 0.25
REFRESH_JITTER = (0.5, 1.5)
# While no job waits for a slot (none parked, none in the broker), the model refreshes this
# often instead: the time a refresh costs goes to the periods where it decides something.
IDLE_REFRESH_SECONDS = 2.0
DEFAULT_SAMPLES = 120
# After its last event, a replay with jobs still waiting ticks the refresh this many more
# times (a raised limit may free them) before it calls them stranded.
STRANDED_TICKS = 20

_FINISH, _SLOT_FREE, _READY, _PROMOTE = 0, 1, 2, 3


@dataclass(frozen=True)
class SimConfig:
    slots: int
    # The stack's latencies, drawn per job from these measured distributions (seconds;
    # empty: none). admit: submit -> the engine's decision (the row is written first);
    # dispatch: admitted -> started on a free slot; turnaround: a slot's gap between a
    # finish and its next start.
    latencies: Latencies = field(default_factory=Latencies)
    seed: int = 0
    refresh_seconds: float = REFRESH_SECONDS
    samples: int = DEFAULT_SAMPLES
    start: float | None = None  # the window's start (default: the first arrival)
    end: float | None = None  # its end, for utilisation and the series (default: last finish)


@dataclass
class SimResult:
    waits: dict[str, list[float]]  # per tenant, seconds from submit to start
    job_waits: list[float]  # per arrival, in the order given (NaN: never started)
    busy_seconds: float  # slot-seconds of job bodies inside [start, end]
    backlog_seconds: float  # time a job was parked, or ready with no slot free
    backlog_busy_seconds: float  # slot-seconds of job bodies in that time
    slots: int
    start: float
    end: float
    series_t: list[float] = field(default_factory=list)  # seconds after start
    # The most jobs submitted and not started at once, per sample interval (so a short
    # burst shows whatever the sampling step).
    series_waiting: list[int] = field(default_factory=list)
    peak_waiting: int = 0
    series_by_tenant: dict[str, list[int]] = field(default_factory=dict)
    refreshes: int = 0
    skipped: int = 0  # arrivals of tenants the policy does not know
    stranded: int = 0  # never started (a limit of 0, no slots)
    elapsed_s: float = 0.0

    @property
    def backlog_utilisation(self) -> float | None:
        """The pool's use while jobs waited for it (bench noisy's utilisation, without its
        0.1 s grace): below 1, slots idled while someone waited."""
        if self.backlog_seconds <= 0 or self.slots <= 0:
            return None
        return self.backlog_busy_seconds / (self.slots * self.backlog_seconds)

    @property
    def utilisation(self) -> float | None:
        span = self.end - self.start
        return self.busy_seconds / (self.slots * span) if span > 0 and self.slots > 0 else None


def ewma(mean: float | None, seconds: float) -> float:
    """A tenant's mean duration after one more job: lua/update_mean.lua's exponentially
    weighted mean, with the weight live.record_finish gives it."""
    return seconds if mean is None else mean + live.MEAN_ALPHA * (seconds - mean)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class _Replay:
    """The state of one run; `run` is the event loop."""

    def __init__(
        self,
        arrivals: Sequence[Arrival],
        policy: PolicySnapshot,
        shard: str,
        config: SimConfig,
        history: Sequence[tuple[float, str]],
        initial_means: dict[str, float],
    ) -> None:
        if config.slots < 0:
            raise ValueError(f"slots must be >= 0, got {config.slots}")
        if not config.refresh_seconds > 0:
            raise ValueError(f"refresh_seconds must be > 0, got {config.refresh_seconds}")
        if shard not in policy.shards:
            raise ValueError(f"shard {shard!r} is not in the policy")
        self.arrivals = arrivals
        self.policy = policy
        self.shard = shard
        self.config = config
        self.model = EngineModel()
        self.tenants = sorted(slug for slug, tp in policy.tenants.items() if tp.shard == shard)
        self.window = policy.pool.rate_window_seconds
        # The rate ring's interval (live._ring_add buckets submissions the same way).
        self.bucket = live._bucket_seconds(self.window)
        self.rings: dict[str, dict[int, int]] = {slug: {} for slug in self.tenants}
        for at, slug in history:
            if slug in self.rings:
                ring = self.rings[slug]
                b = int(at // self.bucket)
                ring[b] = ring.get(b, 0) + 1
        self.means: dict[str, float] = {s: m for s, m in initial_means.items() if s in self.rings}
        self.start = 0.0  # set by run
        self.rng = random.Random(config.seed)
        self.admit_latency = config.latencies.admit
        self.pickup_latency = config.latencies.dispatch
        self.turnaround_latency = config.latencies.turnaround
        self.plan: LimitsPlan | None = None  # the last tick's
        # The submitting process's caches (see specs).
        self.fleet_at = -math.inf
        self.fleet = (0, 0)
        self.signals_at: dict[str, float] = {}
        self.signals: dict[str, tuple[float, float | None, int, float | None]] = {}  # rate, mean, shares
        self.rates: dict[str, tuple[int, float]] = {}  # rate interval, rate
        self.specs_cache: dict[str, dict[tuple[str, bool, int], tuple[list[KeySpec], int]]] = {}
        self.dirty = True
        self.last_bucket = -1
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.broker: list[tuple[int, int, int, int, float]] = []  # (lane, level, seq, job, ready at)
        self.clock = 0.0  # the time of the step being processed (draw reads it)
        self.recent_starts: collections.deque[float] = collections.deque()  # start times, last window
        # When each free slot freed (-inf: never used), the longest-free first.
        self.free_slots: collections.deque[float] = collections.deque([-math.inf] * config.slots)
        self.levels = {name: class_level(policy, name) for name in policy.classes}
        self.default_level = class_level(policy, "default")
        # Per engine job id: the arrival index, and whether it sits in the batch lane.
        self.index: list[int] = []
        self.in_batch: list[bool] = []
        self.job_waits = [math.nan] * len(arrivals)
        self.waiting: dict[str, int] = dict.fromkeys(self.tenants, 0)
        self.waiting_total = 0
        self.peak = 0  # the most jobs waiting at once since the last sample
        self.peak_all = 0  # ... in the whole run
        self.busy = 0.0
        self.running = 0  # jobs started, not finished
        self.parked = 0  # jobs parked in the engine
        self.last_step = 0.0
        self.backlog_seconds = 0.0
        self.backlog_busy = 0.0
        self.refreshes = 0
        self.skipped = 0

    # --- limits -------------------------------------------------------------------------
    def rate(self, slug: str, now: float) -> float:
        """Submissions per minute as live.tenant_signals_read reads them at `now`."""
        ring = self.rings.get(slug)
        if not ring:
            return 0.0
        cur = int(now // self.bucket)
        # Complete intervals only, and submissions only land in the current one: a rate
        # holds for as long as the interval does.
        cached = self.rates.get(slug)
        if cached is not None and cached[0] == cur:
            return cached[1]
        counts = [ring.get(cur - i, 0) for i in range(1, live.RING_BUCKETS + 1)]
        rate = live.rate_from_ring(counts, window_seconds=self.window)
        self.rates[slug] = (cur, rate)
        return rate

    def in_flight(self) -> tuple[int, int]:
        """(non-batch, batch) jobs holding their slots, as live.fleet_state counts them:
        holders of the shard key less the batch lane's, and the batch lane's."""
        batch = self.model.count(BATCH_KEY)
        return max(self.model.count(SHARD_KEY) - batch, 0), batch

    def refresh(self, now: float) -> None:
        """The duty tick's limits_refresh."""
        cur = int(now // self.bucket)
        if not self.dirty and cur == self.last_bucket and self.plan is not None:
            return
        self.dirty, self.last_bucket = False, cur
        self.refreshes += 1
        slots = self.config.slots
        in_flight, batch_in = self.in_flight()
        signals = {
            slug: LiveSignals(
                rate_per_min=self.rate(slug, now),
                mean_seconds=self.means.get(slug),
                pool_slots=slots,
                in_flight=in_flight,
            )
            for slug in self.policy.tenants
        }
        held = {slug: self.model.count(tenant_key(slug)) for slug in self.tenants}
        plan = limits_plan(policy=self.policy, signals=signals, held=held, slots=slots, in_flight=in_flight + batch_in)
        self.plan = plan
        limits = {SHARD_KEY: self.shard_limit(), BATCH_KEY: self.batch_limit(in_flight, batch_in)}
        for slug in self.tenants:
            limits[tenant_key(slug)] = plan.limit(slug)
        woken: list[int] = []
        self.model.set_limits(limits, woken, reserves={SHARD_KEY: shard_reserve(self.policy)})
        for job in woken:
            self.dispatch(job, now)

    def batch_limit(self, in_flight: int, batch_in: int) -> int:
        return batch_limits(
            pool_slots=self.config.slots,
            target_utilisation=self.policy.pool.target_utilisation,
            in_flight=in_flight,
            batch_by_shard={self.shard: batch_in},
        )[self.shard]

    def shard_limit(self) -> int:
        """The shard key's limit: its capacity, capped at the pool's slots (the model's one
        shard has them all: admission.pool_room)."""
        room = pool_room(slots=self.config.slots, held_by_shard={}, shard=self.shard)
        capacity = self.policy.shards[self.shard].capacity
        return capacity if room is None else min(capacity, room)

    def specs(self, a: Arrival, batch_lane: bool, now: float) -> tuple[list[KeySpec], int]:
        """The job's keys as the submitting process computes them: from its own caches of
        the fleet state (in-flight) and of the tenant's signals (rate, mean, the shares the
        last tick published), each refreshed when older than live's TTLs. Between two
        ticks an admit may pass a lower limit than the tick set (the engine stores it):
        that is what the fleet does too."""
        if now - self.fleet_at >= live.FLEET_TTL_SECONDS:
            self.fleet_at = now
            self.fleet = self.in_flight()
            self.specs_cache.clear()
        slug = a.tenant
        if now - self.signals_at.get(slug, -math.inf) >= live.SIGNAL_TTL_SECONDS:
            assert self.plan is not None
            self.signals_at[slug] = now
            self.signals[slug] = (
                self.rate(slug, now),
                self.means.get(slug),
                self.plan.idle.get(slug, 0),
                self.plan.fair.get(slug),
            )
            self.specs_cache.pop(slug, None)
        cached = self.specs_cache.get(slug)
        if cached is None:
            cached = self.specs_cache[slug] = {}
        cache_key = (a.sub_tenant, batch_lane, a.priority)
        hit = cached.get(cache_key)
        if hit is None:
            rate, mean, idle, fair = self.signals[slug]
            signals = LiveSignals(
                rate_per_min=rate,
                mean_seconds=mean,
                pool_slots=self.config.slots,
                in_flight=self.fleet[0],
                idle_share=idle,
                fair_share=fair,
            )
            plan = admission_plan(
                policy=self.policy,
                tenant=self.policy.tenants[slug],
                sub_tenant=a.sub_tenant,
                priority=a.priority,
                signals=signals,
                batch=batch_lane,
                batch_limit=self.batch_limit(*self.fleet),
                pool_room=pool_room(slots=self.config.slots, held_by_shard={}, shard=self.shard),
            )
            hit = cached[cache_key] = (key_specs(plan.keys), plan.priority)
        return hit

    def draw(self, latency: Distribution) -> float:
        """A latency at the model's current activity (jobs started in the last window, per
        slot), as the stack showed it at that activity."""
        now, starts = self.clock, self.recent_starts
        while starts and starts[0] <= now - ACTIVITY_WINDOW_S:
            starts.popleft()
        return latency.draw(self.rng.random(), len(starts) / max(self.config.slots, 1))

    # --- events -------------------------------------------------------------------------
    def push(self, at: float, kind: int, job: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, job))

    def admit(self, index: int, now: float, batch_lane: bool) -> None:
        a = self.arrivals[index]
        job = len(self.index)
        self.index.append(index)
        self.in_batch.append(batch_lane)
        specs, priority = self.specs(a, batch_lane, now)
        woken: list[int] = []
        admitted = self.model.admit(job, specs, priority, woken)
        if not admitted:
            self.parked += 1
        self.dirty = True
        for w in woken:
            self.dispatch(w, now)
        if admitted:
            self.dispatch(job, now, self.draw(self.admit_latency))
        elif batch_lane:
            promote_at = a.at + self.policy.pool.batch_objective_seconds * BATCH_PROMOTE_AT
            self.push(max(promote_at, now), _PROMOTE, job)

    def dispatch(self, job: int, now: float, delay: float | None = None) -> None:
        """Publish a job that got all its keys: it enters the broker `delay` later (a job
        admitted at submit: the web process's admit latency), or now (a job woken by a
        release or a refresh: the process that woke it publishes it at once)."""
        if delay is None:
            self.parked -= 1
            delay = 0.0
        if delay > 0:
            self.push(now + delay, _READY, job)
        else:
            self.ready(job, now)

    def ready(self, job: int, now: float) -> None:
        a = self.arrivals[self.index[job]]
        lane = 1 if self.in_batch[job] else 0
        self.seq += 1
        level = self.levels.get(a.latency_class, self.default_level)
        heapq.heappush(self.broker, (lane, level, self.seq, job, now))
        self.start_jobs(now)

    def start_jobs(self, now: float) -> None:
        """Free slots take the broker's head messages. A slot that waited for its message
        starts the job a pickup latency later (the worker fetches and claims it); one the
        message waited for starts it at once, its turnaround having covered that."""
        broker, free, end = self.broker, self.free_slots, self.config.end
        while free and broker:
            freed = free.popleft()
            _, _, _, job, ready_at = heapq.heappop(broker)
            start = now + self.draw(self.pickup_latency) if ready_at >= freed else now
            self.recent_starts.append(now)
            index = self.index[job]
            a = self.arrivals[index]
            self.running += 1
            self.job_waits[index] = start - a.at
            self.waiting[a.tenant] -= 1
            self.waiting_total -= 1
            finish = start + a.duration
            self.busy += max(0.0, (min(finish, end) if end is not None else finish) - max(start, self.start))
            self.push(finish, _FINISH, job)

    def finish(self, job: int, now: float) -> None:
        a = self.arrivals[self.index[job]]
        woken: list[int] = []
        self.model.release(job, woken)
        self.running -= 1
        self.dirty = True
        if not a.batch:  # live.record_finish: batch work says nothing of interactive load
            self.means[a.tenant] = ewma(self.means.get(a.tenant), a.duration)
        for w in woken:
            self.dispatch(w, now)
        turnaround = self.draw(self.turnaround_latency)
        if turnaround > 0:
            self.push(now + turnaround, _SLOT_FREE, job)
        else:
            self.free_slots.append(now)
            self.start_jobs(now)

    def promote(self, job: int, now: float) -> None:
        woken: list[int] = []
        if not self.model.cancel(job, woken):
            return  # it got its slot meanwhile
        self.parked -= 1
        self.dirty = True
        for w in woken:
            self.dispatch(w, now)
        self.admit(self.index[job], now, batch_lane=False)

    def advance(self, now: float) -> None:
        """Account the time since the last step: slot-seconds busy while a backlog existed
        (a job parked, or ready in the broker with no slot free)."""
        self.clock = now
        if self.parked > 0 or self.broker:
            dt = now - self.last_step
            self.backlog_seconds += dt
            self.backlog_busy += self.running * dt
        self.last_step = now

    # --- the loop -----------------------------------------------------------------------
    def run(self) -> SimResult:
        t0 = time.perf_counter()
        arrivals, events, config = self.arrivals, self.events, self.config
        n = len(arrivals)
        self.start = config.start if config.start is not None else (arrivals[0].at if n else 0.0)
        self.last_step = self.start
        horizon = (config.end if config.end is not None else (arrivals[-1].at if n else self.start)) - self.start
        step = max(horizon, config.refresh_seconds) / max(config.samples, 1)
        next_refresh, next_sample = self.start, self.start
        last_refresh, thinned = self.start, False
        series_t: list[float] = []
        series_waiting: list[int] = []
        by_tenant: dict[str, list[int]] = {slug: [] for slug in self.tenants}
        i, idle_ticks = 0, 0
        inf = math.inf
        while True:
            t_arr = arrivals[i].at if i < n else inf
            t_ev = events[0][0] if events else inf
            t = t_arr if t_arr < t_ev else t_ev
            if t == inf:
                # Nothing left to happen but refreshes: jobs still waiting may be freed by
                # one (a raised limit); a few in vain and they are stranded.
                if self.waiting_total == 0 or idle_ticks >= STRANDED_TICKS:
                    break
                idle_ticks += 1
                self.dirty = True
                t = next_refresh
            if next_refresh < t and self.waiting_total == 0:
                # Nobody waits: a refresh before t could wake nobody, and one at t leaves the
                # next admission what the last of them would have (nothing changes between).
                next_refresh = t
            if thinned and (self.parked or self.broker):
                # Jobs wait again: back to the fleet's period, from the last refresh.
                thinned = False
                next_refresh = max(
                    self.clock, last_refresh + config.refresh_seconds * self.rng.uniform(*REFRESH_JITTER)
                )
                continue
            if next_refresh <= t:
                self.advance(next_refresh)
                self.refresh(next_refresh)
                last_refresh, period = next_refresh, config.refresh_seconds
                thinned = self.parked == 0 and not self.broker and period < IDLE_REFRESH_SECONDS
                if thinned:
                    # Nothing waits for a slot: a refresh could wake nobody, and only what
                    # it publishes for the next admissions (the shares) would be newer.
                    period = IDLE_REFRESH_SECONDS
                next_refresh += period * self.rng.uniform(*REFRESH_JITTER)
                continue
            if next_sample <= t:
                series_t.append(round(next_sample - self.start, 3))
                series_waiting.append(self.peak)
                self.peak = self.waiting_total
                for slug, values in by_tenant.items():
                    values.append(self.waiting[slug])
                next_sample += step
                continue
            self.advance(t)
            if t_arr <= t_ev:
                a = arrivals[i]
                if a.tenant in self.rings:
                    ring = self.rings[a.tenant]
                    b = int(a.at // self.bucket)
                    ring[b] = ring.get(b, 0) + 1
                    self.waiting[a.tenant] += 1
                    self.waiting_total += 1
                    if self.waiting_total > self.peak:
                        self.peak = self.waiting_total
                        self.peak_all = max(self.peak_all, self.peak)
                    self.admit(i, a.at, batch_lane=a.batch)
                else:
                    self.skipped += 1
                i += 1
                continue
            at, _, kind, job = heapq.heappop(events)
            if kind == _FINISH:
                self.finish(job, at)
            elif kind == _READY:
                self.ready(job, at)
            elif kind == _SLOT_FREE:
                self.free_slots.append(at)
                self.start_jobs(at)
            else:
                self.promote(job, at)
        end = config.end if config.end is not None else max(self._last_finish(), self.start)
        waits: dict[str, list[float]] = {slug: [] for slug in self.tenants}
        for a, w in zip(arrivals, self.job_waits, strict=True):
            if not math.isnan(w):
                waits[a.tenant].append(w)
        return SimResult(
            waits=waits,
            job_waits=self.job_waits,
            busy_seconds=self.busy,
            backlog_seconds=self.backlog_seconds,
            backlog_busy_seconds=self.backlog_busy,
            slots=config.slots,
            start=self.start,
            end=end,
            series_t=series_t,
            series_waiting=series_waiting,
            peak_waiting=self.peak_all,
            series_by_tenant=by_tenant,
            refreshes=self.refreshes,
            skipped=self.skipped,
            stranded=self.waiting_total,
            elapsed_s=time.perf_counter() - t0,
        )

    def _last_finish(self) -> float:
        return max(
            (
                self.arrivals[i].at + w + self.arrivals[i].duration
                for i, w in enumerate(self.job_waits)
                if not math.isnan(w)
            ),
            default=self.start,
        )


def simulate(
    arrivals: Sequence[Arrival],
    *,
    policy: PolicySnapshot,
    shard: str,
    config: SimConfig,
    history: Sequence[tuple[float, str]] = (),
    initial_means: dict[str, float] | None = None,
) -> SimResult:
    """Replay `arrivals` (sorted by `at`) of `shard` under `policy`. `history`: (submit
    time, tenant) of submissions before the window, to fill the rate ring as the fleet had
    it; `initial_means`: each tenant's mean duration at the start."""
    return _Replay(arrivals, policy, shard, config, history, initial_means or {}).run()
