"""Live signals on real Redis: the rate ring, the duration mean, fleet counts."""

from __future__ import annotations

from fairqueue.jobs import live
from tests.base import RedisTestCase

WINDOW = 300  # the pool default: 10 buckets of 30 s


class RateRingTests(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        live.live_invalidate()

    def test_steady_submitter_earns_a_higher_rate_than_a_burst_of_the_same_size(self) -> None:
        t0 = 1_000_000 * 30.0  # a bucket boundary
        for bucket in range(10):  # 6 jobs in each of ten 30 s intervals
            live.record_submissions(tenant_slug="steady", count=6, now=t0 + bucket * 30 + 1)
        live.record_submissions(tenant_slug="bursty", count=60, now=t0 + 9 * 30 + 1)  # the same 60 at once
        now = t0 + 10 * 30 + 1
        steady_rate, _ = live.tenant_signals_read(tenant_slug="steady", now=now)
        bursty_rate, _ = live.tenant_signals_read(tenant_slug="bursty", now=now)
        self.assertEqual(steady_rate, 12.0)  # 6 per 30 s
        self.assertEqual(bursty_rate, 0.0)
        self.assertGreater(steady_rate, bursty_rate)

    def test_the_ring_is_fixed_size_and_forgets_old_intervals(self) -> None:
        t0 = 2_000_000 * 30.0
        for bucket in range(40):
            live.record_submissions(tenant_slug="long", count=1, now=t0 + bucket * 30 + 1)
        self.assertLessEqual(self.redis.hlen(live.rate_key("long")), 14)
        rate, _ = live.tenant_signals_read(tenant_slug="long", now=t0 + 40 * 30 + 1)
        self.assertEqual(rate, 2.0)
        rate_later, _ = live.tenant_signals_read(tenant_slug="long", now=t0 + 60 * 30 + 1)
        self.assertEqual(rate_later, 0.0)

    def test_submissions_are_counted_locally_and_reach_redis_within_a_second(self) -> None:
        def in_redis() -> int:
            return sum(int(v) for v in self.redis.hvals(live.rate_key("local")))

        live.record_submissions(tenant_slug="local", count=5)  # first of the second: written at once
        self.assertEqual(in_redis(), 5)
        live.record_submissions(tenant_slug="local", count=3)  # same second: counted locally
        self.assertEqual(in_redis(), 5)
        live.tenant_signals_read(tenant_slug="local")  # the next read carries it along
        self.assertEqual(in_redis(), 8)

    def test_mean_duration_is_an_exponentially_weighted_mean(self) -> None:
        live.record_finish(tenant_slug="m", seconds=10.0, batch=False)
        live.record_finish(tenant_slug="m", seconds=0.0, batch=False)
        _, mean = live.tenant_signals_read(tenant_slug="m")
        self.assertAlmostEqual(mean, 10.0 * (1 - live.MEAN_ALPHA), places=5)
        live.record_finish(tenant_slug="m", seconds=1000.0, batch=True)  # batch work is ignored
        _, mean_after = live.tenant_signals_read(tenant_slug="m")
        self.assertEqual(mean, mean_after)

    def test_a_finish_travels_with_the_next_signal_read_not_on_its_own(self) -> None:
        live.record_finish(tenant_slug="d", seconds=4.0, batch=False)  # first: nothing to ride on, written
        self.assertEqual(float(self.redis.get(live.mean_key("d"))), 4.0)
        live.record_finish(tenant_slug="d", seconds=9.0, batch=False)  # queued, no round trip of its own
        self.assertEqual(float(self.redis.get(live.mean_key("d"))), 4.0)
        _, mean = live.tenant_signals_read(tenant_slug="d")
        self.assertAlmostEqual(mean, 4.0 + live.MEAN_ALPHA * 5.0, places=5)

    def test_the_mean_survives_redis_forgetting_its_scripts(self) -> None:
        live.record_finish(tenant_slug="s", seconds=2.0, batch=False)
        self.redis.script_flush()  # what a Redis restart does to loaded scripts
        live.record_finish(tenant_slug="s", seconds=12.0, batch=False)
        _, mean = live.tenant_signals_read(tenant_slug="s")
        self.assertAlmostEqual(mean, 2.0 + live.MEAN_ALPHA * 10.0, places=5)
