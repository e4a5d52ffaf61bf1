"""Policy changes in a real browser (headless Chromium, the production web server): a change
shows as a marker on the dashboard's time charts, and one click on its Revert button in the
admin's timeline reverts it, which shows as a marker of its own. Screenshots: var/test-output/."""

from __future__ import annotations

import os

from tenants.models import Tenant
from tests.base import RedisTransactionTestCase
from tests.browser import OUTPUT, chromium_launch, chromium_require, staff_create, staff_login
from tests.factories import make_tenant
from tests.web import web_server

# Sync Playwright runs an event loop in this thread; the ORM calls of the test itself are safe.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


class PolicyBrowserTests(RedisTransactionTestCase):
    serialized_rollback = True  # the rows and groups the migrations make survive the flush

    def setUp(self) -> None:
        super().setUp()
        chromium_require(self)
        staff_create(superuser=True)
        self.tenant, _ = make_tenant("acme", floor=2)
        self.server = web_server(production=True, processes=1)
        self.server.start()
        self.addCleanup(self.server.stop)
        self.base = self.server.base_url

    def test_a_change_is_a_marker_on_the_charts_and_one_click_reverts_it(self) -> None:
        from playwright.sync_api import expect, sync_playwright

        with sync_playwright() as pw:
            browser = chromium_launch(pw)
            context = browser.new_context(viewport={"width": 1280, "height": 1000})
            page = context.new_page()
            try:
                staff_login(page, self.base, "/dashboard/")
                expect(page.locator("#conn-state")).to_have_text("live", timeout=10_000)
                page.wait_for_timeout(3000)  # a few ticks of the cells' history to draw on
                tenant = Tenant.objects.get(pk=self.tenant.pk)
                tenant.floor = 6
                tenant._change_reason = "night shift"  # type: ignore[attr-defined]
                tenant.save()

                capacity_marks = page.locator("#capacity-chart line.policy-change")
                expect(capacity_marks).to_have_count(2, timeout=10_000)  # its creation and the change
                expect(capacity_marks.last.locator("title")).to_contain_text("tenant acme changed: floor: 2 → 6")
                cell_marks = page.locator("td.cell[data-shard=default][data-class=default] line.policy-change")
                expect(cell_marks).to_have_count(1, timeout=10_000)  # the cell's history began after the creation
                page.screenshot(path=str(OUTPUT / "policy-markers.png"), full_page=True)

                changes = context.new_page()  # the same login, another tab
                changes.goto(f"{self.base}/admin/tenants/policychange/")
                row = changes.locator("#fq-changes tbody tr").first
                expect(row).to_contain_text("night shift")
                changes.screenshot(path=str(OUTPUT / "policy-changes.png"), full_page=True)
                row.locator("input.fq-revert").click()
                expect(changes.locator(".messagelist")).to_contain_text("Reverted tenant acme changed: floor: 2 → 6")
                self.assertEqual(Tenant.objects.get(pk=self.tenant.pk).floor, 2)

                expect(capacity_marks).to_have_count(3, timeout=10_000)
                expect(capacity_marks.last.locator("title")).to_contain_text("floor: 6 → 2 (ops, admin)")
            except Exception:
                page.screenshot(path=str(OUTPUT / "policy-markers-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
