"""Recent policy changes as markers on the dashboard's time charts: once a change commits,
its one-line summary goes into a short sorted set in Redis (by time), which the dashboard's
snapshot reads with its other reads, so a latency change shows beside the policy change
that caused it. Redis losing the set loses only the markers; the history is in the database."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import redis
from django.db import transaction

from tenants import keys
from tenants.changes import ChangeEntry
from tenants.redis_client import get_redis

log = logging.getLogger("fairqueue.tenants.change_markers")

MARKERS_KEPT = 100  # the newest this many changes are kept (a few hours of a busy day's edits)
TEXT_MAX = 300


def marker_of(entry: ChangeEntry) -> dict[str, Any]:
    return {
        "ts": round(entry.date.timestamp(), 3),
        "id": f"{entry.model_name}:{entry.history_id}",
        "text": entry.summary()[:TEXT_MAX],
        "user": entry.user,
        "source": entry.record.history_source,
    }


def markers_push_on_commit(entries: Iterable[ChangeEntry]) -> None:
    """After the transaction commits, add these changes to the markers."""
    markers = {json.dumps(marker_of(e), sort_keys=True): e.date.timestamp() for e in entries}
    if not markers:
        return

    def push() -> None:
        try:
            pipe = get_redis().pipeline(transaction=False)
            pipe.zadd(keys.CHANGE_MARKERS_KEY, markers)
            pipe.zremrangebyrank(keys.CHANGE_MARKERS_KEY, 0, -MARKERS_KEPT - 1)
            pipe.execute()
        except redis.RedisError:
            log.warning("Could not add a policy change marker to Redis (the change itself is saved)", exc_info=True)

    transaction.on_commit(push)


def markers_parse(raw: Iterable[str | bytes]) -> list[dict[str, Any]]:
    """The markers as read (ZRANGE, oldest first); anything unreadable is skipped."""
    out = []
    for item in raw:
        try:
            marker = json.loads(item)
        except ValueError:
            continue
        if isinstance(marker, dict) and isinstance(marker.get("ts"), int | float):
            out.append(marker)
    return out
