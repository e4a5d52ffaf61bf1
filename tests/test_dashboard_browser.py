"""A real browser on the real stack: the production web server (gunicorn + uvicorn worker
processes) + a worker + headless Chromium driven by Playwright.

Logs in through the admin as staff, opens /dashboard/, submits jobs through the HTTP API
and sees the tenant's numbers change without a reload; then restarts the server and sees
the page say it is disconnected and come back by itself. Screenshot: var/test-output/.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from datetime import timedelta

from django.utils import timezone

from fairqueue.jobs import cells
from fairqueue.jobs.models import Job
from tests.base import RedisTransactionTestCase
from tests.browser import OUTPUT, chromium_launch, chromium_require, staff_create, staff_login
from tests.factories import make_tenant
from tests.web import web_server
from tests.workers import WorkerProcess

# Sync Playwright runs an event loop in this thread; the ORM calls of the test itself are safe.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


class DashboardBrowserTests(RedisTransactionTestCase):
    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        chromium_require(self)
        staff_create()
        self.tenant, self.key = make_tenant("acme", max_concurrency=1)
        self.slow, self.slow_key = make_tenant("slowpoke", max_concurrency=1)
        # Two worker processes: the page and its websocket may be served by different ones.
        self.server = web_server(production=True, processes=2)
        self.server.start()
        self.addCleanup(self.server.stop)
        self.base = self.server.base_url

    def submit(self, n: int, *, key: str = "", seconds: float = 4, priority: str | None = None) -> None:
        for _ in range(n):
            body = json.dumps({"task": "demo.sleep", "args": {"seconds": seconds}, "priority": priority}).encode()
            request = urllib.request.Request(
                f"{self.base}/api/v1/jobs",
                data=body,
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {key or self.key}"},
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                self.assertIn(response.status, (200, 202))

    def test_live_dashboard_in_a_real_browser(self) -> None:
        from playwright.sync_api import expect, sync_playwright

        with WorkerProcess(slots=2), sync_playwright() as pw:
            # Another tenant, capped at 1, with a job parked behind a long one; it is made to
            # look 700 s old, past twice the `high` objective (300 s): a red cell.
            self.submit(2, key=self.slow_key, seconds=60, priority="high")
            Job.objects.filter(tenant=self.slow).update(submitted_at=timezone.now() - timedelta(seconds=700))
            cells.cells_rebuild()  # rows written straight to the database reach the cells so
            browser = chromium_launch(pw)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            try:
                staff_login(page, self.base, "/dashboard/")
                page.evaluate("window.__sameDocument = true")  # gone if the page ever reloads

                row = page.locator("tr[data-tenant=acme]")
                expect(page.locator("#conn-state")).to_have_text("live", timeout=10_000)
                expect(row.locator("td.in-flight")).to_have_text("0", timeout=10_000)
                expect(row.locator("td.parked")).to_have_text("0")
                expect(row.locator("td.limit")).to_have_text("1")
                expect(page.locator("#pool-slots")).to_have_text("2", timeout=10_000)
                cell = page.locator("td.cell[data-shard=default][data-class=high]")
                expect(cell).to_have_class("cell red")
                expect(page.locator("#red-list")).to_contain_text("default / high")

                self.submit(3)
                expect(row.locator("td.in-flight")).to_have_text("1", timeout=10_000)
                expect(row.locator("td.parked")).to_have_text("2 (default 2)", timeout=10_000)
                expect(page.locator("#pool-busy")).to_have_text("2", timeout=10_000)  # one each
                self.assertTrue(page.evaluate("window.__sameDocument === true"), "the page reloaded")
                page.wait_for_timeout(2500)  # let the sparklines draw a few ticks
                page.screenshot(path=str(OUTPUT / "dashboard.png"), full_page=True)

                # A server restart: the page says so, then reconnects by itself.
                self.server.stop()
                expect(page.locator("#conn-banner")).to_be_visible(timeout=10_000)
                expect(page.locator("#conn-banner")).to_have_text("Disconnected — reconnecting…")
                page.screenshot(path=str(OUTPUT / "dashboard-disconnected.png"), full_page=True)
                self.server.start()
                expect(page.locator("#conn-banner")).to_be_hidden(timeout=20_000)
                expect(page.locator("#conn-state")).to_have_text("live")
                self.assertTrue(page.evaluate("window.__sameDocument === true"), "the page reloaded")
            except Exception:
                page.screenshot(path=str(OUTPUT / "dashboard-failure.png"), full_page=True)
                raise
            finally:
                browser.close()

    def test_the_page_draws_documents_in_flight_engine_memory_and_the_quarantine_lane(self) -> None:
        from playwright.sync_api import expect, sync_playwright

        self.tenant.max_fan_out = 2
        self.tenant.max_concurrency = None  # the document's cap alone bounds its pages
        self.tenant.save()
        normal = WorkerProcess(slots=4, name="normal")
        lane = WorkerProcess(slots=1, name="lane", quarantine=True)
        with normal, lane, sync_playwright() as pw:
            browser = chromium_launch(pw)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            try:
                staff_login(page, self.base, "/dashboard/")
                expect(page.locator("#conn-state")).to_have_text("live", timeout=10_000)
                # The quarantine worker's slot is the lane's, not the pool's.
                expect(page.locator("#pool-slots")).to_have_text("4", timeout=10_000)
                expect(page.locator("#quarantine-workers")).to_have_text("1", timeout=10_000)
                expect(page.locator("#quarantine-unstaffed")).to_be_hidden()
                # The engine's memory, read from its Redis; this one has room, so the guard is off.
                expect(page.locator("#engine-memory-used")).to_have_text(re.compile(r"^\d+(\.\d)? (B|KiB|MiB|GiB)$"))
                expect(page.locator("#engine-memory-guard")).to_have_text("off")
                expect(page.locator("#documents-in-flight")).to_have_text("0")

                body = {"task": "demo.document", "args": {"pages": 8, "seconds_per_page": 1.5}}
                request = urllib.request.Request(
                    f"{self.base}/api/v1/jobs",
                    data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"},
                    method="POST",
                )
                with urllib.request.urlopen(request, timeout=10) as response:
                    document_id = json.loads(response.read())["id"]
                expect(page.locator("#documents-in-flight")).to_have_text("1", timeout=20_000)
                row = page.locator(f"#documents tr[data-document='{document_id}']")
                expect(row.locator("td.children")).to_have_text("8", timeout=10_000)
                expect(row.locator("td.running")).to_have_text("2", timeout=20_000)  # its fan-out cap
                page.screenshot(path=str(OUTPUT / "dashboard-documents.png"), full_page=True)
                # Done, the document leaves the panel.
                expect(page.locator("#documents-in-flight")).to_have_text("0", timeout=60_000)
                expect(page.locator("#documents tr.none")).to_be_visible()
            except Exception:
                page.screenshot(path=str(OUTPUT / "dashboard-documents-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
