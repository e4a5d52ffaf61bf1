"""The page itself: staff only, linked from the admin index, assets served by the project."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.test import Client

from tests.base import RedisTestCase
from tests.factories import make_tenant


class DashboardPageTests(RedisTestCase):
    def setUp(self) -> None:
        User = get_user_model()
        self.staff = User.objects.create_user("ops", password="pw-ops-123", is_staff=True)
        self.plain = User.objects.create_user("customer", password="pw-cust-123")
        self.http = Client()

    def test_anonymous_and_non_staff_are_sent_to_login(self) -> None:
        response = self.http.get("/dashboard/")
        self.assertEqual(response.status_code, 302)
        self.assertIn("/admin/login/", response["Location"])
        self.http.force_login(self.plain)
        self.assertEqual(self.http.get("/dashboard/").status_code, 302)

    def test_staff_sees_the_page_and_the_admin_links_to_it(self) -> None:
        self.http.force_login(self.staff)
        page = self.http.get("/dashboard/")
        self.assertEqual(page.status_code, 200)
        self.assertContains(page, 'id="conn-banner"')
        self.assertContains(page, "/dashboard/assets/dashboard.js")
        self.assertNotContains(page, "https://")  # no CDN
        index = self.http.get("/admin/")
        self.assertContains(index, "/admin/dashboard/dashboard/")
        self.assertRedirects(self.http.get("/admin/dashboard/dashboard/"), "/dashboard/", fetch_redirect_response=False)

    def test_assets_are_served_without_collectstatic(self) -> None:
        for name, kind in (("dashboard.js", "javascript"), ("dashboard.css", "css")):
            response = self.http.get(f"/dashboard/assets/{name}")
            self.assertEqual(response.status_code, 200)
            self.assertIn(kind, response["Content-Type"])
        self.assertEqual(self.http.get("/dashboard/assets/..%2Fviews.py").status_code, 404)

    def test_a_tenant_row_links_to_its_admin_page(self) -> None:
        tenant, _ = make_tenant("acme")
        url = "/dashboard/tenants/acme/admin/"
        self.assertIn("/admin/login/", self.http.get(url)["Location"])  # staff only
        self.http.force_login(self.staff)
        self.assertRedirects(
            self.http.get(url), f"/admin/tenants/tenant/{tenant.pk}/change/", fetch_redirect_response=False
        )
        missing = self.http.get("/dashboard/tenants/nobody/admin/")
        self.assertEqual(missing.status_code, 404)
        self.assertIn(b"No tenant with the slug 'nobody'", missing.content)
