"""Process-local read cache of the policy mirrored in Redis, for the scheduling hot path.

`policy_snapshot()` costs nothing most of the time; every CHECK_INTERVAL_SECONDS it makes
one round trip to see whether the policy changed (version) or Redis lost its data (no
`synced` marker). On a change it reloads; on a loss it resyncs Redis from the database
itself, so an admin edit reaches running workers within about CHECK_INTERVAL_SECONDS and
an emptied Redis heals without anyone running a command.

The same round trip reads the API-key version, so `policy_marker()` tells other caches
(tenants.authentication) whether anything they hold may have changed, at no cost of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis

from fairqueue.engine.cluster import Client
from tenants import keys
from tenants.models import DEFAULT_MAX_FAN_OUT
from tenants.redis_client import get_redis
from tenants.sync import policy_sync_all

log = logging.getLogger("fairqueue.tenants.policy")

CHECK_INTERVAL_SECONDS = 0.25
# A marker older than this (Redis unreachable since) is no marker: caches keyed on it must
# not be trusted, since a change made meanwhile could not be heard of.
MARKER_MAX_AGE_SECONDS = 1.0
RESYNC_LOCK_SECONDS = 10
RESYNC_WAIT_SECONDS = 5.0  # how long a process with no snapshot waits for another's resync
DEFAULT_CLASS = "default"
# PoolSettings' defaults of the quotas and the memory guard (mirrored here for a missing hash).
DEFAULT_BACKLOG_QUOTA = 100_000
DEFAULT_BATCH_BACKLOG_QUOTA = 1_000_000
DEFAULT_SUBMIT_BURST = 1000
DEFAULT_MEMORY_GUARD_PCT = 80.0


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    slug: str
    name: str
    active: bool
    shard: str
    floor: int
    burst_floor: int
    burst_pct: float
    max_concurrency: int | None
    dedicated: int
    batch_enabled: bool
    default_class: str  # "" in Redis is resolved to "default" here
    sub_tenant_share: float
    version: int
    max_fan_out: int = DEFAULT_MAX_FAN_OUT  # children of one parent job running at once
    # Backlog quotas and the submission rate (jobs/s); None takes the pool's (PoolPolicy).
    backlog_quota: int | None = None
    batch_backlog_quota: int | None = None
    submit_rate: float | None = None

    @classmethod
    def plain(cls, slug: str, *, shard: str, **overrides: Any) -> TenantPolicy:
        """A tenant with the admin's default policy (floor 2, burst 2 or 50 %, no hard max),
        for simulations and tests that build policy without the database."""
        return dataclasses.replace(
            cls(
                slug=slug,
                name=slug,
                active=True,
                shard=shard,
                floor=2,
                burst_floor=2,
                burst_pct=0.5,
                max_concurrency=None,
                dedicated=0,
                batch_enabled=False,
                default_class=DEFAULT_CLASS,
                sub_tenant_share=0.5,
                version=1,
            ),
            **overrides,
        )

    @classmethod
    def from_hash(cls, data: dict[str, str]) -> TenantPolicy:
        max_concurrency = data.get("max_concurrency", "")
        return cls(
            slug=data["slug"],
            name=data.get("name", ""),
            active=data.get("active") == "1",
            shard=data["shard"],
            floor=int(data["floor"]),
            burst_floor=int(data["burst_floor"]),
            burst_pct=float(data["burst_pct"]),
            max_concurrency=int(max_concurrency) if max_concurrency else None,
            dedicated=int(data.get("dedicated") or 0),
            batch_enabled=data.get("batch_enabled") == "1",
            default_class=data.get("default_class") or DEFAULT_CLASS,
            sub_tenant_share=float(data.get("sub_tenant_share") or 0.5),
            version=int(data.get("version") or 0),
            max_fan_out=int(data.get("max_fan_out") or DEFAULT_MAX_FAN_OUT),
            backlog_quota=_int_or_none(data.get("backlog_quota")),
            batch_backlog_quota=_int_or_none(data.get("batch_backlog_quota")),
            submit_rate=float(data["submit_rate"]) if data.get("submit_rate") else None,
        )


def _int_or_none(raw: str | None) -> int | None:
    return int(raw) if raw else None


@dataclass(frozen=True, slots=True)
class ShardPolicy:
    name: str
    capacity: int
    version: int


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    name: str
    objective_seconds: int
    rank: int
    version: int


@dataclass(frozen=True, slots=True)
class ResourcePolicy:
    """An outside resource's configured limit and the AIMD parameters of its effective one."""

    name: str
    limit: int
    decrease_factor: float
    increase_per_success: float
    recovery_seconds: float
    version: int

    @classmethod
    def from_hash(cls, name: str, data: dict[str, str]) -> ResourcePolicy:
        return cls(
            name=name,
            limit=int(data["limit"]),
            decrease_factor=float(data["decrease_factor"]),
            increase_per_success=float(data["increase_per_success"]),
            recovery_seconds=float(data["recovery_seconds"]),
            version=int(data.get("version") or 0),
        )


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    # Defaults mirror PoolSettings' so a missing pool hash still yields sane numbers.
    target_utilisation: float = 0.85
    f_min: float = 0.25
    f_max: float = 4.0
    rate_window_seconds: int = 300
    default_job_seconds: float = 1.0
    batch_objective_seconds: int = 12 * 3600
    floor_headroom: int = 0
    quarantine_after_losses: int = 1
    quarantine_poison_losses: int = 2
    quarantine_slots: int = 1
    backlog_quota: int = DEFAULT_BACKLOG_QUOTA
    batch_backlog_quota: int = DEFAULT_BATCH_BACKLOG_QUOTA
    submit_rate: float = 0.0
    submit_burst: int = DEFAULT_SUBMIT_BURST
    memory_guard_pct: float = DEFAULT_MEMORY_GUARD_PCT
    version: int = 0

    @classmethod
    def from_hash(cls, data: dict[str, str]) -> PoolPolicy:
        if not data:
            return cls()
        return cls(
            target_utilisation=float(data["target_utilisation"]),
            f_min=float(data["f_min"]),
            f_max=float(data["f_max"]),
            rate_window_seconds=int(data["rate_window_seconds"]),
            default_job_seconds=float(data["default_job_seconds"]),
            batch_objective_seconds=int(data["batch_objective_seconds"]),
            floor_headroom=int(data.get("floor_headroom") or 0),
            # A pool hash written before the lane existed: its defaults.
            quarantine_after_losses=int(data.get("quarantine_after_losses", 1)),
            quarantine_poison_losses=int(data.get("quarantine_poison_losses", 2)),
            quarantine_slots=int(data.get("quarantine_slots", 1)),
            backlog_quota=int(data.get("backlog_quota") or DEFAULT_BACKLOG_QUOTA),
            batch_backlog_quota=int(data.get("batch_backlog_quota") or DEFAULT_BATCH_BACKLOG_QUOTA),
            submit_rate=float(data.get("submit_rate") or 0.0),
            submit_burst=int(data.get("submit_burst") or DEFAULT_SUBMIT_BURST),
            memory_guard_pct=float(data.get("memory_guard_pct") or DEFAULT_MEMORY_GUARD_PCT),
            version=int(data.get("version") or 0),
        )

    def backlog_quota_of(self, tenant: TenantPolicy, *, batch: bool) -> int:
        """The most jobs of `tenant`'s lane that may wait at once: its own, else the pool's."""
        own = tenant.batch_backlog_quota if batch else tenant.backlog_quota
        if own is not None:
            return own
        return self.batch_backlog_quota if batch else self.backlog_quota

    def submit_rate_of(self, tenant: TenantPolicy) -> float:
        """Jobs per second `tenant` may submit (0: no limit)."""
        return tenant.submit_rate if tenant.submit_rate is not None else self.submit_rate


