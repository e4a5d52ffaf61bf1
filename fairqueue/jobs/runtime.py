"""Process-wide Redis clients and the engine, created lazily from settings.REDIS_URL.

They are keyed by URL, so a changed setting (tests pointing at an unreachable server)
takes effect without restarting the process.
"""

from __future__ import annotations

import functools

import redis
from django.conf import settings

from fairqueue.engine import Engine

# Fail fast when Redis is unreachable: callers fall back (jobs stay queued) instead of hanging.
_TIMEOUTS = {"socket_connect_timeout": 2.0, "socket_timeout": 5.0, "health_check_interval": 30}


@functools.cache
def _client_for(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True, **_TIMEOUTS)


@functools.cache
def _engine_for(url: str) -> Engine:
    return Engine(redis.Redis.from_url(url, decode_responses=True, **_TIMEOUTS))


def redis_client() -> redis.Redis:
    """Text-mode client for the jobs side's own small keys (signals, registry, stats)."""
    return _client_for(settings.REDIS_URL)


def engine() -> Engine:
    return _engine_for(settings.REDIS_URL)
