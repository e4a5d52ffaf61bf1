"""The limit formula, term by term, at its edges (pure function: no Redis needed)."""

from __future__ import annotations

import math

from django.test import SimpleTestCase

from tenants.limits import fair_shares, idle_shares, shard_caps, tenant_limit

DEFAULTS = dict(
    floor=2,
    burst_floor=2,
    burst_pct=0.5,
    max_concurrency=None,
    dedicated=0,
    rate_per_min=0.0,
    mean_seconds=1.0,
    pool_slots=100,
    target_utilisation=0.8,
    in_flight=80,
    f_min=0.25,
    f_max=4.0,
)


def limit(**overrides: object):  # type: ignore[no-untyped-def]
    return tenant_limit(**{**DEFAULTS, **overrides})  # type: ignore[arg-type]


class FormulaTests(SimpleTestCase):
    def test_no_traffic_runs_at_the_floor_based_ceiling(self) -> None:
        b = limit()
        self.assertEqual(b.base, 2)
        self.assertEqual(b.ceiling, 4)  # 2 + max(2, 2 * 0.5)
        self.assertEqual(b.pressure, 1.0)  # 80 in flight at a target of 80
        self.assertEqual(b.limit, 4)

    def test_rate_times_duration_below_the_floor_keeps_the_floor(self) -> None:
        self.assertEqual(limit(rate_per_min=60, mean_seconds=1.0).base, 2)  # R*D/60 = 1

    def test_rate_times_duration_above_the_floor_raises_base_rounding_up(self) -> None:
        b = limit(rate_per_min=601, mean_seconds=1.0)  # 10.016 -> 11
        self.assertEqual(b.base, 11)
        self.assertEqual(b.ceiling, 11 + 5.5)
        self.assertEqual(b.limit, 16)  # floor(16.5 * 1.0)

    def test_exact_multiple_is_not_rounded_up(self) -> None:
        self.assertEqual(limit(rate_per_min=600, mean_seconds=1.0).base, 10)

    def test_burst_pct_wins_over_burst_floor_when_larger(self) -> None:
        self.assertEqual(limit(floor=10, burst_pct=1.0).ceiling, 20)

    def test_saturated_pool_shrinks_by_the_factor_but_never_below_floor(self) -> None:
        b = limit(floor=2, burst_floor=6, in_flight=160)  # factor 0.5: 8 * 0.5 = 4
        self.assertEqual(b.pressure, 0.5)
        self.assertEqual(b.limit, 4)
        squeezed = limit(floor=2, in_flight=10_000)  # factor clamps at f_min: 4 * 0.25 = 1 -> floor 2
        self.assertEqual(squeezed.pressure, 0.25)
        self.assertEqual(squeezed.limit, 2)

    def test_idle_pool_expands_to_f_max(self) -> None:
        self.assertEqual(limit(in_flight=0).pressure, 4.0)
        self.assertEqual(limit(in_flight=0).limit, 16)
        self.assertEqual(limit(in_flight=10).pressure, 4.0)  # 80/10 = 8 clamps to 4

    def test_f_min_bounds_pressure(self) -> None:
        self.assertEqual(limit(in_flight=1000, f_min=0.1).pressure, 0.1)

    def test_hard_max_is_never_exceeded(self) -> None:
        self.assertEqual(limit(in_flight=0, max_concurrency=5).limit, 5)

    def test_dedicated_capacity_comes_on_top_of_the_hard_max(self) -> None:
        b = limit(in_flight=0, max_concurrency=5, dedicated=3)
        self.assertEqual(b.limit, 8)
        self.assertEqual(limit(dedicated=3).limit, 7)

    def test_no_registered_workers_means_neutral_pressure(self) -> None:
        self.assertEqual(limit(pool_slots=0, in_flight=0).pressure, 1.0)

    def test_every_tenant_shrinks_by_the_same_factor(self) -> None:
        tenants = [dict(floor=1, burst_floor=3), dict(floor=5, burst_pct=1.0), dict(floor=10, burst_floor=10)]
        relaxed = [limit(in_flight=80, **t) for t in tenants]
        squeezed = [limit(in_flight=160, **t) for t in tenants]
        for r, s in zip(relaxed, squeezed, strict=True):
            self.assertEqual(s.pressure, 0.5)
            self.assertEqual(s.limit, max(int(r.ceiling * 0.5), r.floor))
            self.assertGreaterEqual(s.limit, s.floor)


