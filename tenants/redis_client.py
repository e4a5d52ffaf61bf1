"""The client of the engine's Redis, shared by the tenants app and the jobs side.

Policy, the worker registry, stats and live signals live beside the engine's state, on the
server (or Redis Cluster) that FAIRQUEUE["ENGINE_URL"] names, REDIS_URL when it is empty. One
client per URL and process, created on first use: a changed setting (tests pointing at
another server) takes effect without restarting the process.
"""

from __future__ import annotations

import functools

from fairqueue.conf import engine_url
from fairqueue.engine.cluster import Client, connect

# Fail fast when Redis is unreachable: callers fall back (jobs stay queued, the last known
# policy is used) instead of hanging.
TIMEOUTS = {"socket_connect_timeout": 2.0, "socket_timeout": 5.0, "health_check_interval": 30}


@functools.cache
def client_for(url: str) -> Client:
    """A text-mode client of `url`: a cluster client if a Redis Cluster answers there."""
    return connect(url, decode_responses=True, **TIMEOUTS)


def get_redis() -> Client:
    """The shared client of the engine's Redis (decoded strings)."""
    return client_for(engine_url())
