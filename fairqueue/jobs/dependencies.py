"""Whether each service FairQueue depends on answers now, as this process sees it: the
database, the engine's Redis, the broker and the channel layer's Redis.

Each is probed with a short timeout and the answers are kept for a moment, so a burst of
scrapes or dashboard ticks costs one probe each. `/metrics` exports them as
`fairqueue_dependency_up{dependency}` and the dashboard shows which one is away.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis
from django.conf import settings
from django.db import connections

from fairqueue.jobs.broker import broker_ping
from fairqueue.jobs.database import TRANSIENT_DB_ERRORS, connections_heal
from fairqueue.jobs.runtime import redis_client

log = logging.getLogger("fairqueue.jobs.dependencies")

DATABASE, ENGINE, BROKER, CHANNELS = "database", "engine", "broker", "channels"
DEPENDENCIES = (DATABASE, ENGINE, BROKER, CHANNELS)
CACHE_SECONDS = 2.0
PROBE_TIMEOUT_SECONDS = 2.0

_lock = threading.Lock()
_kept: tuple[float, dict[str, bool]] | None = None


def _database() -> None:
    try:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT 1")
    except TRANSIENT_DB_ERRORS:
        connections_heal()
        raise


def _engine() -> None:
    redis_client().ping()


def _channels() -> None:
    client = redis.Redis.from_url(
        settings.CHANNELS_REDIS_URL,
        socket_connect_timeout=PROBE_TIMEOUT_SECONDS,
        socket_timeout=PROBE_TIMEOUT_SECONDS,
    )
    try:
        client.ping()
    finally:
        client.close()


PROBES: dict[str, Callable[[], object]] = {
    DATABASE: _database,
    ENGINE: _engine,
    BROKER: lambda: broker_ping(timeout=PROBE_TIMEOUT_SECONDS),
    CHANNELS: _channels,
}


def dependencies_up(*, max_age: float = CACHE_SECONDS) -> dict[str, bool]:
    """{dependency: answers now}, probed at most every `max_age` seconds per process."""
    global _kept
    with _lock:
        kept = _kept
        if kept is not None and time.monotonic() - kept[0] < max_age:
            return kept[1]
        up: dict[str, bool] = {}
        for name, probe in PROBES.items():
            try:
                probe()
                up[name] = True
            except Exception as exc:  # any failure means: not usable from here now
                log.debug("dependency %s does not answer: %s", name, exc)
                up[name] = False
        _kept = (time.monotonic(), up)
        return up
