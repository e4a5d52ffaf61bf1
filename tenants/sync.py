"""Services that mirror policy from the database into Redis, one atomic versioned write each."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone
from redis.client import Pipeline

from fairqueue.engine.cluster import Client
from tenants import keys
from tenants.models import LatencyClass, PoolSettings, Resource, Shard, Tenant
from tenants.redis_client import get_redis

log = logging.getLogger("fairqueue.tenants.sync")

_WATCH_RETRIES = 50


@dataclass(frozen=True)
class PolicySyncResult:
    """What a full resync wrote."""

    tenants: int
    sub_tenants: int
    shards: int
    classes: int
    deleted_keys: int
    resources: int
    version: int


# --- Hash contents -------------------------------------------------------------------


def _flag(value: bool) -> str:
    return "1" if value else "0"


def tenant_policy_mapping(*, tenant: Tenant) -> dict[str, str]:
    """The fields of `fq:{policy}:tenant:<slug>` (without version) for this tenant row."""
    return {
        "slug": tenant.slug,
        "name": tenant.name,
        "active": _flag(tenant.active),
        "shard": tenant.shard.name,
        "floor": str(tenant.floor),
        "burst_floor": str(tenant.burst_floor),
        "burst_pct": repr(float(tenant.burst_pct)),
        "max_concurrency": "" if tenant.max_concurrency is None else str(tenant.max_concurrency),
        "dedicated": str(tenant.dedicated),
        "max_fan_out": str(tenant.max_fan_out),
        "batch_enabled": _flag(tenant.batch_enabled),
        "default_class": tenant.default_latency_class.name if tenant.default_latency_class else "",
        "sub_tenant_share": repr(float(tenant.sub_tenant_share)),
        "backlog_quota": "" if tenant.backlog_quota is None else str(tenant.backlog_quota),
        "batch_backlog_quota": "" if tenant.batch_backlog_quota is None else str(tenant.batch_backlog_quota),
        "submit_rate": "" if tenant.submit_rate is None else repr(float(tenant.submit_rate)),
    }


def subtenant_policy_mapping(*, tenant: Tenant) -> dict[str, str]:
    """external_id -> max_concurrency, the fields of `fq:{policy}:subtenants:<slug>`."""
    return {st.external_id: str(st.max_concurrency) for st in tenant.sub_tenants.all()}


def _shard_mapping(shard: Shard) -> dict[str, str]:
    return {"capacity": str(shard.capacity)}


def _class_mapping(latency_class: LatencyClass) -> dict[str, str]:
    return {"objective_seconds": str(latency_class.objective_seconds), "rank": str(latency_class.rank)}


def resource_policy_mapping(*, resource: Resource) -> dict[str, str]:
    """The fields of `fq:{policy}:resource:<name>` (without version)."""
    return {
        "limit": str(resource.limit),
        "decrease_factor": repr(float(resource.decrease_factor)),
        "increase_per_success": repr(float(resource.increase_per_success)),
        "recovery_seconds": repr(float(resource.recovery_seconds)),
    }


def _pool_mapping(pool: PoolSettings) -> dict[str, str]:
    return {
        "target_utilisation": repr(float(pool.target_utilisation)),
        "f_min": repr(float(pool.f_min)),
        "f_max": repr(float(pool.f_max)),
        "rate_window_seconds": str(pool.rate_window_seconds),
        "default_job_seconds": repr(float(pool.default_job_seconds)),
        "batch_objective_seconds": str(pool.batch_objective_seconds),
        "floor_headroom": str(pool.floor_headroom),
        "quarantine_after_losses": str(pool.quarantine_after_losses),
        "quarantine_poison_losses": str(pool.quarantine_poison_losses),
        "quarantine_slots": str(pool.quarantine_slots),
        "backlog_quota": str(pool.backlog_quota),
        "batch_backlog_quota": str(pool.batch_backlog_quota),
        "submit_rate": repr(float(pool.submit_rate)),
        "submit_burst": str(pool.submit_burst),
        "memory_guard_pct": repr(float(pool.memory_guard_pct)),
    }


# --- Pipeline writers (queued inside MULTI) -----------------------------------------------


def _fields(values: dict[str, str]) -> dict[Any, Any]:
    """redis-py types `mapping` with an invariant key type; our fields are plain strings."""
    return dict(values)


def _put_tenant(pipe: Pipeline, tenant: Tenant, version: int) -> None:
    key = keys.tenant_key(tenant.slug)
    pipe.delete(key)  # drop fields a previous layout may have left behind
    pipe.hset(key, mapping=_fields({**tenant_policy_mapping(tenant=tenant), "version": str(version)}))
    sub_key = keys.subtenants_key(tenant.slug)
    pipe.delete(sub_key)
    subs = subtenant_policy_mapping(tenant=tenant)
    if subs:
        pipe.hset(sub_key, mapping=_fields(subs))
    pipe.sadd(keys.TENANTS_INDEX, tenant.slug)


def _drop_tenant(pipe: Pipeline, slug: str) -> None:
    pipe.delete(keys.tenant_key(slug), keys.subtenants_key(slug))
    pipe.srem(keys.TENANTS_INDEX, slug)


def _put_shard(pipe: Pipeline, shard: Shard, version: int) -> None:
    pipe.hset(keys.shard_key(shard.name), mapping=_fields({**_shard_mapping(shard), "version": str(version)}))
    pipe.sadd(keys.SHARDS_INDEX, shard.name)


def _put_class(pipe: Pipeline, latency_class: LatencyClass, version: int) -> None:
    mapping = {**_class_mapping(latency_class), "version": str(version)}
    pipe.hset(keys.class_key(latency_class.name), mapping=_fields(mapping))
    pipe.sadd(keys.CLASSES_INDEX, latency_class.name)


def _put_resource(pipe: Pipeline, resource: Resource, version: int) -> None:
    mapping = {**resource_policy_mapping(resource=resource), "version": str(version)}
    pipe.hset(keys.resource_key(resource.name), mapping=_fields(mapping))
    pipe.sadd(keys.RESOURCES_INDEX, resource.name)


def _put_pool(pipe: Pipeline, pool: PoolSettings, version: int) -> None:
    pipe.hset(keys.POOL_KEY, mapping=_fields({**_pool_mapping(pool), "version": str(version)}))


def _versioned_write(
    write: Callable[[Pipeline, int], None], *, before: Callable[[Client], object] | None = None
) -> int:
    """Run `write` in one MULTI/EXEC that also INCRs the policy version; return the new version.

    WATCHing the counter lets the writer stamp the hashes with the exact value INCR will
    produce; a concurrent writer makes EXEC fail and we retry with fresh numbers.
    """
    client = get_redis()
    with client.pipeline(transaction=True) as pipe:
        for _ in range(_WATCH_RETRIES):
            try:
                pipe.watch(keys.VERSION_KEY)
                version = int(pipe.get(keys.VERSION_KEY) or 0) + 1
                if before is not None:
                    before(client)
                pipe.multi()
                pipe.incr(keys.VERSION_KEY)
                write(pipe, version)
                pipe.execute()
                return version
            except redis.WatchError:
                continue
    raise RuntimeError("Policy version kept changing; gave up writing policy to Redis")


def _tenant_queryset() -> QuerySet[Tenant]:
    return Tenant.objects.select_related("shard", "default_latency_class").prefetch_related("sub_tenants")


# --- Public services --------------------------------------------------------------------


def tenant_policy_sync(*, tenant: Tenant) -> int:
    """Write one tenant's policy and sub-tenant caps; return the new policy version."""
    return _versioned_write(lambda pipe, version: _put_tenant(pipe, tenant, version))