class IdleShareTests(SimpleTestCase):
    def test_unheld_slots_are_shared_equally_among_tenants_at_their_limit(self) -> None:
        shares = idle_shares(slots=16, in_flight=8, overcommit=0.0, demand={"a": (6, 6), "b": (2, 2)})
        self.assertEqual(shares, {"a": 4, "b": 4})  # 8 unheld slots, 4 each on top of what they hold

    def test_overcommit_covers_jobs_in_transit(self) -> None:
        self.assertEqual(idle_shares(slots=16, in_flight=16, overcommit=0.125, demand={"a": (16, 4)}), {"a": 14})

    def test_an_over_held_pool_gives_slots_back_but_never_below_the_formula(self) -> None:
        shares = idle_shares(slots=16, in_flight=20, overcommit=0.0, demand={"a": (14, 4), "b": (4, 4)})
        self.assertEqual(shares, {"a": 8, "b": 0})  # 4 too many: each gives back 2, b keeps its formula

    def test_no_demand_or_no_fleet_means_no_share(self) -> None:
        self.assertEqual(idle_shares(slots=16, in_flight=0, overcommit=0.1, demand={}), {})
        self.assertEqual(idle_shares(slots=0, in_flight=0, overcommit=0.1, demand={"a": (1, 1)}), {})

    def test_the_share_adds_to_the_limit_but_the_hard_max_still_holds(self) -> None:
        self.assertEqual(limit(idle_share=5).limit, 9)
        self.assertEqual(limit(idle_share=5).idle_share, 5)
        self.assertEqual(limit(idle_share=50, max_concurrency=10).limit, 10)
        self.assertEqual(limit(idle_share=50, max_concurrency=10, dedicated=2).limit, 12)


class FairShareTests(SimpleTestCase):
    """Water-filling: pressure lands on the tenants above their max-min fair share."""

    def test_tenants_below_an_equal_share_get_their_demand_and_the_rest_split_what_is_left(self) -> None:
        shares = fair_shares(pool_target=20, demand={"a": 2, "b": 4, "noisy": 100}, weight={"a": 1, "b": 1, "noisy": 1})
        self.assertEqual(shares, {"a": 2, "b": 4, "noisy": 14})

    def test_weights_split_the_contended_part(self) -> None:
        shares = fair_shares(pool_target=30, demand={"x": 100, "y": 100}, weight={"x": 2, "y": 1})
        self.assertAlmostEqual(shares["x"], 20)
        self.assertAlmostEqual(shares["y"], 10)

    def test_shares_never_exceed_the_target_or_the_demand(self) -> None:
        demand = {f"t{i}": float(i) for i in range(1, 30)}
        shares = fair_shares(pool_target=100, demand=demand, weight=dict.fromkeys(demand, 1.0))
        self.assertLessEqual(sum(shares.values()), 100 + 1e-9)
        self.assertTrue(all(shares[s] <= demand[s] for s in demand))

    def test_a_steady_tenant_below_its_share_is_not_squeezed_by_pressure(self) -> None:
        steady = limit(floor=1, burst_floor=3, in_flight=160)  # pressure 0.5: ceiling 4 -> 2
        self.assertEqual(steady.limit, 2)
        protected = limit(floor=1, burst_floor=3, in_flight=160, fair_share=10)
        self.assertEqual((protected.limit, protected.fair_share), (4, 10), "min(ceiling, share) is kept")

    def test_a_tenant_above_its_share_is_squeezed_by_the_factor_but_never_below_its_share(self) -> None:
        # base 100, ceiling 150; in flight 400 of a target of 80: pressure at f_min 0.25
        noisy = dict(floor=1, burst_floor=3, rate_per_min=6000, mean_seconds=1.0, in_flight=400)
        self.assertEqual(limit(**noisy, fair_share=12).limit, 37)  # the factor: floor(150 * 0.25)
        self.assertEqual(limit(**noisy, fair_share=60).limit, 60)  # its share, not the factor

    def test_no_protection_while_the_pool_has_room(self) -> None:
        relaxed = limit(floor=1, burst_floor=3, in_flight=10, fair_share=1)
        self.assertEqual(relaxed.limit, math.floor(relaxed.ceiling * relaxed.pressure))


