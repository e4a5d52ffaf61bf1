"""The dashboard websocket, through the real ASGI application (auth middleware, channels-redis)."""

from __future__ import annotations

import asyncio
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
from tests.test_dashboard_snapshot import assert_snapshot_shape


class DashboardConsumerTests(RedisTransactionTestCase):
    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        self.tenant, _ = make_tenant("acme", max_concurrency=1)
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

    async def test_staff_gets_a_snapshot_then_updates_after_jobs_change(self) -> None:
        cookie = await database_sync_to_async(self.session_cookie)(self.staff)
        comm = self.communicator(cookie)
        connected, _ = await comm.connect()
        self.assertTrue(connected)
        try:
            first = await comm.receive_json_from(timeout=10)
            assert_snapshot_shape(self, first)
            acme = next(t for t in first["tenants"] if t["slug"] == "acme")
            self.assertEqual((acme["in_flight"], acme["parked"], acme["limit"]), (0, 0, 1))

            for _ in range(3):
                await database_sync_to_async(job_submit)(
                    tenant=self.tenant, req=JobRequest(task="demo.sleep", args={"seconds": 5})
                )

            # The broadcaster ticks once a second; wait for a snapshot that shows the jobs.
            async def changed() -> dict[str, Any]:
                while True:
                    snap = await comm.receive_json_from(timeout=10)
                    acme = next(t for t in snap["tenants"] if t["slug"] == "acme")
                    if acme["in_flight"] == 1 and acme["parked"] == 2:
                        return snap

            snap = await asyncio.wait_for(changed(), timeout=15)
            assert_snapshot_shape(self, snap)
            self.assertGreater(snap["generated_ts"], first["generated_ts"])
            default = next(c for c in snap["cells"] if c["class"] == "default")
            self.assertEqual(default["waiting"], 3)
            self.assertEqual(default["state"], "green")
            self.assertTrue(default["history"])  # the broadcaster recorded this tick
        finally:
            await comm.disconnect()

    async def assert_refused(self, cookie: bytes | None) -> None:
        comm = self.communicator(cookie)
        await comm.connect()
        message = await comm.receive_output(timeout=5)
        self.assertEqual(message["type"], "websocket.close")
        self.assertEqual(message.get("code"), 4403)
        self.assertTrue(await comm.receive_nothing(timeout=0.3))  # no snapshot leaked
        await comm.wait()

    async def test_anonymous_is_refused(self) -> None:
        await self.assert_refused(None)

    async def test_non_staff_is_refused(self) -> None:
        cookie = await database_sync_to_async(self.session_cookie)(self.plain)
        await self.assert_refused(cookie)
