"""The dashboard websocket: staff only; sends the snapshot on connect, then every tick's."""

from __future__ import annotations

from typing import Any

import redis
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from dashboard import ticker
from dashboard.snapshot import snapshot_build

CLOSE_FORBIDDEN = 4403  # the page reads this code and stops reconnecting
CLOSE_TRY_AGAIN_LATER = 1013  # the channel layer is away: the page reconnects after a pause


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    watching = False

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not (user.is_authenticated and user.is_active and user.is_staff):
            # Accept first so the browser sees our close code (a refused handshake is a bare 1006).
            await self.accept()
            await self.close(code=CLOSE_FORBIDDEN)
            return
        try:
            await self.channel_layer.group_add(ticker.GROUP, self.channel_name)
        except (redis.RedisError, OSError):
            # The channel layer's Redis is away (a restart): say "try again later" rather than
            # fail the handshake with a 500; the page reconnects by itself.
            await self.accept()
            await self.close(code=CLOSE_TRY_AGAIN_LATER)
            return
        await self.accept()
        await self.send_json(await database_sync_to_async(snapshot_build)())
        self.watching = True
        ticker.watcher_add()

    async def disconnect(self, code: int) -> None:
        if self.watching:
            self.watching = False
            ticker.watcher_remove()
            await self.channel_layer.group_discard(ticker.GROUP, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """The page sends nothing that matters; ignore it."""

    async def queue_update(self, event: dict[str, Any]) -> None:
        await self.send_json(event["snapshot"])