@dataclass(frozen=True)
class PolicySnapshot:
    """Everything the scheduler needs to know about policy, as of one policy version."""

    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    subtenants: dict[str, dict[str, int]] = field(default_factory=dict)  # slug -> external_id -> cap
    shards: dict[str, ShardPolicy] = field(default_factory=dict)
    classes: dict[str, ClassPolicy] = field(default_factory=dict)
    pool: PoolPolicy = field(default_factory=PoolPolicy)
    resources: dict[str, ResourcePolicy] = field(default_factory=dict)
    version: int = 0
    sync_id: str = ""  # the `synced` marker it was loaded under; changes when Redis is rebuilt
    auth_version: str = ""  # keys.AUTH_VERSION_KEY as last read: changes when an API key is rotated

    def tenant(self, slug: str) -> TenantPolicy | None:
        return self.tenants.get(slug)

    def subtenant_cap(self, slug: str, external_id: str) -> int | None:
        """The registered cap of a sub-tenant, or None when the customer never registered it."""
        return self.subtenants.get(slug, {}).get(external_id)


_lock = threading.Lock()
_snapshot: PolicySnapshot | None = None
_checked_at = 0.0
_confirmed_at = 0.0  # when Redis last answered a check (monotonic)
_invalidations = 0  # policy_invalidate() calls: part of the marker, so they drop derived caches too


