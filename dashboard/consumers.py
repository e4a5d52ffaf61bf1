"""The dashboard websocket: staff only. On connect the page's first picture, then each
tick's changes (dashboard.frames), and the answers to what the page asks
(dashboard.page_messages): its pinned tenants' rows, a search, one tenant opened.

Frames sent (compact JSON, `t` says which):
    {"t": "picture", ...}   dashboard.picture's shape, rows cut to what the page shows
    {"t": "delta", ...}     what changed since the last frame (dashboard.frames)
    {"t": "pins", "rows": {slug: row}, "unknown": [slug, ...]}
    {"t": "search", "query", "matches": [{"slug", "name", "shard", "active"}], "total", "rows": {slug: row}}
    {"t": "detail", "slug", "row", "history": [[ts, in_flight, waiting, oldest_wait_s], ...]}
    {"t": "error", "message"}   a message the page sent was not understood; nothing changed
"""

from __future__ import annotations

import time
from typing import Any

import redis
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from dashboard import ticker
from dashboard.frames import PageView, frame_encode
from dashboard.page_messages import MessageError, Open, Pins, Search, message_parse
from dashboard.picture import picture_latest
from dashboard.tenant_history import tenant_history_read
from dashboard.tenant_lookup import tenant_rows_now, tenants_search
from dashboard.watched import WATCH_RENEW_SECONDS, watched_add

CLOSE_FORBIDDEN = 4403  # the page reads this code and stops reconnecting
CLOSE_TRY_AGAIN_LATER = 1013  # the channel layer is away: the page reconnects after a pause


def _watch_and_read(slugs: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Watch these tenants (the next ticks' pictures carry them) and read their rows now."""
    watched_add(slugs)
    return tenant_rows_now(slugs)


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    watching = False

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not (user.is_authenticated and user.is_active and user.is_staff):
            # Accept first so the browser sees our close code (a refused handshake is a bare 1006).
            await self.accept()
            await self.close(code=CLOSE_FORBIDDEN)
            return
        self.page = PageView()
        self.renewed = 0.0
        try:
            await self.channel_layer.group_add(ticker.GROUP, self.channel_name)
        except (redis.RedisError, OSError):
            # The channel layer's Redis is away (a restart): say "try again later" rather than
            # fail the handshake with a 500; the page reconnects by itself.
            await self.accept()
            await self.close(code=CLOSE_TRY_AGAIN_LATER)
            return
        await self.accept()
        await self.send_json(self.page.first(await database_sync_to_async(picture_latest)()))
        self.watching = True
        ticker.watcher_add()

    async def disconnect(self, code: int) -> None:
        if self.watching:
            self.watching = False
            ticker.watcher_remove()
            await self.channel_layer.group_discard(ticker.GROUP, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if not self.watching:
            return
        try:
            message = message_parse(content)
        except MessageError as error:
            await self.send_json({"t": "error", "message": str(error)})
            return
        if isinstance(message, Pins):
            self.page.pinned = message.slugs
            rows = await database_sync_to_async(_watch_and_read)(message.slugs)
            unknown = [slug for slug in message.slugs if slug not in rows]
            await self.send_json({"t": "pins", "rows": self.page.rows_sent(rows.values()), "unknown": unknown})
        elif isinstance(message, Search):
            result = await database_sync_to_async(tenants_search)(message.query)
            self.page.searched = tuple(m["slug"] for m in result.matches)
            rows = await database_sync_to_async(_watch_and_read)(self.page.searched)
            await self.send_json(
                {
                    "t": "search",
                    "query": result.query,
                    "matches": result.matches,
                    "total": result.total,
                    "rows": self.page.rows_sent(rows.values()),
                }
            )
        elif isinstance(message, Open):
            await self._open(message.slug)

    async def _open(self, slug: str | None) -> None:
        self.page.opened = None
        if slug is None:
            await self.send_json({"t": "detail", "slug": None})
            return
        rows = await database_sync_to_async(_watch_and_read)((slug,))
        if slug not in rows:
            await self.send_json({"t": "error", "message": f"no tenant {slug!r}"})
            return
        self.page.opened = slug
        history = await database_sync_to_async(tenant_history_read)(slug)
        row = self.page.rows_sent(rows.values())[slug]
        await self.send_json({"t": "detail", "slug": slug, "row": row, "history": history})

    async def queue_update(self, event: dict[str, Any]) -> None:
        if not self.watching:
            return
        frame = self.page.next(event["picture"])
        if frame is not None:
            await self.send_json(frame)
        own = self.page.own
        now = time.time()
        if own and now - self.renewed >= WATCH_RENEW_SECONDS:
            self.renewed = now
            await database_sync_to_async(watched_add)(own)

    @classmethod
    async def encode_json(cls, content: Any) -> str:
        return frame_encode(content)
