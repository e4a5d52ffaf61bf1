"""Operators and customers can both see why a tenant's jobs wait: /api/v1/limits and the admin page."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.test import Client

from fairqueue.jobs.submission import JobRequest, job_submit
from tenants.policy import policy_invalidate
from tests.base import RedisTestCase
from tests.factories import make_tenant


class LimitsExplainedTests(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, self.key = make_tenant("explained", floor=3, max_concurrency=5, burst_floor=2)
        for _ in range(7):
            job_submit(tenant=self.tenant, req=JobRequest(task="demo.sleep", args={"seconds": 1}))

    def test_the_api_explains_every_term_of_the_limit(self) -> None:
        resp = Client().get("/api/v1/limits", HTTP_AUTHORIZATION=f"Bearer {self.key}")
        self.assertEqual(resp.status_code, 200)
        body = resp.json()
        self.assertEqual((body["tenant"], body["floor"], body["base"], body["hard_max"]), ("explained", 3, 3, 5))
        self.assertEqual(body["ceiling"], 5.0)  # 3 + max(2, 3 * 0.5)
        self.assertEqual(body["pressure_factor"], 1.0)  # no live workers registered: neutral
        self.assertEqual((body["limit"], body["in_flight"], body["parked"]), (5, 5, 2))
        self.assertEqual(body["idle_share"], 0)
        self.assertEqual(body["parked_by_priority"], {"20": 2})

    def test_the_admin_tenant_page_shows_the_same_explanation(self) -> None:
        staff = User.objects.create_superuser("ops", "ops@example.com", "pw")
        client = Client()
        client.force_login(staff)
        page = client.get(f"/admin/tenants/tenant/{self.tenant.pk}/change/")
        # The terms the API gives as fields, in words: ceiling 3 + max(2, 1.5) = 5, no
        # live worker (pressure 1), so the limit is the ceiling, within the hard max.
        self.assertContains(page, "limit 5 = max(ceiling 5 \N{MULTIPLICATION SIGN} pressure 1.00 = 5, floor 3) = 5")
        self.assertContains(page, "ceiling 5 = base 3 + max(burst floor 2, 50% of base)")
        self.assertContains(page, "pressure 1: no live worker")
        self.assertContains(page, "5 in flight, 2 parked; the oldest parked job (")
        self.assertContains(page, ") has 0 ahead of it on 2:t:explained, ETA 0.2 s.")  # 1 x 1 s default / 5
        self.assertContains(page, "Jobs in the database: 5 queued, 2 parked, 0 running.")
