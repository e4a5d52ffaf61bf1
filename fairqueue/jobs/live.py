"""Live signals for the limit formula: submission rate, mean duration, fleet size, in-flight.

Hot-path cost is bounded: a tenant's signals are cached per process for
SIGNAL_TTL_SECONDS; refreshing them is one pipelined round trip of fixed size (its rate
ring, its mean, and the submissions counted locally since the last refresh). The fleet
state is cached the same way and read off the worker registry and the engine's counters,
never fetched inline per job.

R (submissions per minute) is the *median* per-interval count over the rate window, so a
tenant that submits steadily earns a higher base than one that sent the same number of
jobs in a single burst: the floor is earned by behaviour, not by spikes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis

from fairqueue.engine.scripts import LUA_DIR
from fairqueue.jobs.admission import (
    BATCH_KEY,
    QUARANTINE_KEY,
    SHARD_KEY,
    LiveSignals,
    batch_limits,
    pool_room,
    shard_tag,
)
from fairqueue.jobs.fleet import fleet_read
from fairqueue.jobs.runtime import engine, redis_client
from tenants.policy import PolicySnapshot, policy_snapshot

SIGNAL_TTL_SECONDS = 1.0
FLEET_TTL_SECONDS = 1.0
RING_BUCKETS = 10
MEAN_ALPHA = 0.2
MEAN_TTL_SECONDS = 24 * 3600
MEAN_FLUSH_SECONDS = 2 * SIGNAL_TTL_SECONDS

_MEAN_SOURCE = (LUA_DIR / "update_mean.lua").read_text()
_MEAN_SHA = hashlib.sha1(_MEAN_SOURCE.encode()).hexdigest()


def _mean_calls(durations: list[tuple[str, float]]) -> list[tuple[str, list[float]]]:
    """The durations by tenant, each tenant's in order (one script call per tenant)."""
    by_slug: dict[str, list[float]] = {}
    for slug, seconds in durations:
        by_slug.setdefault(slug, []).append(seconds)
    return list(by_slug.items())


def _queue_means(pipe: Any, durations: list[tuple[str, float]]) -> int:
    """Queue the EWMA updates on a pipeline (EVALSHA: no per-call script existence check),
    one call per tenant carrying its durations in order; returns the calls queued.

    Sent as a raw command: redis-py's cluster pipeline refuses its `evalsha` method, though
    it routes EVALSHA by its keys like any other command (one key here)."""
    calls = _mean_calls(durations)
    for slug, seconds in calls:
        first, *more = (f"{s:.6f}" for s in seconds)
        pipe.execute_command("EVALSHA", _MEAN_SHA, 1, mean_key(slug), first, MEAN_ALPHA, MEAN_TTL_SECONDS, *more)
    return len(calls)


def _execute(pipe: Any, durations: list[tuple[str, float]]) -> tuple[list[Any], bool]:
    """Run a pipeline that starts with queued mean updates; if Redis lost the script
    (a restart), load it and redo just those updates. Returns the other results and
    whether the updates were redone (reads in the pipeline then predate them)."""
    queued = len(_mean_calls(durations))
    results: list[Any] = pipe.execute(raise_on_error=False)
    redone = any(isinstance(r, redis.exceptions.NoScriptError) for r in results[:queued])
    if redone:
        redis_client().script_load(_MEAN_SOURCE)
        retry = redis_client().pipeline(transaction=False)
        _queue_means(retry, durations)
        retry.execute()
    for r in results[queued:]:
        if isinstance(r, Exception):
            raise r
    return results[queued:], redone


