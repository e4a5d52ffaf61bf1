"""The tenants open dashboard pages watch beyond the top N (pinned, searched for, opened),
so that the one build per tick carries their rows to every page, whichever process
serves it.

A sorted set: each slug scored by when its watch ends. A page renews its tenants every
WATCH_RENEW_SECONDS while it is open; a closed page's end by themselves within
WATCH_SECONDS. Several pages watching one tenant keep the latest end (ZADD GT).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from fairqueue.jobs.runtime import redis_client

WATCHED_KEY = "fq:dash:watched"
WATCH_SECONDS = 30.0
WATCH_RENEW_SECONDS = 10.0
WATCHED_MAX = 1000  # tenants a picture carries beyond the top N, however many pages watch


def watched_add(slugs: Iterable[str], *, now: float | None = None) -> None:
    """Watch these tenants for WATCH_SECONDS more (from now)."""
    until = (time.time() if now is None else now) + WATCH_SECONDS
    mapping = {slug: until for slug in slugs}
    if mapping:
        client = redis_client()
        client.zadd(WATCHED_KEY, mapping, gt=True)
        client.expire(WATCHED_KEY, int(WATCH_SECONDS) + 1)


def watched_read(*, now: float | None = None) -> set[str]:
    """The tenants some page watches now (the most recently renewed, at most WATCHED_MAX)."""
    now = time.time() if now is None else now
    pipe = redis_client().pipeline(transaction=False)
    pipe.zremrangebyscore(WATCHED_KEY, "-inf", now)
    pipe.zrevrange(WATCHED_KEY, 0, WATCHED_MAX - 1)
    return set(pipe.execute()[1])
