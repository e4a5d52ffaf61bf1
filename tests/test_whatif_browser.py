"""The what-if preview in a real browser: daphne + headless Chromium (as the dashboard's
browser test). A staff user opens a tenant, changes its hard max in the form, presses
Preview and sees the comparison table and the chart beside the live state, with the value
still in the form and nothing saved. Screenshot: var/test-output/whatif-preview.png
(a copy is docs/img/whatif-preview.png)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from django.contrib.auth import get_user_model

from tenants.models import Tenant
from tests.base import RedisTransactionTestCase
from tests.factories import make_tenant
from tests.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, OUTPUT
from tests.test_whatif import rows_of_a_busy_half_hour
from tests.web import web_server

# Sync Playwright runs an event loop in this thread; the ORM calls of the test itself are safe.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


class WhatIfPreviewInABrowser(RedisTransactionTestCase):
    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
            self.fail("Chromium is missing: `apt-get install chromium` (.ci/run does) to run the browser test")
        get_user_model().objects.create_user("ops", password="pw-ops-123", is_staff=True, is_superuser=True)
        steady, _ = make_tenant("steady", floor=1, shard_capacity=8)
        self.bursty, _ = make_tenant("bursty", floor=1, shard_capacity=8)
        rows_of_a_busy_half_hour(steady, self.bursty)
        self.server = web_server(production=True, processes=2)
        self.server.start()
        self.addCleanup(self.server.stop)
        self.base = self.server.base_url

    def test_preview_renders_the_comparison(self) -> None:
        from playwright.sync_api import expect, sync_playwright

        OUTPUT.mkdir(parents=True, exist_ok=True)
        url = f"/admin/tenants/tenant/{self.bursty.pk}/change/"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            try:
                page.goto(f"{self.base}/admin/login/?next={url}")
                page.fill("#id_username", "ops")
                page.fill("#id_password", "pw-ops-123")
                page.click("input[type=submit]")
                page.wait_for_url(f"{self.base}{url}")
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
