"""Backlog quotas, the submission rate and the memory guard (fairqueue.jobs.quotas,
fairqueue.jobs.memory_guard): a submit past one is a 429 in the API's error shape with a
Retry-After, and writes nothing (no row, no cell entry, no engine state).

No workers run: admitted jobs stay `queued` (waiting) in the test Redis, so every job
submitted counts against its tenant's backlog until the test ends.
"""

from __future__ import annotations

import threading
from typing import Any

from django.db import connection
from django.test import override_settings

from fairqueue.jobs import cells
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.memory_guard import GUARD_KEY, guard_cap, guard_state, memory_guard_forget, memory_guard_step
from fairqueue.jobs.models import Job
from fairqueue.jobs.submission import JobRequest, job_submit_bulk
from tenants.models import PoolSettings
from tenants.policy import policy_invalidate
from tests.base import RedisTransactionTestCase
from tests.factories import make_tenant
from tests.redis_server import RedisServer
from tests.test_jobs_api import BULK, JOBS, ApiTestCase, sleep_job

LIMITS = "/api/v1/limits"


class QuotaTestCase(ApiTestCase):
    def pool(self, **fields: Any) -> None:
        pool = PoolSettings.load()
        for name, value in fields.items():
            setattr(pool, name, value)
        with self.captureOnCommitCallbacks(execute=True):
            pool.save()
        policy_invalidate()

    def waiting(self, slug: str = "acme", cls: str = "default") -> int:
        return cells.cells_count([cells.tenant_cell(slug, cls)])[cells.tenant_cell(slug, cls)]

    def assert_refused(self, response: Any, code: str, quota: str) -> int:
        """A 429 in the error shape, naming the quota, with a whole-second Retry-After."""
        error = self.assert_error(response, 429, code)
        self.assertIn(quota, error["message"])
        retry_after = int(response["Retry-After"])
        self.assertGreaterEqual(retry_after, 1)
        return retry_after


