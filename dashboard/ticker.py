"""The broadcaster: once per tick, one process builds the picture and fans it out.

Every process serving dashboard websockets runs a ticker task while it has watchers
(or `manage.py dashboard_ticker` runs one on its own, to keep history while nobody
watches). At each whole second each ticker tries `SET fq:dash:tick:<second> NX`; the one
that wins builds the snapshot, records the cells' and the shown tenants' history and sends
the bounded picture (dashboard.picture) to the channels group, so a hundred open browsers
across ten web processes still cost one build per tick; each page's consumer sends its
page what changed (dashboard.frames).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from dashboard.picture import picture_build
from fairqueue.jobs.failure_log import FailureLog
from fairqueue.jobs.runtime import redis_client

log = logging.getLogger("fairqueue.dashboard")
tick_failures = FailureLog(log, "dashboard")

GROUP = "dashboard"
TICK_SECONDS = 1.0
TICK_KEY_TTL_SECONDS = 10


def tick_claim(tick: int) -> bool:
    """True for exactly one process per tick (SET NX on a key named after the tick)."""
    return bool(redis_client().set(f"fq:dash:tick:{tick}", "1", nx=True, ex=TICK_KEY_TTL_SECONDS))


async def tick_once(tick: int) -> dict[str, Any] | None:
    """Build and broadcast this tick's picture if no other process has claimed the tick."""
    if not await database_sync_to_async(tick_claim)(tick):
        return None
    picture = await database_sync_to_async(picture_build)(record=True)
    layer = get_channel_layer()
    if layer is not None:
        await layer.group_send(GROUP, {"type": "queue.update", "picture": picture})
    return picture


async def ticker_run(*, tick_seconds: float = TICK_SECONDS) -> None:
    """Loop forever on tick boundaries; errors are logged and the next tick tries again."""
    while True:
        now = time.time()
        await asyncio.sleep(tick_seconds - (now % tick_seconds) + 0.001)
        try:
            await tick_once(int(time.time() // tick_seconds))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the channel layer's Redis away, say: the next tick tries again
            tick_failures.failed("tick", exc)
        else:
            tick_failures.succeeded("tick")


class _LoopTicker:
    def __init__(self) -> None:
        self.watchers = 0
        self.task: asyncio.Task[None] | None = None


# One ticker per event loop (daphne has one; tests may create several).
_tickers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopTicker] = weakref.WeakKeyDictionary()


def watcher_add() -> None:
    """A websocket started watching: make sure this process ticks."""
    loop = asyncio.get_running_loop()
    ticker = _tickers.setdefault(loop, _LoopTicker())
    ticker.watchers += 1
    if ticker.task is None or ticker.task.done():
        ticker.task = loop.create_task(ticker_run())


def watcher_remove() -> None:
    """A websocket went away; the last one stops this process's ticker."""
    ticker = _tickers.get(asyncio.get_running_loop())
    if ticker is None:
        return
    ticker.watchers -= 1
    if ticker.watchers <= 0:
        ticker.watchers = 0
        if ticker.task is not None:
            ticker.task.cancel()
            ticker.task = None
