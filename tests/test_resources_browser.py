"""The dashboard's outside resources in headless Chromium, on the production web server:
the configured and effective limit of a resource, updated live as it backs off."""

from __future__ import annotations

import os

from tenants.models import Resource
from tenants.policy import policy_invalidate, policy_snapshot
from tenants.resource_limits import resource_refused
from tests.base import RedisTransactionTestCase
from tests.browser import OUTPUT, chromium_launch, chromium_require, staff_create, staff_login
from tests.web import web_server
from tests.workers import wait_for

# Sync Playwright runs an event loop in this thread; the ORM calls of the test itself are safe.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


class ResourcesBrowserTests(RedisTransactionTestCase):
    serialized_rollback = True

    def test_dashboard_shows_the_effective_limit_live(self) -> None:
        from playwright.sync_api import expect, sync_playwright  # optional: only browser tests need it

        chromium_require(self)
        staff_create()
        Resource.objects.create(name="llm", limit=8, decrease_factor=0.5)

        def synced() -> bool:
            policy_invalidate()
            return "llm" in policy_snapshot().resources

        wait_for(synced, timeout=10, message="the resource to reach Redis")
        resource = policy_snapshot().resources["llm"]
        server = web_server(production=True, processes=1)
        server.start()
        self.addCleanup(server.stop)
        with sync_playwright() as pw:
            browser = chromium_launch(pw)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            try:
                staff_login(page, server.base_url, "/dashboard/")
                row = page.locator("tr[data-resource=llm]")
                expect(row.locator("td.configured")).to_have_text("8", timeout=15_000)
                expect(row.locator("td.effective")).to_have_text("8")
                resource_refused(resource, started_ms=None, retry_after_seconds=None)
                expect(row.locator("td.effective")).to_have_text("4", timeout=15_000)
                resource_refused(resource, started_ms=None, retry_after_seconds=60)
                expect(row.locator("td.effective")).to_contain_text("0 (paused", timeout=15_000)
                page.screenshot(path=str(OUTPUT / "dashboard-resources.png"), full_page=True)
            except Exception:
                page.screenshot(path=str(OUTPUT / "dashboard-resources-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
