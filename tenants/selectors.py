"""Reads: API key authentication and a tenant's live state in Redis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from django.db.models import QuerySet

from tenants import keys
from tenants.models import Tenant
from tenants.redis_client import get_redis
from tenants.sync import subtenant_policy_mapping, tenant_policy_mapping


def tenant_by_key_prefix(prefix: str) -> Tenant | None:
    """The tenant whose API key has this lookup prefix (not yet checked against the key)."""
    return Tenant.objects.select_related("shard", "default_latency_class").filter(api_key_prefix=prefix).first()


def tenant_authenticate(*, raw_key: str) -> Tenant | None:
    """The tenant owning this raw API key, or None, read from the database (the API uses
    the cached tenants.authentication). Callers decide what an inactive tenant may do."""
    prefix = Tenant.prefix_of(raw_key or "")
    if prefix is None:
        return None
    tenant = tenant_by_key_prefix(prefix)
    if tenant is None or not tenant.check_api_key(raw_key):
        return None
    return tenant


MovePreviewProvider = Callable[[QuerySet[Tenant]], str | None]
_move_preview_providers: list[MovePreviewProvider] = []


def move_preview_provider_register(provider: MovePreviewProvider) -> None:
    """Let the jobs side say what moving or renaming tenants would do to their jobs."""
    if provider not in _move_preview_providers:
        _move_preview_providers.append(provider)


def tenants_move_preview(*, tenants: QuerySet[Tenant]) -> list[str]:
    """What moving or renaming these tenants (or their shard) would do, for the admin."""
    return [text for provider in _move_preview_providers if (text := provider(tenants))]


LiveStateProvider = Callable[[Tenant], dict[str, Any]]
_live_state_providers: list[LiveStateProvider] = []


def live_state_provider_register(provider: LiveStateProvider) -> None:
    """Let a layer above policy (the jobs side) add what it knows to the tenant's live state,
    without this app importing it."""
    if provider not in _live_state_providers:
        _live_state_providers.append(provider)


def tenant_live_state(*, tenant: Tenant) -> dict[str, Any]:
    """Label -> value of everything Redis holds about this tenant (values may be dicts).

    Insertion order is display order. Later issues append in-flight and parked counts.
    """
    state: dict[str, Any] = {}
    client = get_redis()
    try:
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(keys.tenant_key(tenant.slug))
        pipe.hgetall(keys.subtenants_key(tenant.slug))
        pipe.get(keys.VERSION_KEY)
        pipe.get(keys.SYNCED_KEY)
        policy, subs, global_version, synced = pipe.execute()
    except redis.RedisError as exc:
        state["Redis"] = f"unreachable: {exc}"
        return state

    state["Policy key"] = keys.tenant_key(tenant.slug)
    if policy:
        synced_fields = {k: v for k, v in policy.items() if k != "version"}
        expected = tenant_policy_mapping(tenant=tenant) if tenant.pk else {}
        differing = sorted(k for k in expected.keys() | synced_fields.keys() if expected.get(k) != synced_fields.get(k))
        state["Matches database"] = "yes" if not differing else "no, differs in: " + ", ".join(differing)
        state["Tenant policy version"] = policy.get("version", "")
        state["Synced policy"] = synced_fields
    else:
        state["Matches database"] = "no, not in Redis yet"
    expected_subs = subtenant_policy_mapping(tenant=tenant) if tenant.pk else {}
    state["Sub-tenant caps"] = subs or "none"
    if subs != expected_subs:
        state["Sub-tenant caps match database"] = "no"
    state["Global policy version"] = global_version or "0"
    state["Last full sync"] = synced or "never (Redis will resync itself on the next policy read)"
    for provider in _live_state_providers:
        try:
            state.update(provider(tenant))
        except Exception as exc:  # the admin page must render even if Redis misbehaves
            state[getattr(provider, "__name__", "provider")] = f"unavailable: {exc}"
    return state
