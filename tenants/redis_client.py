"""The one Redis client the tenants app uses, created lazily from settings.REDIS_URL."""

from __future__ import annotations

import threading

import redis
from django.conf import settings

_lock = threading.Lock()
_client: redis.Redis | None = None
_client_url: str | None = None


def get_redis() -> redis.Redis:
    """A shared client (decoded strings); rebuilt if settings.REDIS_URL changes (tests override it)."""
    global _client, _client_url
    url = settings.REDIS_URL
    client = _client
    if client is not None and _client_url == url:
        return client
    with _lock:
        if _client is None or _client_url != url:
            _client = redis.Redis.from_url(url, decode_responses=True)
            _client_url = url
        return _client
