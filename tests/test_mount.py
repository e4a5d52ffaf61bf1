"""FairQueue's URLs under a host's prefix: the index, the API (its fast ASGI handler too), its
docs, the dashboard and its websocket route all follow `include("fairqueue.urls")`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from django.contrib.auth import get_user_model
from django.core.asgi import get_asgi_application
from django.test import Client, override_settings

from fairqueue.apiserver import is_api_path
from fairqueue.mount import api_prefix, job_path, mount_prefix
from fairqueue.routing import fairqueue_http, websocket_urlpatterns
from tests.base import RedisTestCase

PREFIX = "/ops/queue/"


async def asgi_get(app: Any, path: str) -> tuple[int, dict[str, Any]]:
    """One GET through an ASGI application; its status and JSON body."""
    sent: list[dict[str, Any]] = []
    received = False

    async def receive() -> dict[str, Any]:
        nonlocal received
        if received:
            await asyncio.sleep(3600)
        received = True
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "root_path": ""}
    scope |= {"query_string": b"", "headers": [(b"host", b"testserver")], "server": ("testserver", 80)}
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


@override_settings(ROOT_URLCONF="tests.host_urls")
class MountedUnderAPrefixTests(RedisTestCase):
    def setUp(self) -> None:
        self.staff = get_user_model().objects.create_user("ops", password="pw-ops-123", is_staff=True)
        self.http = Client()

    def test_the_prefix_is_read_from_the_hosts_urls(self) -> None:
        self.assertEqual(mount_prefix(), PREFIX)
        self.assertEqual(api_prefix(), PREFIX + "api/")
        self.assertEqual(job_path(7), PREFIX + "api/v1/jobs/7")
        self.assertTrue(is_api_path({"path": PREFIX + "api/v1/jobs"}))
        self.assertFalse(is_api_path({"path": "/api/v1/jobs"}), "the root's /api/ is the host's own")
        self.assertEqual([str(p.pattern) for p in websocket_urlpatterns()], ["ops/queue/ws/dashboard/"])

    def test_the_index_leads_to_the_dashboard_admin_and_api_docs(self) -> None:
        self.assertContains(self.http.get("/"), "the host's own page")
        page = self.http.get(PREFIX)
        for link in (PREFIX + "dashboard/", "/staff/", PREFIX + "api/v1/docs", PREFIX + "api/v1/openapi.json"):
            self.assertContains(page, f'href="{link}"')
        self.assertEqual(self.http.get(PREFIX + "api/v1/docs").status_code, 200)
        self.assertEqual(self.http.get(PREFIX + "api/v1/openapi.json").status_code, 200)

    def test_the_dashboard_renders_under_the_prefix_and_points_its_websocket_there(self) -> None:
        self.assertIn("/staff/login/", self.http.get(PREFIX + "dashboard/")["Location"])
        self.http.force_login(self.staff)
        page = self.http.get(PREFIX + "dashboard/")
        self.assertEqual(page.status_code, 200)
        self.assertContains(page, f'data-ws-path="{PREFIX}ws/dashboard/"')
        self.assertContains(page, f"{PREFIX}dashboard/assets/dashboard.js")

    def test_the_api_answers_under_the_prefix_through_the_fast_handler(self) -> None:
        app = fairqueue_http(get_asgi_application())
        status, body = asyncio.run(asgi_get(app, PREFIX + "api/v1/limits"))
        self.assertEqual(status, 401)
        self.assertIn("error", body)
