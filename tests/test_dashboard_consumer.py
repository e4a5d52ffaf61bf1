"""The dashboard websocket, through the real ASGI application (auth middleware, channels-redis):
the first picture, each tick's changes, and the answers to a page's pins, searches and opens."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client

from fairqueue.asgi import application
from fairqueue.jobs.submission import JobRequest, job_submit
from tests.base import RedisTransactionTestCase
from tests.factories import make_tenant

PICTURE_KEYS = {"ts", "generated_at", "top_n", "pool", "totals", "top", "rows", "grid", "red", "workers", "capacity"}
ROW_KEYS = {"slug", "name", "shard", "floor", "limit", "in_flight", "parked_by_class", "parked", "waiting"}


class DashboardConsumerTests(RedisTransactionTestCase):
    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        self.tenant, _ = make_tenant("acme", max_concurrency=1)
        make_tenant("acme-labs")
        other, _ = make_tenant("other")
        other.name = "Zeta Industries"
        other.save()
        User = get_user_model()
        self.staff = User.objects.create_user("ops", password="pw-ops-123", is_staff=True)
        self.plain = User.objects.create_user("customer", password="pw-cust-123")

    def session_cookie(self, user: Any) -> bytes:
        client = Client()
        client.force_login(user)
        return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()

    def communicator(self, cookie: bytes | None) -> WebsocketCommunicator:
        headers = [(b"origin", b"http://testserver")]
        if cookie:
            headers.append((b"cookie", cookie))
        return WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)

    async def staff_socket(self) -> tuple[WebsocketCommunicator, dict[str, Any]]:
        comm = self.communicator(await database_sync_to_async(self.session_cookie)(self.staff))
        connected, _ = await comm.connect()
        self.assertTrue(connected)
        first = await comm.receive_json_from(timeout=10)
        return comm, first

    async def reply(self, comm: WebsocketCommunicator, kind: str) -> dict[str, Any]:
        """The next frame of this kind (tick deltas may come first)."""
        while True:
            frame = await comm.receive_json_from(timeout=10)
            if frame["t"] == kind:
                return frame

    async def until(self, comm: WebsocketCommunicator, state: dict[str, Any], done: Callable[[], bool]) -> None:
        """Apply the tick's deltas to `state` (the page's rows) until `done()`."""

        async def run() -> None:
            while not done():
                frame = await self.reply(comm, "delta")
                for slug, row in frame.get("rows", {}).items():
                    state.setdefault(slug, {}).update(row)

        await asyncio.wait_for(run(), timeout=15)

    async def test_staff_gets_a_picture_then_what_changed(self) -> None:
        comm, first = await self.staff_socket()
        try:
            self.assertEqual(first["t"], "picture")
            self.assertTrue(set(first) >= PICTURE_KEYS, set(first))
            self.assertEqual(first["top"], ["acme", "acme-labs", "other"])  # idle: by slug
            acme = first["rows"]["acme"]
            self.assertTrue(set(acme) >= ROW_KEYS, acme)
            self.assertEqual((acme["in_flight"], acme["parked"], acme["limit"]), (0, 0, 1))
            self.assertEqual(first["totals"]["tenants"], 3)
            self.assertIn("default/default", first["grid"]["cells"])

            for _ in range(3):
                await database_sync_to_async(job_submit)(
                    tenant=self.tenant, req=JobRequest(task="demo.sleep", args={"seconds": 5})
                )
            rows = {slug: dict(row) for slug, row in first["rows"].items()}
            await self.until(comm, rows, lambda: (rows["acme"]["in_flight"], rows["acme"]["parked"]) == (1, 2))
            self.assertEqual(rows["acme"]["waiting"], 3)
        finally:
            await comm.disconnect()

    async def test_search_pins_and_one_tenant_opened(self) -> None:
        comm, _ = await self.staff_socket()
        try:
            await comm.send_json_to({"type": "search", "query": "ACME"})
            found = await self.reply(comm, "search")
            self.assertEqual([m["slug"] for m in found["matches"]], ["acme", "acme-labs"])
            self.assertEqual(found["total"], 2)
            self.assertEqual(set(found["rows"]), {"acme", "acme-labs"})
            await comm.send_json_to({"type": "search", "query": "zeta"})  # by name
            found = await self.reply(comm, "search")
            self.assertEqual([m["slug"] for m in found["matches"]], ["other"])
            self.assertEqual(found["rows"]["other"]["name"], "Zeta Industries")

            await comm.send_json_to({"type": "pins", "slugs": ["other", "gone-tenant"]})
            pins = await self.reply(comm, "pins")
            self.assertEqual(set(pins["rows"]), {"other"})
            self.assertEqual(pins["unknown"], ["gone-tenant"])

            # Opened: its live row and the points the ticks recorded for it (it is shown).
            await self.reply(comm, "delta")
            await self.reply(comm, "delta")
            await comm.send_json_to({"type": "open", "slug": "acme"})
            detail = await self.reply(comm, "detail")
            self.assertEqual(detail["row"]["slug"], "acme")
            self.assertGreaterEqual(len(detail["history"]), 1)
            self.assertEqual(detail["history"][-1][1:], [0, 0, None])  # in flight, waiting, oldest wait
            await comm.send_json_to({"type": "open", "slug": None})
            self.assertEqual((await self.reply(comm, "detail"))["slug"], None)
        finally:
            await comm.disconnect()

    async def test_a_bad_message_is_answered_and_the_socket_stays(self) -> None:
        comm, _ = await self.staff_socket()
        try:
            for message, says in (
                ({"type": "pins", "slugs": "acme"}, "list of tenant slugs"),
                ({"type": "pins", "slugs": ["x"] * 51}, "at most 50"),
                ({"type": "pins", "slugs": ["../admin"]}, "must be a tenant slug"),
                ({"type": "search", "query": 5}, "'query': a string"),
                ({"type": "search", "query": "x" * 101}, "at most 100"),
                ({"type": "open", "slug": "nobody"}, "no tenant 'nobody'"),
                ({"type": "drop tables"}, "unknown message type"),
                (["not", "an", "object"], "JSON object"),
            ):
                await comm.send_json_to(message)
                error = await self.reply(comm, "error")
                self.assertIn(says, error["message"], message)
            await comm.send_json_to({"type": "search", "query": "acme"})
            self.assertEqual((await self.reply(comm, "search"))["total"], 2)
        finally:
            await comm.disconnect()

    async def assert_refused(self, cookie: bytes | None) -> None:
        comm = self.communicator(cookie)
        await comm.connect()
        message = await comm.receive_output(timeout=5)
        self.assertEqual(message["type"], "websocket.close")
        self.assertEqual(message.get("code"), 4403)
        self.assertTrue(await comm.receive_nothing(timeout=0.3))  # no picture leaked
        await comm.wait()

    async def test_anonymous_is_refused(self) -> None:
        await self.assert_refused(None)

    async def test_non_staff_is_refused(self) -> None:
        cookie = await database_sync_to_async(self.session_cookie)(self.plain)
        await self.assert_refused(cookie)