def policy_snapshot() -> PolicySnapshot:
    """The current policy; at most every CHECK_INTERVAL_SECONDS it checks Redis for a change."""
    global _snapshot, _checked_at, _confirmed_at
    snapshot = _snapshot
    if snapshot is not None and time.monotonic() - _checked_at < CHECK_INTERVAL_SECONDS:
        return snapshot
    with _lock:
        if _snapshot is not None and time.monotonic() - _checked_at < CHECK_INTERVAL_SECONDS:
            return _snapshot
        try:
            _snapshot = _refresh(_snapshot)
            _confirmed_at = time.monotonic()
        except redis.ConnectionError:
            if _snapshot is None:
                raise
            log.warning("Redis unreachable; scheduling on the last known policy (version %s)", _snapshot.version)
        _checked_at = time.monotonic()
        return _snapshot


PolicyMarker = tuple[int, int, str, str]


def policy_marker() -> PolicyMarker | None:
    """(local invalidations, policy version, sync id, API-key version) as Redis confirmed
    them at most MARKER_MAX_AGE_SECONDS ago, or None. A cache of anything the policy or the
    keys decide stays valid while the marker is unchanged; None means: trust no cache now.
    Raises like `policy_snapshot` when Redis has never answered."""
    snapshot = policy_snapshot()
    if time.monotonic() - _confirmed_at > MARKER_MAX_AGE_SECONDS:
        return None
    return _invalidations, snapshot.version, snapshot.sync_id, snapshot.auth_version


def policy_marker_nowait() -> PolicyMarker | None:
    """policy_marker() when it needs no Redis read now (the last check is under
    CHECK_INTERVAL_SECONDS old and Redis confirmed it), else None: for a caller on an event
    loop, which must not block, and asks policy_marker() from a thread on None."""
    snapshot = _snapshot
    now = time.monotonic()
    if snapshot is None or now - _checked_at >= CHECK_INTERVAL_SECONDS or now - _confirmed_at > MARKER_MAX_AGE_SECONDS:
        return None
    return _invalidations, snapshot.version, snapshot.sync_id, snapshot.auth_version


def policy_invalidate() -> None:
    """Forget the cached snapshot so the next call reads Redis (tests, after a manual sync)."""
    global _snapshot, _checked_at, _confirmed_at, _invalidations
    with _lock:
        _snapshot = None
        _checked_at = 0.0
        _confirmed_at = 0.0
        _invalidations += 1


def _refresh(current: PolicySnapshot | None) -> PolicySnapshot:
    client = get_redis()
    pipe = client.pipeline(transaction=False)
    pipe.get(keys.VERSION_KEY)
    pipe.get(keys.SYNCED_KEY)
    pipe.get(keys.AUTH_VERSION_KEY)
    raw_version, sync_id, auth_version = pipe.execute()
    if not sync_id:
        if _resync_from_database(client):
            return _load(client)
        # Another process holds the lock and is resyncing: keep scheduling on what we
        # have and look again next interval; with nothing cached, wait for it briefly.
        if current is not None:
            return current
        _wait_for_sync(client)
        return _load(client)
    if current is not None and current.version == int(raw_version or 0) and current.sync_id == sync_id:
        if current.auth_version != (auth_version or ""):
            return dataclasses.replace(current, auth_version=auth_version or "")
        return current
    return _load(client)


def _resync_from_database(client: Client) -> bool:
    """Rebuild Redis from the database if no other process is already doing it."""
    token = uuid.uuid4().hex
    if not client.set(keys.RESYNC_LOCK_KEY, token, nx=True, ex=RESYNC_LOCK_SECONDS):
        return False
    try:
        result = policy_sync_all()
        log.warning(
            "Redis had no policy (lost its data); resynced %d tenants from the database (version %d)",
            result.tenants,
            result.version,
        )
    finally:
        _release_lock(client, token)
    return True