def tenant_policy_sync_many(*, tenants: Iterable[Tenant]) -> int:
    """Write several tenants in one transaction (bulk admin actions); return the new version."""
    rows = list(tenants)

    def write(pipe: Pipeline, version: int) -> None:
        for tenant in rows:
            _put_tenant(pipe, tenant, version)

    return _versioned_write(write)


def tenant_policy_delete(*, slug: str) -> int:
    """Remove a tenant's policy and sub-tenant caps from Redis; return the new version."""
    return _versioned_write(lambda pipe, version: _drop_tenant(pipe, slug))


def shard_policy_sync(*, shard: Shard) -> int:
    return _versioned_write(lambda pipe, version: _put_shard(pipe, shard, version))


def shard_policy_delete(*, name: str) -> int:
    def write(pipe: Pipeline, version: int) -> None:
        pipe.delete(keys.shard_key(name))
        pipe.srem(keys.SHARDS_INDEX, name)

    return _versioned_write(write)


def latency_class_policy_sync(*, latency_class: LatencyClass) -> int:
    return _versioned_write(lambda pipe, version: _put_class(pipe, latency_class, version))


def latency_class_policy_delete(*, name: str) -> int:
    def write(pipe: Pipeline, version: int) -> None:
        pipe.delete(keys.class_key(name))
        pipe.srem(keys.CLASSES_INDEX, name)

    return _versioned_write(write)


def resource_policy_sync(*, resource: Resource) -> int:
    return _versioned_write(lambda pipe, version: _put_resource(pipe, resource, version))


def resource_policy_delete(*, name: str) -> int:
    def write(pipe: Pipeline, version: int) -> None:
        pipe.delete(keys.resource_key(name))
        pipe.srem(keys.RESOURCES_INDEX, name)

    return _versioned_write(write)


def pool_policy_sync(*, pool: PoolSettings) -> int:
    return _versioned_write(lambda pipe, version: _put_pool(pipe, pool, version))


def pool_policy_delete() -> int:
    def write(pipe: Pipeline, version: int) -> None:
        pipe.delete(keys.POOL_KEY)

    return _versioned_write(write)


