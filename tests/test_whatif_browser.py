"""The what-if preview in a real browser: daphne + headless Chromium (as the dashboard's
browser test). A staff user opens a tenant, changes its hard max in the form, presses
Preview and sees the comparison table and the chart beside the live state, with the value
still in the form and nothing saved. Screenshot: var/test-output/whatif-preview.png
(a copy is docs/img/whatif-preview.png)."""

from __future__ import annotations

import os

from tenants.models import Tenant
from tests.base import RedisTransactionTestCase
from tests.browser import OUTPUT, chromium_launch, chromium_require, staff_create, staff_login
from tests.factories import make_tenant
from tests.test_whatif import rows_of_a_busy_half_hour
from tests.web import web_server

# Sync Playwright runs an event loop in this thread; the ORM calls of the test itself are safe.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


class WhatIfPreviewInABrowser(RedisTransactionTestCase):
    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        chromium_require(self)
        staff_create(superuser=True)
        steady, _ = make_tenant("steady", floor=1, shard_capacity=8)
        self.bursty, _ = make_tenant("bursty", floor=1, shard_capacity=8)
        rows_of_a_busy_half_hour(steady, self.bursty)
        self.server = web_server(production=True, processes=2)
        self.server.start()
        self.addCleanup(self.server.stop)
        self.base = self.server.base_url

    def test_preview_renders_the_comparison(self) -> None:
        from playwright.sync_api import expect, sync_playwright

        url = f"/admin/tenants/tenant/{self.bursty.pk}/change/"
        with sync_playwright() as pw:
            browser = chromium_launch(pw)
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            try:
                staff_login(page, self.base, url)
                expect(page.locator("#fq-live-state")).to_contain_text("limit")
                page.fill("#id_max_concurrency", "2")
                page.fill("input[name=_whatif_hours]", "1")
                page.click("#fq-preview-button")
                table = page.locator("#fq-whatif-table")
                expect(table).to_be_visible(timeout=60_000)
                expect(table.locator("tr", has_text="bursty")).to_contain_text("400")
                expect(table.locator("tr", has_text="steady")).to_contain_text("300")
                expect(page.locator("#fq-whatif")).to_contain_text("bursty.max_concurrency None -> 2")
                expect(page.locator("#fq-whatif svg.fq-chart polyline")).to_have_count(2)
                expect(page.locator("#id_max_concurrency")).to_have_value("2")  # still in the form
                page.locator("#fq-whatif").scroll_into_view_if_needed()
                page.screenshot(path=str(OUTPUT / "whatif-preview.png"), full_page=True)
            except Exception:
                page.screenshot(path=str(OUTPUT / "whatif-preview-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
        self.assertIsNone(Tenant.objects.get(pk=self.bursty.pk).max_concurrency, "a preview saves nothing")