class ShardCapTests(SimpleTestCase):
    """Where a shard's capacity binds: its fair share, work-conserving through its free room."""

    def caps(self, **overrides: object) -> dict[str, int]:
        held = overrides.pop("held", {"flood": 8, "mate": 2})
        args = dict(
            capacity=8,
            holders=8,
            waiting=2,
            held=held,
            wanting={"flood"},
            weight=dict.fromkeys(held, 2.0),  # type: ignore[arg-type]
            floor=dict.fromkeys(held, 2),  # type: ignore[arg-type]
        )
        return shard_caps(**{**args, **overrides})  # type: ignore[arg-type]

    def test_a_tenant_wanting_more_gives_back_the_slots_a_shard_mate_waits_for(self) -> None:
        # flood holds 8 tenant slots (6 running, 2 queued at the shard) and wants more; mate
        # runs none and waits at the shard with 2: flood's fair share is 6, and it gives 2 back.
        self.assertEqual(self.caps(), {"flood": 6})

    def test_never_below_its_fair_share_or_its_floor(self) -> None:
        self.assertEqual(self.caps(waiting=7, held={"flood": 8, "mate": 1}), {"flood": 7})  # its share
        held = {"flood": 3, "a": 2, "b": 2, "c": 2}
        self.assertEqual(self.caps(capacity=4, holders=4, waiting=5, held=held), {"flood": 2})  # its floor

    def test_free_room_goes_to_the_tenants_that_want_it(self) -> None:
        # The shard has 3 free slots and nobody waits: flood may take them all (work-conserving).
        self.assertEqual(self.caps(holders=5, waiting=0, held={"flood": 4, "mate": 1}), {"flood": 7})
        both = self.caps(holders=4, waiting=0, held={"flood": 2, "mate": 2}, wanting={"flood", "mate"})
        self.assertEqual(both, {"flood": 4, "mate": 4}, "split equally, rounded up")

    def test_nobody_is_capped_who_wants_no_more_and_a_roomy_shard_caps_at_its_room(self) -> None:
        self.assertEqual(self.caps(wanting=set()), {})
        roomy = self.caps(capacity=20, holders=10, waiting=0, held={"flood": 8, "mate": 2})
        self.assertEqual(roomy, {"flood": 18}, "every free slot, but no more jobs queued at the shard")

    def test_room_is_kept_for_what_a_steady_shard_mate_recently_used(self) -> None:
        # mate runs 1 job now but has held 2.5 slots on average of late: flood,
        # holding 7 of the full shard, is capped at 5 so that 2 slots stay free for mate's
        # next jobs instead of mate waiting behind flood's for a release.
        steady = self.caps(holders=8, waiting=0, held={"flood": 7, "mate": 1}, recent={"mate": 2.5})
        self.assertEqual(steady, {"flood": 5})
        self.assertEqual(self.caps(holders=8, waiting=0, held={"flood": 7, "mate": 1}), {"flood": 7}, "no demand kept")
        # What is kept never exceeds the mate's fair share of the shard: three mates that
        # each used 4 slots keep 2 each (8 / 4 tenants), flood keeps its share of 2.
        held = {"flood": 5, "a": 1, "b": 1, "c": 1}
        greedy = self.caps(holders=8, waiting=0, held=held, recent=dict.fromkeys(("a", "b", "c"), 4.0))
        self.assertEqual(greedy, {"flood": 2})
        # A mate holding more than it recently used keeps nothing beyond what it holds.
        self.assertEqual(
            self.caps(holders=8, waiting=0, held={"flood": 6, "mate": 2}, recent={"mate": 1.0}), {"flood": 6}
        )

    def test_an_idle_tenant_bursts_into_the_free_room_not_the_room_kept(self) -> None:
        # Two mates run 2 jobs and held 3.5 of late between them; flood holds nothing and
        # has not run lately: its first burst may take 8 - 2 - round(1.5) = 4 slots at once,
        # not the whole shard, leaving the mates' usual room free.
        held = {"flood": 0, "a": 1, "b": 1}
        caps = self.caps(holders=2, waiting=0, held=held, wanting=set(), idle={"flood"}, recent={"a": 2.0, "b": 1.5})
        self.assertEqual(caps, {"flood": 4})
        # Never below its floor, whatever the shard holds.
        full = self.caps(holders=8, waiting=3, held={"flood": 0, "a": 8}, wanting=set(), idle={"flood"})
        self.assertEqual(full, {"flood": 2})

    def test_wanting_tenants_shares_are_whole_slots_that_add_up(self) -> None:
        held = {"x": 4, "y": 4}
        caps = self.caps(capacity=7, holders=7, waiting=1, held=held, wanting={"x", "y"}, recent={})
        self.assertEqual(sorted(caps.values()), [3, 4], "7 slots between two equal tenants: 3 and 4, not 4 and 4")

    def test_the_cap_bounds_the_limit_but_never_below_the_floor_and_dedicated_comes_on_top(self) -> None:
        self.assertEqual(limit(in_flight=10).limit, 16)  # an idle pool: ceiling 4 x f_max
        capped = limit(in_flight=10, shard_cap=5)
        self.assertEqual((capped.limit, capped.shard_cap), (5, 5))
        self.assertEqual(limit(in_flight=10, shard_cap=1).limit, 2)
        self.assertEqual(limit(in_flight=10, shard_cap=5, dedicated=3).limit, 8)
