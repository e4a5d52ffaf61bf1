"""`/metrics`: our collector's series for a known state, bounded labels, the token, promtool."""

from __future__ import annotations

import shutil
import subprocess

from django.conf import settings
from django.test import Client, SimpleTestCase, override_settings
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from dashboard.metrics import TenantGaugeFamily, collector_register, metrics_render, tenant_family_text
from fairqueue.jobs import stats
from fairqueue.jobs.submission import JobRequest, job_submit
from tenants.policy import policy_invalidate
from tests.base import RedisTestCase
from tests.factories import make_tenant


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a whole exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class MetricsTests(RedisTestCase):
    def setUp(self) -> None:
        stats.flush()  # counts left over from earlier tests in this process...
        self.redis.delete(stats.STATS_KEY)  # ...must not leak into this one
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, _ = make_tenant("acme", max_concurrency=1)
            make_tenant("other")
        self.http = Client()

    def scrape(self, **headers: str) -> str:
        collector_register().invalidate()
        response = self.http.get("/metrics", **headers)
        self.assertEqual(response.status_code, 200, response.content[:200])
        return response.content.decode()

    def submit(self, n: int) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            for _ in range(n):
                job_submit(tenant=self.tenant, req=JobRequest(task="demo.sleep", args={"seconds": 5}))
        stats.flush()

    def test_series_for_a_known_state(self) -> None:
        self.submit(3)
        # Known release-latency cells (per bucket, not cumulative) as the workers would write them.
        self.redis.hset(
            stats.STATS_KEY,
            mapping={
                "release:bucket:0.001": 2,
                "release:bucket:0.01": 1,
                "release:bucket:+Inf": 1,
                "release:count": 4,
                "release:sum": 2.5,
                "finished:succeeded": 7,
            },
        )
        s = samples(self.scrape())
        acme = (("tenant", "acme"),)
        self.assertEqual(s[("fairqueue_tenant_limit", acme)], 1)
        self.assertEqual(s[("fairqueue_tenant_in_flight", acme)], 1)
        self.assertEqual(s[("fairqueue_tenant_parked", acme)], 2)
        self.assertEqual(s[("fairqueue_tenant_in_flight", (("tenant", "other"),))], 0)
        cell = (("class", "default"), ("shard", "default"))
        self.assertEqual(s[("fairqueue_queue_objective_seconds", cell)], 3600)
        self.assertEqual(s[("fairqueue_queue_waiting", cell)], 3)
        self.assertGreaterEqual(s[("fairqueue_queue_oldest_wait_seconds", cell)], 0)
        self.assertLess(s[("fairqueue_queue_oldest_wait_seconds", cell)], 60)
        critical = (("class", "critical"), ("shard", "default"))
        self.assertEqual(s[("fairqueue_queue_objective_seconds", critical)], 60)
        self.assertEqual(s[("fairqueue_queue_oldest_wait_seconds", critical)], 0)
        self.assertEqual(s[("fairqueue_worker_slots", ())], 0)  # no workers in this test
        self.assertEqual(s[("fairqueue_worker_slots_busy", ())], 0)
        self.assertEqual(s[("fairqueue_slot_utilisation_nonbatch", ())], 0)
        self.assertEqual(s[("fairqueue_jobs_submitted_total", ())], 3)
        self.assertEqual(s[("fairqueue_jobs_finished_total", (("status", "succeeded"),))], 7)
        self.assertEqual(s[("fairqueue_jobs_finished_total", (("status", "failed"),))], 0)
        # Admit latency was observed by the three submits.
        self.assertEqual(s[("fairqueue_admit_latency_seconds_count", ())], 3)
        self.assertEqual(s[("fairqueue_admit_latency_seconds_bucket", (("le", "+Inf"),))], 3)
        # Release: cumulative buckets built from the per-bucket cells.
        release = {le: s[("fairqueue_release_latency_seconds_bucket", (("le", le),))] for le in ("0.0005", "0.001")}
        self.assertEqual(release, {"0.0005": 0, "0.001": 2})
        self.assertEqual(s[("fairqueue_release_latency_seconds_bucket", (("le", "0.005"),))], 2)
        self.assertEqual(s[("fairqueue_release_latency_seconds_bucket", (("le", "0.01"),))], 3)
        self.assertEqual(s[("fairqueue_release_latency_seconds_bucket", (("le", "1.0"),))], 3)
        self.assertEqual(s[("fairqueue_release_latency_seconds_bucket", (("le", "+Inf"),))], 4)
        self.assertEqual(s[("fairqueue_release_latency_seconds_count", ())], 4)
        self.assertEqual(s[("fairqueue_release_latency_seconds_sum", ())], 2.5)

    def test_deleted_tenant_series_disappear(self) -> None:
        self.assertIn('fairqueue_tenant_limit{tenant="other"}', self.scrape())
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant.__class__.objects.filter(slug="other").delete()
        policy_invalidate()
        text = self.scrape()
        self.assertNotIn('tenant="other"', text)
        self.assertIn('fairqueue_tenant_limit{tenant="acme"}', text)

    def test_token_restriction(self) -> None:
        with override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "METRICS_TOKEN": "s3cret-token"}):
            self.assertEqual(self.http.get("/metrics").status_code, 401)
            self.assertEqual(self.http.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code, 401)
            self.assertEqual(self.http.get("/metrics", HTTP_AUTHORIZATION="Basic s3cret-token").status_code, 401)
            self.assertIn("fairqueue_worker_slots", self.scrape(HTTP_AUTHORIZATION="Bearer s3cret-token"))
        with override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "METRICS_TOKEN": ""}):
            self.assertIn("fairqueue_worker_slots", self.scrape())

    def test_promtool_finds_no_problem(self) -> None:
        promtool = shutil.which("promtool")
        if promtool is None:
            self.fail("promtool is not installed: `apt-get install prometheus` (.ci/run does) to lint /metrics")
        self.submit(2)
        self.http.get("/dashboard/")  # some django-prometheus request series too
        text = self.scrape()
        result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertEqual((result.stdout + result.stderr).strip(), "")


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


class TenantFamilyTextTests(SimpleTestCase):
    """metrics_render writes the per-tenant families itself: byte for byte what
    prometheus_client would have written, awkward label values and values included."""

    def family(self) -> TenantGaugeFamily:
        family = TenantGaugeFamily("fairqueue_tenant_limit", "A tenant's limit.\nSecond \\ line.", labels=["tenant"])
        for slug, value in [("acme", 1), ("b-2_x", 0), ('q"uo\\te\nnl', 2.5), ("big", 12345678), ("again", 1)]:
            family.add_metric([slug], value)
        return family

    def test_same_text_as_prometheus_client(self) -> None:
        expected = generate_latest(_Families([self.family()]))  # type: ignore[arg-type]
        self.assertEqual(tenant_family_text(self.family()).encode(), expected)

    def test_render_keeps_every_family(self) -> None:
        registry = CollectorRegistry()
        registry.register(_Families([self.family()]))  # type: ignore[arg-type]
        from_collector = samples(metrics_render(registry).decode())
        self.assertEqual(from_collector[("fairqueue_tenant_limit", (("tenant", "big"),))], 12345678)
        self.assertEqual(from_collector[("fairqueue_tenant_limit", (("tenant", 'q"uo\\te\nnl'),))], 2.5)
        self.assertEqual(len(from_collector), 5)
