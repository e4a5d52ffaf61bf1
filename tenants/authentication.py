"""API-key authentication with a per-process cache, so a request costs no database query.

A cached tenant row is used only while the policy marker (tenants.policy.policy_marker:
the policy version, the sync id and the API-key version, re-read from Redis every
CHECK_INTERVAL_SECONDS in the round trip the policy cache makes anyway) is the one it was
read under, and for at most MAX_AGE_SECONDS. A rotated key (the key version changes) or a
deactivated, edited or deleted tenant (the policy version changes) empties the cache of
every process at its next check, so the old key stops working within about a quarter of a
second. When Redis has not confirmed the marker within MARKER_MAX_AGE_SECONDS (an outage),
nothing cached is trusted: every request reads the database, as without a cache.

The tenant returned is shared between the requests of a process: treat it as read-only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import redis

from tenants.models import Tenant
from tenants.policy import PolicyMarker, policy_marker, policy_marker_nowait
from tenants.selectors import tenant_by_key_prefix

# A backstop for a key-version bump that never reached Redis (it was down at that moment).
MAX_AGE_SECONDS = 10.0
MAX_ENTRIES = 10_000  # prefixes tried with no tenant count too: keep a flood of junk keys bounded


@dataclass(frozen=True, slots=True)
class _Entry:
    tenant: Tenant | None  # None: no tenant has this key prefix
    read_at: float


_lock = threading.Lock()
_entries: dict[str, _Entry] = {}
_marker: PolicyMarker | None = None


def tenant_authenticate_cached(*, raw_key: str) -> Tenant | None:
    """The tenant owning this raw API key, or None (see the module docstring for freshness).
    Callers decide what an inactive tenant may do."""
    global _marker
    prefix = Tenant.prefix_of(raw_key or "")
    if prefix is None:
        return None
    try:
        marker = policy_marker()
    except redis.RedisError:
        marker = None
    now = time.monotonic()
    entry = None
    if marker is not None:
        with _lock:
            if marker != _marker:
                _entries.clear()
                _marker = marker
            entry = _entries.get(prefix)
    if entry is None or now - entry.read_at > MAX_AGE_SECONDS:
        entry = _Entry(tenant_by_key_prefix(prefix), now)
        if marker is not None:
            with _lock:
                if marker == _marker:
                    if len(_entries) >= MAX_ENTRIES:
                        _entries.clear()
                    _entries[prefix] = entry
    return _tenant_if_key_matches(entry, raw_key)


def tenant_authenticate_nowait(*, raw_key: str) -> tuple[bool, Tenant | None]:
    """(True, what tenant_authenticate_cached would answer) when the cache alone answers
    (the policy marker needs no Redis read now and this key's entry was cached under it),
    else (False, None): then ask tenant_authenticate_cached, from a thread. No I/O: for an
    async view's event loop (fairqueue/apiserver.py). The same freshness rules."""
    prefix = Tenant.prefix_of(raw_key or "")
    if prefix is None:
        return True, None
    marker = policy_marker_nowait()
    if marker is None:
        return False, None
    with _lock:
        entry = _entries.get(prefix) if marker == _marker else None
    if entry is None or time.monotonic() - entry.read_at > MAX_AGE_SECONDS:
        return False, None
    return True, _tenant_if_key_matches(entry, raw_key)


def _tenant_if_key_matches(entry: _Entry, raw_key: str) -> Tenant | None:
    tenant = entry.tenant
    if tenant is None or not tenant.check_api_key(raw_key):
        return None
    return tenant


def authentication_cache_clear() -> None:
    """Forget every cached key (tests)."""
    global _marker
    with _lock:
        _entries.clear()
        _marker = None
