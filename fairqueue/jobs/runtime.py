"""Process-wide Redis clients and the engine, created lazily from settings."""

from __future__ import annotations

import functools

import redis
from django.conf import settings

from fairqueue.engine import Engine


@functools.cache
def redis_client() -> redis.Redis:
    """Text-mode client for the jobs side's own small keys (signals, registry)."""
    return redis.Redis.from_url(settings.REDIS_URL, decode_responses=True, health_check_interval=30)


@functools.cache
def engine() -> Engine:
    return Engine(redis.Redis.from_url(settings.REDIS_URL, decode_responses=True, health_check_interval=30))


def queue_name(latency_class: str, *, batch: bool = False) -> str:
    """One Celery queue per latency class (plus the batch lane); workers take higher first."""
    return "fq.batch" if batch else f"fq.{latency_class}"
