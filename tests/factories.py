"""Small helpers shared by tests: tenants with a fresh API key, mirrored into Redis."""

from __future__ import annotations

from django.db import transaction

from tenants.models import PoolSettings, Shard, Tenant
from tenants.policy import policy_invalidate
from tenants.sync import policy_sync_all


def pool_set(**fields: object) -> None:
    """Change pool settings and mirror them into Redis now."""
    pool = PoolSettings.load()
    for name, value in fields.items():
        setattr(pool, name, value)
    pool.save()
    policy_sync_all()
    policy_invalidate()


def quarantine_lane_off() -> None:
    """No quarantine lane: a job its worker died under runs again on any worker (and fails
    after FAIRQUEUE_POISON_PILL_LIMIT deaths), for tests of re-delivery to a survivor."""
    pool_set(quarantine_after_losses=0)


def make_tenant(
    slug: str,
    *,
    max_concurrency: int | None = None,
    batch_enabled: bool = False,
    active: bool = True,
    shard_name: str = "default",
    floor: int = 2,
    shard_capacity: int = 100,
    **fields: object,
) -> tuple[Tenant, str]:
    """Create a tenant with an API key and return (tenant, raw_key).

    In a TestCase, wrap the call in `self.captureOnCommitCallbacks(execute=True)` so the
    policy is mirrored into Redis; the cached policy snapshot is dropped either way.
    """
    shard, _ = Shard.objects.get_or_create(name=shard_name, defaults={"capacity": shard_capacity})
    if max_concurrency is not None:
        floor = min(floor, max_concurrency)
    tenant = Tenant(
        slug=slug,
        name=slug.title(),
        shard=shard,
        floor=floor,
        max_concurrency=max_concurrency,
        batch_enabled=batch_enabled,
        active=active,
        **fields,
    )
    raw_key = tenant.rotate_api_key()
    with transaction.atomic():
        tenant.save()
    policy_invalidate()
    return tenant, raw_key
