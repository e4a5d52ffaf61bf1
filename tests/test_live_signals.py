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

    def test_a_tenants_durations_in_one_call_give_the_mean_one_call_each_gives(self) -> None:
        seconds = [3.25, 0.0001234, 17.5, 2.0, 0.3333333]
        for s in seconds:  # one script call each, as before a tenant's durations shared one
            pipe = self.redis.pipeline(transaction=False)
            live._queue_means(pipe, [("each", s)])
            live._execute(pipe, [("each", s)])
        pipe = self.redis.pipeline(transaction=False)
        durations = [("one", s) for s in seconds] + [("other", 5.0)]
        self.assertEqual(live._queue_means(pipe, durations), 2)  # one call per tenant
        live._execute(pipe, durations)
        self.assertEqual(self.redis.get(live.mean_key("one")), self.redis.get(live.mean_key("each")))
        self.assertEqual(float(self.redis.get(live.mean_key("other"))), 5.0)


class IncrementalReadTests(RedisTestCase):
    """The tick's read of every tenant's signals (live.SignalsView) reads again only what
    may have moved: the rings written in the bucket that just completed (its touched set),
    the rings that hold counts, an audit slice, and the mean of tenants with a rate."""

    def setUp(self) -> None:
        super().setUp()
        live.live_invalidate()

    def ring_reads(self) -> int:
        return int(self.redis.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0))

    def test_a_tenant_that_starts_submitting_is_read_again_and_no_idle_one_is(self) -> None:
        t0 = 3_000_000 * 30.0  # a bucket boundary
        slugs = [f"idle{i}" for i in range(3000)] + ["busy"]
        view = live.SignalsView()
        signals, changed = view.read(slugs, now=t0 + 1)
        self.assertIsNone(changed)  # the first read: everything
        self.assertEqual(signals["busy"].rate_per_min, 0.0)
        slice_size = -(-len(slugs) // live.RING_AUDIT_CALLS)
        for bucket in range(5):
            live._ring_add("busy", 6, t0 + bucket * 30 + 1)  # as a submit writes: in its time's bucket
            self.redis.config_resetstat()
            signals, changed = view.read(slugs, now=t0 + (bucket + 1) * 30 + 1)
            # Its ring and an audit slice, not three thousand rings.
            self.assertLessEqual(self.ring_reads(), 1 + slice_size)
        self.assertEqual(signals["busy"].rate_per_min, 6.0)  # the median of 5 x 6 and 5 x 0 jobs per 30 s
        self.assertEqual(changed, {"busy"})
        # Nothing written since: a read in the same bucket changes nothing.
        self.assertEqual(view.read(slugs, now=t0 + 5 * 30 + 2)[1], set())

    def test_a_ring_whose_touched_set_was_lost_is_read_again_by_the_audit(self) -> None:
        t0 = 4_000_000 * 30.0
        slugs = [f"idle{i}" for i in range(9)] + ["busy"]
        view = live.SignalsView()
        view.read(slugs, now=t0 + 1)
        for bucket in range(5):
            live._ring_add("busy", 6, t0 + bucket * 30 + 1)
            # Its touched set lost (evicted, or the write's SADD failed).
            self.redis.delete(live.ring_touched_key(int((t0 + bucket * 30 + 1) // 30)))
            view.read(slugs, now=t0 + (bucket + 1) * 30 + 1)
        rates = []
        for _ in range(len(slugs)):  # a whole audit pass over these tenants
            rates.append(view.read(slugs, now=t0 + 5 * 30 + 2)[0]["busy"].rate_per_min)
        self.assertEqual(rates[-1], 6.0)

    def test_after_a_flush_the_rates_are_those_of_the_empty_rings(self) -> None:
        t0 = 5_000_000 * 30.0
        for bucket in range(10):
            live._ring_add("busy", 6, t0 + bucket * 30 + 1)  # as submits write (no epoch)
        view = live.SignalsView()
        self.assertEqual(view.read(["busy", "idle"], now=t0 + 10 * 30 + 1)[0]["busy"].rate_per_min, 12.0)
        self.redis.flushdb()  # the rings and the touched sets with them
        # A ring with counts is read again when the next bucket completes: empty now.
        signals, changed = view.read(["busy", "idle"], now=t0 + 11 * 30 + 1)
        self.assertEqual(signals["busy"].rate_per_min, 0.0)
        self.assertEqual(changed, {"busy"})

    def test_a_view_reports_what_changed_since_its_own_last_read(self) -> None:
        t0 = 6_000_000 * 30.0
        for bucket in range(10):
            live.record_submissions(tenant_slug="busy", count=6, now=t0 + bucket * 30 + 1)
        tick, dashboard = live.SignalsView(), live.SignalsView()
        tick.read(["busy", "idle"], now=t0 + 10 * 30 + 1)
        dashboard.read(["busy", "idle"], now=t0 + 10 * 30 + 1)
        live.record_finish(tenant_slug="busy", seconds=4.0, batch=False)  # its mean moves
        self.assertEqual(dashboard.read(["busy", "idle"], now=t0 + 10 * 30 + 2)[1], {"busy"})
        # The other view read since, and saw it: this one still learns of it.
        signals, changed = tick.read(["busy", "idle"], now=t0 + 10 * 30 + 3)
        self.assertEqual(changed, {"busy"})
        self.assertEqual(signals["busy"].mean_seconds, 4.0)