# The tick's shares are published in one MULTI, so they share a Redis Cluster hash tag.
SHARES_KEY = "fq:{limits}:idle_share"  # HASH slug -> bonus; expires if no worker ticks
SHARES_TTL_SECONDS = 3
SHARES_MIN_TTL_MS = 1000  # a publication with less left is written whole (it may expire mid-write)
FAIR_SHARES_KEY = "fq:{limits}:fair_share"  # HASH slug -> max-min fair share of the pool target
SHARD_CAPS_KEY = "fq:{limits}:shard_cap"  # HASH slug -> cap where its shard binds (tenants.limits.shard_caps)
TICK_LIMITS_KEY = "fq:{limits}:tick_limit"  # HASH slug -> "<limit the tick set> <held elsewhere in it>"
SHARES_MARKER_KEY = "fq:{limits}:published"  # the last publisher's token (see shares_publish)
# A fresh token each time a publication changes a field of the four hashes (it expires
# with them): a reader that kept them at one token needs not read them again while it stays.
SHARES_VERSION_KEY = "fq:{limits}:version"
# HASH "t:<slug>" / "s:<shard>" -> slots still held at a place a tenant or shard was moved
# away from (fairqueue.jobs.moves publishes it; empty but during a move).
HELD_ELSEWHERE_KEY = "fq:{limits}:held_elsewhere"


RING_EPOCH_KEY = "fq:rate:epoch"  # bumped when a completed bucket is written (tests)


def rate_key(slug: str) -> str:
    return f"fq:rate:{slug}"


def mean_key(slug: str) -> str:
    return f"fq:mean:{slug}"


def _bucket_seconds(window_seconds: int) -> float:
    return max(window_seconds / RING_BUCKETS, 1.0)


def rate_from_ring(counts: list[int], *, window_seconds: int) -> float:
    """Submissions per minute: the median bucket, scaled to a minute."""
    if not counts:
        return 0.0
    return statistics.median(counts) * 60.0 / _bucket_seconds(window_seconds)


@dataclass
class _TenantCache:
    signals: LiveSignals = field(default_factory=LiveSignals)
    fetched_at: float = 0.0
    pending: int = 0
    flushed_at: float = 0.0
    idle_share: int = 0
    fair_share: float | None = None
    shard_cap: int | None = None
    tick_limit: int | None = None
    tick_held_elsewhere: int = 0
    durations: list[float] = field(default_factory=list)  # finished jobs not yet folded in
    means_flushed_at: float = 0.0


@dataclass(frozen=True)
class FleetState:
    """Fleet-wide numbers, as of `at` (monotonic)."""

    slots: int = 0
    busy: int = 0
    busy_batch: int = 0
    workers: int = 0
    in_flight: int = 0  # non-batch jobs holding the pool's slots across all shards
    batch_in_flight: int = 0
    batch_by_shard: dict[str, int] = field(default_factory=dict)
    # Each shard key's holders (batch and quarantine lane included).
    held_by_shard: dict[str, int] = field(default_factory=dict)
    # Each shard's quarantined jobs holding a lane slot: on the lane's workers, not the pool's.
    lane_by_shard: dict[str, int] = field(default_factory=dict)
    quarantine_workers: int = 0
    quarantine_slots: int = 0
    held_elsewhere: dict[str, int] = field(default_factory=dict)
    policy_version: int = -1
    at: float = 0.0

    @property
    def pool_target(self) -> float:
        return self.slots * policy_snapshot().pool.target_utilisation

    def pool_room(self, shard: str) -> int | None:
        """The most jobs `shard`'s key may hold now (fairqueue.jobs.admission.pool_room):
        the pool's slots are shared over the holders not in the quarantine lane, and the
        shard's lane holders, on the lane's own workers, come on top."""
        on_pool = {s: held - self.lane_by_shard.get(s, 0) for s, held in self.held_by_shard.items()}
        room = pool_room(slots=self.slots, held_by_shard=on_pool, shard=shard)
        return None if room is None else room + self.lane_by_shard.get(shard, 0)

    def batch_limit(self, shard: str) -> int:
        by_shard = dict(self.batch_by_shard)
        by_shard.setdefault(shard, 0)
        limits = batch_limits(
            pool_slots=self.slots,
            target_utilisation=policy_snapshot().pool.target_utilisation,
            in_flight=self.in_flight,
            batch_by_shard=by_shard,
        )
        return limits[shard]