class BacklogQuotaTests(QuotaTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.tenant, self.key = self.tenant_with("quota-t", backlog_quota=3, batch_enabled=True, batch_backlog_quota=2)

    def test_a_single_submit_past_the_quota_is_refused_exactly(self) -> None:
        for _ in range(3):
            self.submit()
        before = set(Job.objects.values_list("id", flat=True))
        retry_after = self.assert_refused(self.post(JOBS, sleep_job()), "backlog_quota_exceeded", "backlog_quota")
        self.assertLessEqual(retry_after, 3600)
        self.assertEqual(set(Job.objects.values_list("id", flat=True)), before, "a refused submit wrote a row")
        self.assertEqual(self.waiting("quota-t"), 3, "a refused submit entered the cells")

    def test_a_bulk_past_the_quota_is_refused_whole_and_one_that_fits_is_taken(self) -> None:
        self.submit()
        response = self.post(BULK, {"jobs": [sleep_job() for _ in range(3)]})
        self.assert_refused(response, "backlog_quota_exceeded", "backlog_quota")
        self.assertIn("1 wait and this request adds 3", response.json()["error"]["message"])
        self.assertEqual(Job.objects.filter(tenant=self.tenant).count(), 1, "half a bulk was written")
        self.assertEqual(self.waiting("quota-t"), 1)
        response = self.post(BULK, {"jobs": [sleep_job() for _ in range(2)]})
        self.assertEqual(response.status_code, 202, response.content)
        self.assertEqual(Job.objects.filter(tenant=self.tenant).count(), 3)
        self.assertEqual(self.waiting("quota-t"), 3)

    def test_the_batch_lane_has_its_own_quota(self) -> None:
        for _ in range(3):
            self.submit()
        # The interactive lane is full; the batch lane counts apart.
        for _ in range(2):
            self.submit(sleep_job(batch=True))
        self.assert_refused(self.post(JOBS, sleep_job(batch=True)), "backlog_quota_exceeded", "batch_backlog_quota")
        self.assertEqual(Job.objects.filter(tenant=self.tenant, batch=True).count(), 2)
        # A mixed bulk is refused whole when one lane would pass its quota.
        mixed = {"jobs": [sleep_job(batch=True), sleep_job()]}
        self.assertEqual(self.post(BULK, mixed).status_code, 429)
        self.assertEqual(Job.objects.filter(tenant=self.tenant).count(), 5)

    def test_another_tenant_is_not_held_by_a_full_one(self) -> None:
        for _ in range(3):
            self.submit()
        _, other = self.tenant_with("other-t", backlog_quota=3)
        self.submit(key=other)
        self.assertEqual(self.waiting("other-t"), 1)

    def test_limits_shows_the_quotas_and_what_waits(self) -> None:
        self.submit()
        self.submit(sleep_job(batch=True))
        quotas = self.get(LIMITS).json()["quotas"]
        self.assertEqual(
            quotas,
            {
                "backlog_quota": 3,
                "waiting": 1,
                "batch_backlog_quota": 2,
                "batch_waiting": 1,
                "submit_rate": 0.0,
                "submit_burst": 1000,
            },
        )

    def test_the_pool_default_applies_without_an_override(self) -> None:
        self.pool(backlog_quota=2)
        _, other = self.tenant_with("default-t")
        self.submit(key=other)
        self.submit(key=other)
        self.assertEqual(self.post(JOBS, sleep_job(), key=other).status_code, 429)

    def test_a_scheduled_job_does_not_count_until_it_is_due(self) -> None:
        for _ in range(3):
            self.submit()
        later = self.post(JOBS, sleep_job(delay_seconds=3600))
        self.assertEqual(later.status_code, 202, later.content)

    def test_a_repeated_idempotency_key_is_answered_not_refused(self) -> None:
        first = self.submit(sleep_job(idempotency_key="k"))
        self.submit()
        self.submit()
        again = self.post(JOBS, sleep_job(idempotency_key="k"))
        self.assertEqual(again.status_code, 200, again.content)
        self.assertEqual(again.json()["id"], first["id"])


class SubmitRateTests(QuotaTestCase):
    def test_a_submit_past_the_bucket_is_refused_with_when_it_refills(self) -> None:
        # One job per 100 s, a bucket of 3: three go at once, the fourth waits ~100 s.
        self.pool(submit_burst=3)
        _, key = self.tenant_with("rate-t", submit_rate=0.01)
        for _ in range(3):
            self.submit(key=key)
        retry_after = self.assert_refused(self.post(JOBS, sleep_job(), key=key), "submit_rate_exceeded", "submit_rate")
        self.assertGreater(retry_after, 50)
        self.assertLessEqual(retry_after, 101)
        self.assertEqual(Job.objects.filter(tenant__slug="rate-t").count(), 3)
        self.assertEqual(self.waiting("rate-t"), 3)
        # Another tenant, with no rate of its own and none in the pool, is not limited.
        _, free = self.tenant_with("free-t")
        for _ in range(5):
            self.submit(key=free)

    def test_a_bulk_larger_than_the_bucket_goes_when_the_bucket_is_full(self) -> None:
        self.pool(submit_burst=3)
        _, key = self.tenant_with("rate-b", submit_rate=0.01)
        response = self.post(BULK, {"jobs": [sleep_job() for _ in range(5)]}, key=key)
        self.assertEqual(response.status_code, 202, response.content)
        # It left the bucket in debt: the next job waits for the debt and its own token.
        retry_after = self.assert_refused(self.post(JOBS, sleep_job(), key=key), "submit_rate_exceeded", "submit_rate")
        self.assertGreater(retry_after, 250)


class GuardCapTests(QuotaTestCase):
    def test_the_cap_falls_from_the_largest_backlog_to_zero(self) -> None:
        common = {"maxmemory": 1000, "threshold_pct": 80.0, "largest": 100}
        self.assertIsNone(guard_cap(used=799, **common))
        self.assertEqual(guard_cap(used=800, **common), 100)
        self.assertEqual(guard_cap(used=810, **common), 95)
        self.assertEqual(guard_cap(used=900, **common), 50)
        self.assertEqual(guard_cap(used=1000, **common), 0)
        self.assertIsNone(guard_cap(used=999, maxmemory=0, threshold_pct=80.0, largest=100))
        self.assertIsNone(guard_cap(used=999, maxmemory=1000, threshold_pct=100.0, largest=100))


class MemoryGuardTests(QuotaTestCase):
    """Against a private redis-server whose maxmemory the test sets (never the shared one)."""

    def setUp(self) -> None:
        self.server = RedisServer().start()
        self.addCleanup(self.server.stop)
        urls = override_settings(REDIS_URL=self.server.url, FAIRQUEUE_ENGINE_URL=self.server.url)
        urls.enable()
        self.addCleanup(urls.disable)
        self.addCleanup(policy_invalidate)
        super().setUp()

    def set_usage(self, ratio: float) -> None:
        """maxmemory such that the server's memory in use is `ratio` of it, and the duty's cap."""
        client = self.server.client()
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", int(used / ratio))
        memory_guard_forget()
        self.addCleanup(memory_guard_forget)
        state = memory_guard_step()
        assert state is not None
        self.assertEqual(state.max_bytes, int(used / ratio))

    def test_the_largest_backlogs_are_refused_first_and_floors_are_kept(self) -> None:
        _, big = self.tenant_with("big", max_concurrency=1, floor=1)
        _, small = self.tenant_with("small", max_concurrency=1, floor=1)
        _, steady = self.tenant_with("steady", floor=4)
        self.assertEqual(self.post(BULK, {"jobs": [sleep_job() for _ in range(20)]}, key=big).status_code, 202)
        self.assertEqual(self.post(BULK, {"jobs": [sleep_job() for _ in range(3)]}, key=small).status_code, 202)
        self.assertFalse(guard_state().active)

        # Just past the threshold (80%): only the largest backlog is held where it is.
        self.set_usage(0.81)
        state = guard_state()
        self.assertTrue(state.active)
        # The largest backlog (20) scaled by how far past the threshold the memory is (the
        # server's own use moves a little between two reads): above every other backlog.
        assert state.cap is not None
        self.assertTrue(3 < state.cap < 20, state.cap)
        self.assertEqual(state.headroom_bytes, 0)
        self.assert_refused(self.post(JOBS, sleep_job(), key=big), "memory_guard", "memory_guard")
        self.assertEqual(Job.objects.filter(tenant__slug="big").count(), 20, "a refused submit wrote a row")
        self.submit(key=small)
        self.submit(key=steady)

        # Nearer maxmemory the cap falls below the smaller backlogs too; a tenant below its
        # floor is still admitted (its in-flight jobs are fewer than its floor).
        self.set_usage(0.97)
        cap = guard_state().cap
        assert cap is not None
        self.assertLessEqual(cap, 3)
        self.assert_refused(self.post(JOBS, sleep_job(), key=small), "memory_guard", "memory_guard")
        self.assertEqual(Job.objects.filter(tenant__slug="small").count(), 4)
        for _ in range(3):
            self.submit(key=steady)
        self.assertEqual(Job.objects.filter(tenant__slug="steady").count(), 4)

        # The guard lifts when the memory is back under the threshold.
        self.set_usage(0.5)
        self.assertIsNone(self.server.client().get(GUARD_KEY))
        self.submit(key=big)

    def test_the_snapshot_and_metrics_show_the_memory_and_the_guard(self) -> None:
        self.set_usage(0.5)
        memory = guard_state().as_dict()
        self.assertFalse(memory["guard_active"])
        self.assertGreater(memory["headroom_bytes"], 0)
        self.assertAlmostEqual(memory["used_ratio"], 0.5, delta=0.05)


class ConcurrentBulkTests(RedisTransactionTestCase):
    """Two bulks at once against a quota with room for one: the count and the entry are one
    atomic step, so exactly one is taken, whole, whatever the interleaving."""

    # Without it, a test with a serialized rollback that runs next fails to restore the
    # content types (after this test's threads wrote through connections of their own).
    serialized_rollback = True

    def test_two_bulks_at_once_cannot_both_pass_a_quota_with_room_for_one(self) -> None:
        policy_invalidate()
        tenant, _ = make_tenant("race-t", backlog_quota=10)
        policy_invalidate()
        outcomes: list[str] = []
        start = threading.Barrier(2)

        def submit() -> None:
            try:
                start.wait(timeout=30)
                job_submit_bulk(tenant=tenant, reqs=[JobRequest(task="demo.sleep", args={"seconds": 0.1})] * 6)
                outcomes.append("taken")
            except JobError as exc:
                outcomes.append(f"{exc.status} {exc.code}")
            finally:
                connection.close()

        threads = [threading.Thread(target=submit) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        self.assertEqual(sorted(outcomes), ["429 backlog_quota_exceeded", "taken"])
        self.assertEqual(Job.objects.filter(tenant=tenant).count(), 6)
        self.assertEqual(
            cells.cells_count([cells.tenant_cell("race-t", "default")])[cells.tenant_cell("race-t", "default")], 6
        )