def policy_sync_all() -> PolicySyncResult:
    """Rebuild every `fq:{policy}:*` key from the database in one transaction and mark Redis synced.

    Everything except the version counter (kept monotonic) and the resync lock is deleted
    first, so rows deleted while Redis was unreachable disappear too.
    """
    tenants = list(_tenant_queryset())
    shards = list(Shard.objects.all())
    classes = list(LatencyClass.objects.all())
    resources = list(Resource.objects.all())
    pool = PoolSettings.load()
    stale: list[str] = []

    def collect_stale(client: Client) -> None:
        # Runs after WATCH: a concurrent write between this scan and EXEC aborts and retries.
        stale[:] = [k for k in client.scan_iter(match=f"{keys.PREFIX}*", count=1000) if k not in keys.PRESERVED_KEYS]

    def write(pipe: Pipeline, version: int) -> None:
        if stale:
            pipe.delete(*stale)
        for tenant in tenants:
            _put_tenant(pipe, tenant, version)
        for shard in shards:
            _put_shard(pipe, shard, version)
        for latency_class in classes:
            _put_class(pipe, latency_class, version)
        for resource in resources:
            _put_resource(pipe, resource, version)
        _put_pool(pipe, pool, version)
        pipe.set(keys.SYNCED_KEY, f"{version}@{timezone.now().isoformat()}")

    version = _versioned_write(write, before=collect_stale)
    return PolicySyncResult(
        tenants=len(tenants),
        sub_tenants=sum(len(t.sub_tenants.all()) for t in tenants),
        shards=len(shards),
        classes=len(classes),
        deleted_keys=len(stale),
        resources=len(resources),
        version=version,
    )


# --- After-commit scheduling ---------------------------------------------------------------

_pending = threading.local()


def _pending_keys() -> set[Hashable]:
    if not hasattr(_pending, "keys"):
        _pending.keys = set()
    return _pending.keys  # type: ignore[no-any-return]


def _defer(key: Hashable | None, fn: Callable[[], object]) -> None:
    """Run `fn` after the current transaction commits; same-key callbacks in one commit run once.

    Each callback reads the database when it runs, so the first one already sees every
    change of the transaction and later ones with the same key are skipped.
    """
    pending = _pending_keys()
    if key is not None:
        pending.add(key)

    def run() -> None:
        if key is not None:
            if key not in pending:
                return
            pending.discard(key)
        try:
            fn()
        except redis.RedisError:
            # The database change is committed; Redis catches up on the next change, on
            # `manage.py sync_policies`, or by itself if it lost its data.
            log.exception("Could not mirror a policy change into Redis; run `manage.py sync_policies`")

    transaction.on_commit(run)


def _sync_tenant_by_id(tenant_id: int) -> None:
    tenant = _tenant_queryset().filter(pk=tenant_id).first()
    if tenant is not None:  # deleted in the same transaction: its delete callback cleans up
        tenant_policy_sync(tenant=tenant)


def tenant_policy_sync_on_commit(*, tenant_ids: Iterable[int]) -> None:
    """After commit, mirror these tenants (re-read from the database) in one Redis transaction."""
    ids = sorted(set(tenant_ids))
    if not ids:
        return
    if len(ids) == 1:
        _defer(("tenant", ids[0]), lambda: _sync_tenant_by_id(ids[0]))
        return
    _defer(None, lambda: tenant_policy_sync_many(tenants=_tenant_queryset().filter(pk__in=ids)))


def tenant_policy_delete_on_commit(*, slug: str) -> None:
    _defer(("tenant-delete", slug), lambda: tenant_policy_delete(slug=slug))


def shard_policy_sync_on_commit(*, shard_id: int) -> None:
    def run() -> None:
        shard = Shard.objects.filter(pk=shard_id).first()
        if shard is not None:
            shard_policy_sync(shard=shard)

    _defer(("shard", shard_id), run)


def shard_policy_delete_on_commit(*, name: str) -> None:
    _defer(("shard-delete", name), lambda: shard_policy_delete(name=name))


def latency_class_policy_sync_on_commit(*, latency_class_id: int) -> None:
    def run() -> None:
        latency_class = LatencyClass.objects.filter(pk=latency_class_id).first()
        if latency_class is not None:
            latency_class_policy_sync(latency_class=latency_class)

    _defer(("class", latency_class_id), run)


def latency_class_policy_delete_on_commit(*, name: str) -> None:
    _defer(("class-delete", name), lambda: latency_class_policy_delete(name=name))


def resource_policy_sync_on_commit(*, resource_id: int) -> None:
    def run() -> None:
        resource = Resource.objects.filter(pk=resource_id).first()
        if resource is not None:
            resource_policy_sync(resource=resource)

    _defer(("resource", resource_id), run)


def resource_policy_delete_on_commit(*, name: str) -> None:
    _defer(("resource-delete", name), lambda: resource_policy_delete(name=name))


def pool_policy_sync_on_commit() -> None:
    def run() -> None:
        pool = PoolSettings.objects.filter(pk=1).first()
        if pool is not None:
            pool_policy_sync(pool=pool)

    _defer(("pool",), run)


def pool_policy_delete_on_commit() -> None:
    _defer(("pool-delete",), pool_policy_delete)


def api_keys_changed_on_commit() -> None:
    """After commit, tell every process that an API key changed (it drops its cached keys)."""
    _defer(("api-keys",), lambda: get_redis().incr(keys.AUTH_VERSION_KEY))
