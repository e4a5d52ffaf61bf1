"""Process-wide clients of the engine's Redis and the engine, created lazily from settings.

Engine state and the jobs side's fleet-wide keys (worker registry, stats, live signals,
duty lease) share one client of FAIRQUEUE["ENGINE_URL"] (REDIS_URL when it is empty), a Redis
Cluster client when that URL is a cluster node. They are keyed by URL, so a changed setting
(tests pointing at an unreachable server) takes effect without restarting the process.
"""

from __future__ import annotations

import functools

from fairqueue.engine import Engine
from fairqueue.engine.cluster import Client
from tenants.redis_client import client_for, engine_url


@functools.cache
def _engine_for(url: str) -> Engine:
    return Engine(client_for(url))


def redis_client() -> Client:
    """Text-mode client for the jobs side's own small keys (signals, registry, stats)."""
    return client_for(engine_url())


def engine() -> Engine:
    return _engine_for(engine_url())