def _release_lock(client: Client, token: str) -> None:
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(keys.RESYNC_LOCK_KEY)
            if pipe.get(keys.RESYNC_LOCK_KEY) == token:
                pipe.multi()
                pipe.delete(keys.RESYNC_LOCK_KEY)
                pipe.execute()
        except redis.WatchError:
            pass  # it expired and someone else took it: theirs now


def _wait_for_sync(client: Client) -> None:
    deadline = time.monotonic() + RESYNC_WAIT_SECONDS
    while time.monotonic() < deadline and not client.exists(keys.SYNCED_KEY):
        time.sleep(0.05)


def _parse(kind: str, name: str, data: dict[str, str], build: Any) -> Any:
    try:
        return build(data)
    except (KeyError, ValueError):
        log.error("Ignoring malformed policy %s %r in Redis: %r", kind, name, data)
        return None


def _load(client: Client) -> PolicySnapshot:
    """Read all policy: the indexes, then every hash in one MULTI (retried if a write slips in)."""
    for _ in range(5):
        pipe = client.pipeline(transaction=True)
        pipe.get(keys.VERSION_KEY)
        pipe.get(keys.SYNCED_KEY)
        pipe.get(keys.AUTH_VERSION_KEY)
        pipe.smembers(keys.TENANTS_INDEX)
        pipe.smembers(keys.SHARDS_INDEX)
        pipe.smembers(keys.CLASSES_INDEX)
        pipe.smembers(keys.RESOURCES_INDEX)
        raw_version, sync_id, auth_version, slugs, shard_names, class_names, resource_names = pipe.execute()
        slugs, shard_names, class_names = sorted(slugs), sorted(shard_names), sorted(class_names)
        resource_names = sorted(resource_names)

        pipe = client.pipeline(transaction=True)
        pipe.get(keys.VERSION_KEY)
        pipe.hgetall(keys.POOL_KEY)
        for slug in slugs:
            pipe.hgetall(keys.tenant_key(slug))
            pipe.hgetall(keys.subtenants_key(slug))
        for name in shard_names:
            pipe.hgetall(keys.shard_key(name))
        for name in class_names:
            pipe.hgetall(keys.class_key(name))
        for name in resource_names:
            pipe.hgetall(keys.resource_key(name))
        results = pipe.execute()
        if results[0] == raw_version:
            break
    # If writes kept slipping in, the snapshot carries the older version, so the next
    # check sees a newer one and reloads.
    it = iter(results[2:])
    tenants: dict[str, TenantPolicy] = {}
    subtenants: dict[str, dict[str, int]] = {}
    for slug in slugs:
        data, subs = next(it), next(it)
        policy = _parse("tenant", slug, data, TenantPolicy.from_hash) if data else None
        if policy is None:
            continue
        tenants[slug] = policy
        if subs:
            subtenants[slug] = {ext: int(cap) for ext, cap in subs.items() if cap.isdigit()}
    shards: dict[str, ShardPolicy] = {}
    for name in shard_names:
        data = next(it)
        shard = _parse(
            "shard", name, data, lambda d, n=name: ShardPolicy(n, int(d["capacity"]), int(d.get("version") or 0))
        )
        if data and shard is not None:
            shards[name] = shard
    classes: dict[str, ClassPolicy] = {}
    for name in class_names:
        data = next(it)
        latency_class = _parse(
            "class",
            name,
            data,
            lambda d, n=name: ClassPolicy(n, int(d["objective_seconds"]), int(d["rank"]), int(d.get("version") or 0)),
        )
        if data and latency_class is not None:
            classes[name] = latency_class
    resources: dict[str, ResourcePolicy] = {}
    for name in resource_names:
        data = next(it)
        resource = _parse("resource", name, data, lambda d, n=name: ResourcePolicy.from_hash(n, d))
        if data and resource is not None:
            resources[name] = resource
    pool = _parse("pool", "pool", results[1], PoolPolicy.from_hash) or PoolPolicy()
    return PolicySnapshot(
        tenants=tenants,
        subtenants=subtenants,
        shards=shards,
        classes=classes,
        pool=pool,
        resources=resources,
        version=int(raw_version or 0),
        sync_id=sync_id or "",
        auth_version=auth_version or "",
    )