_lock = threading.Lock()
_tenants: dict[str, _TenantCache] = {}
_unflushed: set[str] = set()  # tenants with counts or durations held here (the tick flushes them)
_fleet = FleetState()


def _window() -> int:
    return policy_snapshot().pool.rate_window_seconds


def record_submissions(*, tenant_slug: str, count: int, now: float | None = None) -> None:
    """Count submissions locally; they reach the ring with the tenant's next refresh.

    With `now` (tests), the count is written to the ring at once for that instant.
    """
    if now is not None:
        _ring_add(tenant_slug, count, now, past=True)
        return
    with _lock:
        entry = _tenants.setdefault(tenant_slug, _TenantCache())
        entry.pending += count
        due = time.monotonic() - entry.flushed_at >= SIGNAL_TTL_SECONDS
        if due:
            pending, entry.pending, entry.flushed_at = entry.pending, 0, time.monotonic()
        else:
            _unflushed.add(tenant_slug)
    if due:
        # A tenant that only submits (a burst) still reaches the ring within a second.
        try:
            _ring_add(tenant_slug, pending, time.time())
        except redis.RedisError:
            # A statistic never fails a submit: keep the count for the next flush.
            with _lock:
                entry.pending += pending
                _unflushed.add(tenant_slug)


def _ring_add(slug: str, count: int, now: float, *, past: bool = False) -> None:
    window = _window()
    bucket = int(now // _bucket_seconds(window))
    pipe = redis_client().pipeline(transaction=False)
    if past:
        # A count for a given instant may land in a completed bucket, which readers cache
        # (signals_read_many): tell them to read every ring again.
        pipe.incr(RING_EPOCH_KEY)
    _ring_write(pipe, slug, bucket, count, window)
    pipe.hdel(rate_key(slug), *[str(bucket - RING_BUCKETS - i) for i in range(1, 4)])
    pipe.execute()


def tenant_signals_read(*, tenant_slug: str, now: float | None = None) -> tuple[float, float | None]:
    """Fresh (rate per minute, mean seconds) for one tenant: one fixed-size round trip."""
    with _lock:
        entry = _tenants.setdefault(tenant_slug, _TenantCache())
        pending, entry.pending = entry.pending, 0
        durations = [(tenant_slug, d) for d in entry.durations]
        entry.durations = []
        entry.means_flushed_at = time.monotonic()
    window = _window()
    now = time.time() if now is None else now
    size = _bucket_seconds(window)
    current = int(now // size)
    # Complete intervals only: the current one would read low for most of its life.
    fields = [str(current - i) for i in range(1, RING_BUCKETS + 1)]
    pipe = redis_client().pipeline(transaction=False)
    _queue_means(pipe, durations)  # finished jobs ride along: no round trip of their own
    if pending:
        _ring_write(pipe, tenant_slug, current, pending, window)
    pipe.hmget(rate_key(tenant_slug), fields)
    pipe.get(mean_key(tenant_slug))
    pipe.hget(SHARES_KEY, tenant_slug)
    pipe.hget(FAIR_SHARES_KEY, tenant_slug)
    pipe.hget(SHARD_CAPS_KEY, tenant_slug)
    pipe.hget(TICK_LIMITS_KEY, tenant_slug)
    results, redone = _execute(pipe, durations)
    *_, ring, mean, share, fair, cap, tick = results
    if redone:
        mean = redis_client().get(mean_key(tenant_slug))
    with _lock:
        entry.idle_share = int(share or 0)
        entry.fair_share = float(fair) if fair is not None else None
        entry.shard_cap = int(cap) if cap is not None else None
        entry.tick_limit, entry.tick_held_elsewhere = tick_limit_parse(tick)
    counts = [int(c or 0) for c in ring]
    return rate_from_ring(counts, window_seconds=window), (float(mean) if mean else None)


@dataclass
class _RingCache:
    bucket: int  # the current bucket when the ring was read (its completed buckets are before it)
    rate: float
    mean: float | None
    counted: bool  # some completed bucket held a count: the rate moves as buckets complete


# Which tenants' rings were written in a bucket: a SET per bucket, so that when it completes
# a reader re-reads those rings and the ones it holds with counts (a count leaving the
# window), not every tenant's. Writers add to it in the write's own round trip.
RING_TOUCHED_PREFIX = "fq:rate:touched:"
# Every ring is also re-read, a slice per call, within this many calls (about ten minutes
# of ticks): what converges a reader whose touched set was lost (evicted, or a write whose
# SADD failed) and a mean that expired.
RING_AUDIT_CALLS = 1200
CHANGES_KEPT = 100_000  # changed-tenant log entries kept for SignalsView (then all count as changed)


def ring_touched_key(bucket: int) -> str:
    return f"{RING_TOUCHED_PREFIX}{bucket}"


def _ring_write(pipe: Any, slug: str, bucket: int, count: int, window: int) -> None:
    pipe.hincrby(rate_key(slug), str(bucket), count)
    pipe.expire(rate_key(slug), window * 2 + 60)
    pipe.sadd(ring_touched_key(bucket), slug)
    pipe.expire(ring_touched_key(bucket), window * 2 + 60)


@dataclass
class _Rings:
    """This process's cache of every tenant's (rate, mean), shared by every SignalsView."""

    by_slug: dict[str, _RingCache] = field(default_factory=dict)
    epoch: str | None = None
    bucket: int = 0  # the current bucket at the last refresh
    seen: set[str] = field(default_factory=set)  # members of the previous bucket's touched set handled
    counted: set[str] = field(default_factory=set)  # slugs whose cached ring held a count
    rated: set[str] = field(default_factory=set)  # slugs whose cached rate is above zero
    audit: int = 0  # where the next audit slice starts
    changes: list[str] = field(default_factory=list)  # slugs whose (rate, mean) changed, in order
    changes_base: int = 0  # the position of changes[0] since the cache began

    def changed(self, slug: str) -> None:
        self.changes.append(slug)
        if len(self.changes) > CHANGES_KEPT:
            half = len(self.changes) // 2
            del self.changes[:half]
            self.changes_base += half


_rings = _Rings()
_rings_lock = threading.Lock()  # the tick and a dashboard may read from two threads


def _rings_refresh(slugs: list[str], now: float | None) -> None:
    """Bring the cached (rate, mean) of `slugs` up to date, reading only what may have
    moved: the rings of tenants written in the bucket that completed (its touched set) or
    holding counts (one drops out of the window), a rotating audit slice, tenants not
    cached yet, and the mean of every tenant with a rate (every finished job moves it;
    without a rate the formula's base is the floor whatever the mean). Counts and
    durations this process holds ride along, as in `tenant_signals_read`."""
    window = _window()
    now = time.time() if now is None else now
    current = int(now // _bucket_seconds(window))
    fields = [str(current - i) for i in range(1, RING_BUCKETS + 1)]
    check = redis_client().pipeline(transaction=False)
    check.get(RING_EPOCH_KEY)
    check.smembers(ring_touched_key(current - 1))
    epoch, touched = check.execute()
    rings = _rings
    if epoch != rings.epoch or not rings.bucket <= current <= rings.bucket + 1:
        # A count written to a completed bucket (the epoch), a bucket whose touched set we
        # never read (no call for a whole bucket), or time going back: read every ring.
        rings.by_slug.clear()
        rings.counted.clear()
        rings.rated.clear()
        rings.seen = set()
        rings.epoch = epoch
        rings.changes_base += len(rings.changes) + 1  # every view starts over
        rings.changes.clear()
    if current != rings.bucket:
        rings.bucket = current
        rings.seen = set()
    fresh_touched = {str(s) for s in touched} - rings.seen
    rings.seen |= fresh_touched
    durations: list[tuple[str, float]] = []
    pending: dict[str, int] = {}
    with _lock:
        unflushed = list(_unflushed)
        _unflushed.clear()
        for slug in unflushed:
            entry = _tenants.get(slug)
            if entry is None:
                continue
            if entry.pending:
                pending[slug], entry.pending = entry.pending, 0
            if entry.durations:
                durations += [(slug, d) for d in entry.durations]
                entry.durations = []
                entry.means_flushed_at = time.monotonic()
    cached = rings.by_slug
    for slug in fresh_touched:
        if slug in cached:
            # Written in the bucket that completed (perhaps by a writer whose clock lags):
            # whoever asks for it next reads it.
            del cached[slug]
            rings.counted.discard(slug)
            rings.rated.discard(slug)
            rings.changed(slug)
    stale = {s for s in slugs if s not in cached}
    stale.update(s for s in rings.counted if cached[s].bucket != current)
    if slugs:
        size = -(-len(slugs) // RING_AUDIT_CALLS)
        start = rings.audit % len(slugs)
        stale.update(slugs[start : start + size])
        rings.audit = start + size
    stale_list = list(stale)
    with_rate = stale_list + [s for s in rings.rated if s not in stale]
    pipe = redis_client().pipeline(transaction=False)
    _queue_means(pipe, durations)
    for slug, count in pending.items():
        _ring_write(pipe, slug, current, count, window)
    for slug in stale_list:
        pipe.hmget(rate_key(slug), fields)
    for slug in with_rate:
        pipe.get(mean_key(slug))
    results, redone = _execute(pipe, durations)
    results = results[4 * len(pending) :]
    ring_replies, means = results[: len(stale_list)], results[len(stale_list) :]
    if redone:
        means = [redis_client().get(mean_key(slug)) for slug in with_rate]
    read: dict[str, tuple[float, bool]] = {}
    for slug, ring in zip(stale_list, ring_replies, strict=True):
        counts = [int(c or 0) for c in ring]
        read[slug] = (rate_from_ring(counts, window_seconds=window), any(counts))
    for slug, raw in zip(with_rate, means, strict=True):
        old = cached.get(slug)
        # Not re-read: a tenant with a rate, hence cached.
        rate, counted = read[slug] if old is None else read.get(slug, (old.rate, old.counted))
        mean = float(raw) if raw else None
        if old is None or old.rate != rate or old.mean != mean:
            rings.changed(slug)
        cached[slug] = _RingCache(bucket=current, rate=rate, mean=mean, counted=counted)
        (rings.counted.add if counted else rings.counted.discard)(slug)
        (rings.rated.add if rate > 0 else rings.rated.discard)(slug)


class SignalsView:
    """One caller's view of every tenant's signals (`signals_read_many`), kept between
    calls so that a call redoes only the tenants whose signals changed since its last."""

    def __init__(self) -> None:
        self.out: dict[str, LiveSignals] = {}
        self.slugs: list[str] | None = None
        self.figures: tuple[object, ...] | None = None
        self.position = -1  # how far into the rings' change log this view has applied
        self.interned: dict[tuple[float, float | None, int, int], LiveSignals] = {}
        self.reads = 0  # calls answered

    def read(
        self, slugs: list[str], *, now: float | None = None, fleet: FleetState | None = None
    ) -> tuple[dict[str, LiveSignals], set[str] | None]:
        """Every tenant's signals (a new dict each call) and the tenants whose signals may
        differ from this view's previous answer: None when all may (the first call, other
        tenants, other pool figures, the cache read afresh)."""
        with _rings_lock:
            _rings_refresh(slugs, now)
            rings = _rings
            held = fleet.held_elsewhere if fleet is not None else {}
            figures = (fleet.slots, fleet.in_flight, held) if fleet is not None else (0, 0, held)
            changed: set[str] | None
            if self.slugs != slugs or self.figures != figures or self.position < rings.changes_base:
                self.slugs, self.figures, self.interned = list(slugs), figures, {}
                todo: Any = slugs
                changed = None
            else:
                changed = set(rings.changes[self.position - rings.changes_base :])
                changed.intersection_update(self.out)
                todo = list(changed)
            self.position = rings.changes_base + len(rings.changes)
            self.reads += 1
            if len(self.interned) > 2 * len(slugs) + 1000:
                self.interned = {}  # means drift: keep the intern table bounded
            tenants = policy_snapshot().tenants
            slots, in_flight = figures[0], figures[1]
            cached = rings.by_slug
            for slug in todo:
                ring = cached[slug]
                tenant = tenants.get(slug)
                key = (
                    ring.rate,
                    ring.mean if ring.rate > 0 else None,
                    held.get(f"t:{slug}", 0) if held else 0,
                    held.get(f"s:{tenant.shard}", 0) if held and tenant else 0,
                )
                found = self.interned.get(key)
                if found is None:
                    found = self.interned[key] = LiveSignals(
                        rate_per_min=key[0],
                        mean_seconds=key[1],
                        pool_slots=slots,
                        in_flight=in_flight,
                        held_elsewhere=key[2],
                        shard_held_elsewhere=key[3],
                    )
                if changed is not None and self.out.get(slug) is found:
                    changed.discard(slug)
                self.out[slug] = found
            return dict(self.out), changed


def signals_read_many(
    slugs: list[str], *, now: float | None = None, fleet: FleetState | None = None
) -> dict[str, LiveSignals]:
    """Every tenant's (rate, mean), as `LiveSignals` with the pool's figures and slots held
    elsewhere from `fleet` (none without it) and no shares; tenants with equal signals
    share one object (fairqueue.jobs.limits_plan computes once per distinct object).

    Reads only what may have moved (see `_rings_refresh`). Answers come from one view
    shared by the callers of this function (the dashboard's snapshot and /metrics): while
    a tenant's signals stay equal it gets the very same object from one call to the next,
    so a reader of consecutive answers finds it unchanged by identity. The duty tick keeps
    a `SignalsView` of its own, which also says which tenants changed."""
    return _shared_view.read(slugs, now=now, fleet=fleet)[0]


_shared_view = SignalsView()


def record_finish(*, tenant_slug: str, seconds: float, batch: bool) -> None:
    """Fold a finished job's duration into the tenant's exponentially weighted mean.

    Not a round trip per job: durations are queued and travel with the tenant's next
    signal read (the worker tick reads every tenant about once a second); a process that
    reads nothing flushes them itself after MEAN_FLUSH_SECONDS.
    """
    if batch:
        return  # batch work says nothing about the tenant's interactive load
    with _lock:
        entry = _tenants.setdefault(tenant_slug, _TenantCache())
        entry.durations.append(seconds)
        due = time.monotonic() - entry.means_flushed_at >= MEAN_FLUSH_SECONDS
        if due:
            durations = [(tenant_slug, d) for d in entry.durations]
            entry.durations = []
            entry.means_flushed_at = time.monotonic()
        else:
            _unflushed.add(tenant_slug)
    if due:
        pipe = redis_client().pipeline(transaction=False)
        _queue_means(pipe, durations)
        _execute(pipe, durations)


def fleet_state(*, max_age: float = FLEET_TTL_SECONDS) -> FleetState:
    """The cached fleet state; refreshed at most once per `max_age` per process."""
    global _fleet
    now = time.monotonic()
    policy = policy_snapshot()
    # A policy change (a tenant moved) may come with slots held elsewhere: read them with it.
    if now - _fleet.at < max_age and _fleet.policy_version == policy.version:
        return _fleet
    fleet = fleet_read()
    in_flight = 0
    batch_by_shard: dict[str, int] = {}
    held_by_shard: dict[str, int] = {}
    lane_by_shard: dict[str, int] = {}
    held = {str(k): int(v) for k, v in redis_client().hgetall(HELD_ELSEWHERE_KEY).items()}
    by_tag = engine().counts_many({shard_tag(shard): [SHARD_KEY, BATCH_KEY, QUARANTINE_KEY] for shard in policy.shards})
    for shard in policy.shards:
        counts = by_tag[shard_tag(shard)]
        batch_by_shard[shard] = counts.get(BATCH_KEY, 0)
        held_by_shard[shard] = counts.get(SHARD_KEY, 0)
        lane_by_shard[shard] = counts.get(QUARANTINE_KEY, 0)
        in_flight += counts.get(SHARD_KEY, 0) - counts.get(BATCH_KEY, 0) - counts.get(QUARANTINE_KEY, 0)
    batch = sum(batch_by_shard.values())
    _fleet = FleetState(
        slots=fleet["slots"],
        busy=fleet["busy"],
        busy_batch=fleet["busy_batch"],
        workers=fleet["workers"],
        in_flight=max(in_flight, 0),
        batch_in_flight=batch,
        batch_by_shard=batch_by_shard,
        held_by_shard=held_by_shard,
        lane_by_shard=lane_by_shard,
        quarantine_workers=fleet["quarantine_workers"],
        quarantine_slots=fleet["quarantine_slots"],
        held_elsewhere=held,
        policy_version=policy.version,
        at=now,
    )
    return _fleet


def lane_held_read(policy: PolicySnapshot) -> dict[str, int]:
    """Each shard's quarantined jobs holding a lane slot, read now: one engine round trip."""
    by_tag = engine().counts_many({shard_tag(shard): [QUARANTINE_KEY] for shard in policy.shards})
    return {shard: by_tag[shard_tag(shard)].get(QUARANTINE_KEY, 0) for shard in policy.shards}


def live_signals(*, tenant_slug: str) -> LiveSignals:
    """Signals for one admission: cached for SIGNAL_TTL_SECONDS, else one small read."""
    now = time.monotonic()
    with _lock:
        entry = _tenants.setdefault(tenant_slug, _TenantCache())
        fresh = now - entry.fetched_at < SIGNAL_TTL_SECONDS
    fleet = fleet_state()
    if not fresh:
        rate, mean = tenant_signals_read(tenant_slug=tenant_slug)
        with _lock:
            entry.signals = LiveSignals(rate_per_min=rate, mean_seconds=mean)
            entry.fetched_at = now
    base = entry.signals
    tenant = policy_snapshot().tenants.get(tenant_slug)
    return LiveSignals(
        rate_per_min=base.rate_per_min,
        mean_seconds=base.mean_seconds,
        pool_slots=fleet.slots,
        in_flight=fleet.in_flight,
        idle_share=entry.idle_share,
        fair_share=entry.fair_share,
        shard_cap=entry.shard_cap,
        tick_limit=entry.tick_limit,
        tick_held_elsewhere=entry.tick_held_elsewhere,
        held_elsewhere=fleet.held_elsewhere.get(f"t:{tenant_slug}", 0),
        shard_held_elsewhere=fleet.held_elsewhere.get(f"s:{tenant.shard}", 0) if tenant else 0,
    )


def held_elsewhere_publish(held: dict[str, int], *, drop: list[str] | tuple[str, ...] = ()) -> None:
    """Publish slots held at places tenants or shards were moved away from (field by field:
    `held` set, `drop` gone), and use them in this process at once."""
    global _fleet
    pipe = redis_client().pipeline(transaction=True)
    if held:
        pipe.hset(HELD_ELSEWHERE_KEY, mapping=dict[Any, Any](held))
    if drop:
        pipe.hdel(HELD_ELSEWHERE_KEY, *drop)
    pipe.execute()
    merged = {k: v for k, v in {**_fleet.held_elsewhere, **held}.items() if k not in drop}
    _fleet = dataclasses.replace(_fleet, held_elsewhere=merged)


def tick_limit_parse(raw: str | bytes | None) -> tuple[int | None, int]:
    """A TICK_LIMITS_KEY field: "<limit> <held elsewhere it subtracted>"."""
    if raw is None:
        return None, 0
    limit, _, held = (raw.decode() if isinstance(raw, bytes) else raw).partition(" ")
    return int(limit), int(held or 0)


@dataclass
class _Publication:
    """What this process last published with `shares_publish`, to send only changes."""

    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    values: dict[str, dict[str, str]] = field(default_factory=dict)
    caps: dict[str, int] | None = None  # the shard caps of `values`, as numbers


_publication = _Publication()


def shares_publish(
    idle: dict[str, int],
    fair: dict[str, float] | None = None,
    caps: dict[str, int] | None = None,
    limits: dict[str, tuple[int, int]] | None = None,
    *,
    unchanged: bool = False,
) -> bool:
    """Make the tick's idle shares, fair shares, shard caps and the limits it sets visible
    to every admitting process; they expire if no worker ticks.

    Only what changed since this process's last publication is written (with ten thousand
    tenants, rewriting every field each tick was most of the tick's Redis work), unless
    someone else published since (SHARES_MARKER_KEY names the last publisher) or ours may
    have expired: then everything. One read of the marker, one MULTI. `unchanged`: the
    caller says all four equal its last call's (the tick reused its plan), so only their
    lifetimes are renewed. Returns whether everything was written (what this process
    remembers of Redis no longer held).
    """
    fair = fair or {}
    caps = caps or {}
    limits = limits or {}
    client = redis_client()
    check = client.pipeline(transaction=False)
    check.get(SHARES_MARKER_KEY)
    check.pttl(SHARES_MARKER_KEY)
    marker, marker_ttl_ms = check.execute()
    # The marker expires with the hashes (same MULTI, same TTL): while it names us with
    # time to spare, they hold what we last wrote.
    full = marker != _publication.token or marker_ttl_ms < SHARES_MIN_TTL_MS
    same = unchanged and bool(_publication.values)
    if same and not full:
        values = _publication.values
    else:
        values = {
            SHARES_KEY: {k: str(v) for k, v in idle.items()},
            FAIR_SHARES_KEY: {k: f"{v:.3f}" for k, v in fair.items()},
            SHARD_CAPS_KEY: {k: str(v) for k, v in caps.items()},
            TICK_LIMITS_KEY: {slug: f"{limit} {held}" for slug, (limit, held) in limits.items()},
        }
    pipe = client.pipeline(transaction=True)
    written = False
    for key, new in values.items():
        if not (same and not full):
            old = {} if full else _publication.values.get(key, {})
            if full:
                pipe.delete(key)
            gone = [k for k in old if k not in new]
            if gone:
                pipe.hdel(key, *gone)
            changed = {k: v for k, v in new.items() if old.get(k) != v}
            if changed:
                pipe.hset(key, mapping=dict[Any, Any](changed))
            written = written or full or bool(gone) or bool(changed)
        if new:
            pipe.expire(key, SHARES_TTL_SECONDS)
    if written:
        pipe.set(SHARES_VERSION_KEY, uuid.uuid4().hex, ex=SHARES_TTL_SECONDS)
    else:
        pipe.expire(SHARES_VERSION_KEY, SHARES_TTL_SECONDS)
    pipe.set(SHARES_MARKER_KEY, _publication.token, ex=SHARES_TTL_SECONDS)
    pipe.execute()
    if values is _publication.values:
        return full  # the same figures as this process's last publication (the cache below holds them)
    _publication.values = values
    _publication.caps = dict(caps)
    with _lock:
        for slug, entry in _tenants.items():
            entry.idle_share = idle.get(slug, 0)
            entry.fair_share = fair.get(slug)
            entry.shard_cap = caps.get(slug)
            entry.tick_limit, entry.tick_held_elsewhere = limits.get(slug, (None, 0))
    return full


def shard_caps_read() -> dict[str, int]:
    """The shard caps the tick last published: this process's own when it published last
    (the marker names it, so Redis holds them), else read."""
    client = redis_client()
    if _publication.caps is not None and client.get(SHARES_MARKER_KEY) == _publication.token:
        return _publication.caps
    return {str(k): int(v) for k, v in client.hgetall(SHARD_CAPS_KEY).items()}


def live_invalidate() -> None:
    """Forget cached signals (tests; a changed policy)."""
    global _fleet, _publication, _rings
    with _lock:
        _tenants.clear()
        _unflushed.clear()
    with _rings_lock:
        _rings = _Rings(changes_base=_rings.changes_base + len(_rings.changes) + 1)
    _fleet = FleetState()
    _publication = _Publication()
