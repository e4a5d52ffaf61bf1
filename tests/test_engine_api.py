"""Direct behaviours of the engine (issue 3 semantics, one by one), input validation,
the real-time lease path and the asyncio API."""

from __future__ import annotations

import asyncio
import io
import time
from typing import Any

import redis
import redis.asyncio
from django.conf import settings
from django.core.management import call_command

from fairqueue.engine import AdmitRequest, AsyncEngine, Engine, KeyLimit, Sweeper, Woken
from fairqueue.engine.keys import LAYOUT, tag_keys
from fairqueue.engine.ops import INLINE_RECLAIM
from fairqueue.engine.scripts import library, loaded_libraries
from tests.base import RedisTestCase

T = "s:api"


def stored_kinds(client: Any) -> set[str]:
    """Which of a tag's engine keys exist ("state", "waits", ...); a SCAN, which a cluster
    client runs on every primary (tests.test_cluster runs these tests on one)."""
    return {k.decode().rsplit(":", 1)[1] for k in client.scan_iter("*")}


class EngineBehaviour(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.e = Engine(redis.Redis.from_url(settings.REDIS_URL))

    def admit(self, job: str, keys: dict[str, int], priority: int = 0, lease: float = 60):
        return self.e.admit(tag=T, job_id=job, keys=keys, priority=priority, lease_seconds=lease, data=f"d-{job}")

    def test_key_layout_shares_one_hash_tag(self) -> None:
        keys = tag_keys("fq", "s:shard1")
        self.assertEqual(keys, tuple(f"fq:{{s:shard1}}:v{LAYOUT}:{n}" for n in ("state", "waits", "leases", "clock")))
        self.assertTrue(all("{s:shard1}" in k for k in keys))

    def test_handoff_goes_to_head_waiter_in_the_same_call(self) -> None:
        self.assertTrue(self.admit("a", {"k": 1}).admitted)
        b = self.admit("b", {"k": 1})
        self.assertEqual((b.admitted, b.parked_on, b.position), (False, "k", 1))
        self.assertEqual(self.admit("c", {"k": 1}).position, 2)
        res = self.e.release(tag=T, job_id="a")
        self.assertTrue(res.found)
        self.assertEqual(res.woken, [Woken("b", "d-b")])
        self.assertEqual(self.e.inspect_key(tag=T, key="k").holders, ["b"])
        lean = self.e.inspect_key(tag=T, key="k", holders=False)
        self.assertEqual((lean.holders, lean.held, lean.waiting, lean.limit), ([], 1, 1, 1))
        self.assertEqual(self.e.inspect_job(tag=T, job_id="c").position, 1)

    def test_priority_then_fifo(self) -> None:
        self.admit("h", {"k": 1})
        for job, prio in [("l1", 0), ("m1", 5), ("l2", 0), ("m2", 5), ("top", 250)]:
            self.admit(job, {"k": 1}, prio)
        state = self.e.inspect_key(tag=T, key="k")
        self.assertEqual(state.waiters_by_priority, {250: 1, 5: 2, 0: 2})
        self.assertEqual(state.waiting, 5)
        order = []
        current = "h"
        for _ in range(5):
            woken = self.e.release(tag=T, job_id=current).woken
            current = woken[0].job_id
            order.append(current)
        self.assertEqual(order, ["top", "m1", "m2", "l1", "l2"])

    # --- fair order across flows (issue 16) ------------------------------------------
    def fadmit(self, job: str, flow: str, weight: float = 1.0, priority: int = 0, limit: int = 1, key: str = "k"):
        keys = [KeyLimit(key, limit, flow, weight)]
        return self.e.admit(tag=T, job_id=job, keys=keys, priority=priority, lease_seconds=60, data=f"d-{job}")

    def serve_all(self, first: str, keys: list[str] | None = None) -> list[str]:
        """Release the running job, then each job it wakes, until none is woken: the order."""
        order, current = [], first
        while True:
            woken = self.e.release(tag=T, job_id=current, keys=keys).woken
            if not woken:
                return order
            current = woken[0].job_id
            order.append(current)

    def flow_fields(self) -> set[bytes]:
        state = tag_keys("fq", T)[0]
        return {f for f in self.e.client.hkeys(state) if f[:1] in (b"\4", b"\5")}

    def test_a_new_flow_behind_a_flood_is_served_second(self) -> None:
        self.fadmit("h", "A")
        for i in range(100):
            self.assertEqual(self.fadmit(f"a{i:03d}", "A").position, i + 1)
        b = self.fadmit("b0", "B")
        self.assertEqual((b.parked_on, b.position), ("k", 2))  # behind the head only, not 101st
        self.assertEqual(self.e.inspect_job(tag=T, job_id="b0").position, 2)
        order = self.serve_all("h", ["k"])
        self.assertEqual(order[:3], ["a000", "b0", "a001"])
        self.assertEqual(order[3:], [f"a{i:03d}" for i in range(2, 100)])  # FIFO within A
        self.assertEqual(self.e.check_invariants(tag=T), [])
        self.assertEqual(self.flow_fields(), set())  # nobody waits: no per-flow state is left

    def test_flows_share_a_key_fairly_fifo_within_each_and_by_weight(self) -> None:
        self.fadmit("h", "")
        for i in range(6):
            self.fadmit(f"a{i}", "A")
        for i in range(6):
            self.fadmit(f"b{i}", "B")
        for i in range(6):
            self.fadmit(f"c{i}", "C", weight=2.0)  # twice the share of A or B
        order = self.serve_all("h")
        self.assertEqual(order[:8], ["a0", "b0", "c0", "c1", "a1", "b1", "c2", "c3"])
        for flow in "abc":
            mine = [j for j in order if j[0] == flow]
            self.assertEqual(mine, sorted(mine))  # FIFO within a flow
        self.assertEqual(len(order), 18)
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_priority_comes_before_fair_order(self) -> None:
        self.fadmit("h", "A")
        for i in range(5):
            self.fadmit(f"a{i}", "A")
        self.fadmit("b-low", "B")
        self.fadmit("a-high", "A", priority=5)  # A's own flow, but a higher priority
        self.fadmit("c-top", "C", priority=9)
        order = self.serve_all("h", ["k"])
        self.assertEqual(order[:4], ["c-top", "a-high", "a0", "b-low"])
        self.assertEqual(self.e.inspect_key(tag=T, key="k").waiting, 0)

    def test_keys_as_dicts_and_tuples_are_the_default_flow_in_arrival_order(self) -> None:
        self.assertTrue(self.e.admit(tag=T, job_id="h", keys=[("k", 1)], lease_seconds=60).admitted)
        for i in range(3):
            self.e.admit(tag=T, job_id=f"d{i}", keys={"k": 1}, lease_seconds=60)
            self.e.admit(tag=T, job_id=f"t{i}", keys=[("k", 1)], lease_seconds=60)
            self.e.admit(tag=T, job_id=f"l{i}", keys=[KeyLimit("k", 1)], lease_seconds=60)
        self.assertEqual(self.serve_all("h"), [f"{kind}{i}" for i in range(3) for kind in "dtl"])

    def test_multi_key_jobs_queue_fairly_on_each_key_with_their_own_flows(self) -> None:
        # Shard key "s" shared by tenants A and B; each tenant also has its own key.
        def job(name: str, tenant: str) -> None:
            keys = [KeyLimit("s", 1, tenant), KeyLimit(f"t:{tenant}", 10, "")]
            self.e.admit(tag=T, job_id=name, keys=keys, lease_seconds=60, data=name)

        job("h", "A")
        for i in range(10):
            job(f"a{i}", "A")
        job("b0", "B")
        job("b1", "B")
        self.assertEqual(self.e.inspect_job(tag=T, job_id="b0").position, 2)
        self.assertEqual(self.serve_all("h", ["s", "t:A"])[:5], ["a0", "b0", "a1", "b1", "a2"])
        self.assertEqual(self.e.check_invariants(tag=T), [])
        # A job parked on an earlier key brings its flow to the later one when woken there.
        self.e.client.flushdb()
        self.fadmit("x", "X", key="b")  # holds b
        self.fadmit("y", "Y", key="b")  # parks on b
        self.e.admit(tag=T, job_id="hold-a", keys={"a": 1}, lease_seconds=60)
        keys = [KeyLimit("a", 1, "P"), KeyLimit("b", 1, "Q", 3.0)]
        self.assertFalse(self.e.admit(tag=T, job_id="m", keys=keys, lease_seconds=60).admitted)  # parks on a
        self.assertEqual(self.e.release(tag=T, job_id="hold-a").woken, [])  # m takes a, parks on b
        state = self.e.inspect_job(tag=T, job_id="m")
        self.assertEqual((state.held_keys, state.parked_on, state.position), (["a"], "b", 2))
        self.assertIn(b"\5b\x01ffQ", self.flow_fields())  # its flow on b, from its admit
        self.assertEqual([w.job_id for w in self.e.release(tag=T, job_id="x").woken], ["y"])
        self.assertEqual([w.job_id for w in self.e.release(tag=T, job_id="y").woken], ["m"])
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_cancel_and_reclaim_keep_the_fair_order_sound(self) -> None:
        self.fadmit("h", "A")
        for i in range(4):
            self.fadmit(f"a{i}", "A")
        for i in range(3):
            self.fadmit(f"b{i}", "B")
        # Cancel A's head, a middle one of B and B's tail: the rest keep their order.
        for job in ("a0", "b1", "b2"):
            self.assertTrue(self.e.cancel(tag=T, job_id=job).cancelled)
            self.assertEqual(self.e.check_invariants(tag=T), [])
        self.fadmit("b3", "B")  # B's next job queues behind the place of its cancelled tail
        self.assertEqual(self.e.inspect_job(tag=T, job_id="b3").position, 5)
        # The holder's lease runs out: the reclaim hands its slot to the fair head, B's first
        # (virtual start 0, like A's cancelled first; A's next starts one job later).
        self.e.expire_now(tag=T, job_id="h")
        res = self.e.reclaim(tag=T)
        self.assertEqual((res.reclaimed, [w.job_id for w in res.woken]), ([Woken("h", "d-h")], ["b0"]))
        self.assertEqual(self.e.check_invariants(tag=T), [])
        self.assertEqual(self.serve_all("b0", ["k"]), ["a1", "a2", "a3", "b3"])
        # Cancelling every waiter of a flow removes its records too.
        self.fadmit("c0", "C")
        self.fadmit("c1", "C")
        self.assertEqual(len(self.flow_fields()), 2)
        self.e.cancel(tag=T, job_id="c1")
        self.e.cancel(tag=T, job_id="c0")
        self.assertEqual(self.flow_fields(), set())
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_cancel_of_a_job_parked_on_a_later_key_keeps_the_flow_records_of_the_job_woken_there(self) -> None:
        """Found by the stateful test: a cancelled job held "a" and waited on "b" alone in its
        flow; the job its slot on "a" goes to moves on to "b" in the same call, in that flow."""
        self.e.admit(tag=T, job_id="hb", keys={"b": 1}, lease_seconds=60)
        self.e.admit(tag=T, job_id="p", keys={"a": 1, "b": 1}, lease_seconds=60)  # holds a, waits on b
        self.e.admit(tag=T, job_id="q", keys={"a": 1, "b": 1}, lease_seconds=60)  # waits on a
        self.assertTrue(self.e.cancel(tag=T, job_id="p").cancelled)
        state = self.e.inspect_job(tag=T, job_id="q")
        self.assertEqual((state.held_keys, state.parked_on), (["a"], "b"))
        self.assertEqual(self.e.check_invariants(tag=T), [])
        self.assertEqual([w.job_id for w in self.e.release(tag=T, job_id="hb").woken], ["q"])
        self.assertEqual(self.flow_fields(), set())

    def test_per_flow_state_ends_with_the_flows_waiters(self) -> None:
        """1,000 flows each wait once on one key and are served: no flow record outlives
        its flow's last waiter, whether it leaves by handoff (hinted or not) or by cancel."""
        self.fadmit("h", "")
        for i in range(1000):
            self.fadmit(f"j{i:04d}", f"tenant:{i}")
        self.assertEqual(len(self.flow_fields()), 2000)
        self.assertEqual(self.e.inspect_job(tag=T, job_id="j0999").position, 1000)
        current = "h"
        for i in range(500):
            current = self.e.release(tag=T, job_id=current, keys=["k"] if i % 2 else None).woken[0].job_id
            self.assertEqual(current, f"j{i:04d}")  # one job each: the flows' arrival order
        self.assertEqual(len(self.flow_fields()), 1000)
        for i in range(500, 1000):
            self.e.cancel(tag=T, job_id=f"j{i:04d}")
        self.assertEqual(self.flow_fields(), set())
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_no_barging_newcomer_parks_behind_waiters(self) -> None:
        self.admit("a", {"k": 2})
        self.admit("b", {"k": 2})
        self.admit("w", {"k": 2}, priority=1)
        # The newcomer raises the limit: the raise wakes the parked waiter first.
        res = self.admit("new", {"k": 3}, priority=1)
        self.assertEqual(res.woken, [Woken("w", "d-w")])
        self.assertFalse(res.admitted)
        self.assertEqual(res.parked_on, "k")

    def test_lowered_limit_evicts_nobody_and_admits_nobody_until_below(self) -> None:
        for job in "abc":
            self.assertTrue(self.admit(job, {"k": 3}).admitted)
        self.assertFalse(self.admit("d", {"k": 1}).admitted)
        self.assertEqual(self.e.inspect_key(tag=T, key="k").held, 3)
        self.assertEqual(self.e.release(tag=T, job_id="a").woken, [])
        self.assertEqual(self.e.release(tag=T, job_id="b").woken, [])
        self.assertEqual(self.e.release(tag=T, job_id="c").woken, [Woken("d", "d-d")])

    def test_raised_limit_wakes_waiters_at_once(self) -> None:
        self.admit("a", {"k": 1})
        self.admit("b", {"k": 1})
        self.admit("c", {"k": 1})
        woken = self.e.set_limits(tag=T, limits={"k": 3})
        self.assertEqual([w.job_id for w in woken], ["b", "c"])
        self.assertEqual(self.e.inspect_key(tag=T, key="k").waiting, 0)

    def test_zero_limit_parks_everything(self) -> None:
        self.assertFalse(self.admit("a", {"k": 0}).admitted)
        self.assertEqual([w.job_id for w in self.e.set_limits(tag=T, limits=[KeyLimit("k", 1)])], ["a"])

    def test_idempotent_readmit(self) -> None:
        self.admit("a", {"k": 1})
        self.admit("b", {"k": 1})
        again = self.admit("a", {"k": 1})
        self.assertTrue(again.admitted and again.duplicate)
        again_b = self.admit("b", {"k": 1})
        self.assertEqual((again_b.admitted, again_b.position, again_b.duplicate), (False, 1, True))
        self.assertEqual(self.e.inspect_key(tag=T, key="k").holders, ["a"])
        self.assertEqual(self.e.inspect_key(tag=T, key="k").waiting, 1)

    def test_cancel_frees_place_and_hands_partial_holds_on(self) -> None:
        self.admit("x", {"b": 1})
        p = self.admit("p", {"a": 1, "b": 1})  # holds a, parked on b
        self.assertEqual((p.parked_on, self.e.inspect_job(tag=T, job_id="p").held_keys), ("b", ["a"]))
        self.admit("q", {"a": 1})  # parked behind p's hold on a
        self.admit("r", {"b": 1})  # parked on b behind p
        self.assertFalse(self.e.cancel(tag=T, job_id="x").cancelled)  # running: not cancellable
        res = self.e.cancel(tag=T, job_id="p")
        self.assertTrue(res.cancelled)
        self.assertEqual(res.woken, [Woken("q", "d-q")])
        self.assertEqual(self.e.inspect_job(tag=T, job_id="r").position, 1)
        self.assertEqual(self.e.inspect_job(tag=T, job_id="p").status, "unknown")

    def test_multi_key_keeps_held_keys_while_parked(self) -> None:
        self.admit("hb", {"b": 1})
        self.admit("j", {"c": 1, "a": 1, "b": 1})
        state = self.e.inspect_job(tag=T, job_id="j")
        self.assertEqual((state.status, state.held_keys, state.parked_on), ("parked", ["a"], "b"))
        self.assertIsNone(state.lease_expires_ms)  # parked jobs have no lease and never expire
        self.assertFalse(self.admit("other", {"a": 1}).admitted)
        self.assertEqual(self.e.release(tag=T, job_id="hb").woken, [Woken("j", "d-j")])
        self.assertEqual(self.e.inspect_job(tag=T, job_id="j").held_keys, ["a", "b", "c"])

    def test_hinted_release_at_a_full_key_takes_every_branch_like_the_general_path(self) -> None:
        """A finishing job names its keys; at a key at its limit release_job.lua takes a
        written-out path. Each of its exits must leave what the general path leaves."""
        # Full, nobody waits: one holder fewer, the next newcomer gets in.
        self.admit("a1", {"k": 2})
        self.admit("a2", {"k": 2})
        res = self.e.release(tag=T, job_id="a1", keys=["k"])
        self.assertEqual((res.found, res.woken), (True, []))
        self.assertEqual(self.e.counts(tag=T, keys=["k"]), {"k": 1})
        self.assertTrue(self.admit("a3", {"k": 2}).admitted)
        # Full with a one-key head: handed on, with its data byte for byte and a lease.
        data = "payload \x01 with odd bytes \u00e9"
        self.e.admit(tag=T, job_id="w1", keys={"k": 2}, priority=0, lease_seconds=60, data=data)
        self.assertEqual(self.e.release(tag=T, job_id="a2", keys=["k"]).woken, [Woken("w1", data)])
        self.assertEqual(self.e.inspect_job(tag=T, job_id="w1").status, "admitted")
        self.assertIsNotNone(self.e.inspect_job(tag=T, job_id="w1").lease_expires_ms)
        self.assertEqual(self.e.counts(tag=T, keys=["k"]), {"k": 2})
        # Full with a multi-key head that then parks on its later, full key.
        self.admit("zh", {"z": 1})
        self.admit("m", {"k": 2, "z": 1})
        self.assertEqual(self.e.release(tag=T, job_id="a3", keys=["k"]).woken, [])
        state = self.e.inspect_job(tag=T, job_id="m")
        self.assertEqual((state.held_keys, state.parked_on), (["k"], "z"))
        # A parked one-key job released with its hint: only its wait entry goes.
        self.admit("p", {"k": 2})
        self.assertTrue(self.e.release(tag=T, job_id="p", keys=["k"]).found)
        self.assertEqual(self.e.inspect_key(tag=T, key="k", holders=False).waiting, 0)
        self.assertEqual(self.e.counts(tag=T, keys=["k"]), {"k": 2})
        # A wrong hint at a full key is ignored: the job's own keys are freed.
        self.admit("q", {"k": 2})
        self.assertEqual(self.e.release(tag=T, job_id="zh", keys=["k"]).woken, [Woken("m", "d-m")])
        self.assertEqual(self.e.inspect_key(tag=T, key="k", holders=False).waiting, 1)
        # A lease that ran out is reclaimed by the hinted release too.
        self.assertTrue(self.e.expire_now(tag=T, job_id="w1"))
        res = self.e.release(tag=T, job_id="m", keys=["k", "z"])
        self.assertEqual([r.job_id for r in res.reclaimed], ["w1"])
        self.assertEqual(self.e.counts(tag=T, keys=["k", "z"]), {"k": 1, "z": 0})
        self.assertEqual(self.e.inspect_job(tag=T, job_id="q").status, "admitted")
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_no_deadlock_with_opposite_order_key_sets(self) -> None:
        self.assertTrue(self.admit("ab", {"a": 1, "b": 1}).admitted)
        self.assertFalse(self.admit("ba", {"b": 1, "a": 1}).admitted)  # canonical order: parks on a
        self.assertEqual(self.e.inspect_job(tag=T, job_id="ba").held_keys, [])
        self.assertEqual(self.e.release(tag=T, job_id="ab").woken, [Woken("ba", "d-ba")])

    def test_renew_of_reclaimed_job_returns_false(self) -> None:
        self.admit("a", {"k": 1})
        self.admit("b", {"k": 1})
        self.assertTrue(self.e.renew(tag=T, job_id="a", lease_seconds=30))
        self.assertFalse(self.e.renew(tag=T, job_id="b", lease_seconds=30))  # parked
        self.assertTrue(self.e.expire_now(tag=T, job_id="a"))
        self.assertFalse(self.e.renew(tag=T, job_id="a", lease_seconds=30))  # expired: not revived
        res = self.e.reclaim(tag=T)
        self.assertEqual((res.reclaimed, res.woken), ([Woken("a", "d-a")], [Woken("b", "d-b")]))
        self.assertFalse(self.e.renew(tag=T, job_id="a", lease_seconds=30))

    def test_expired_lease_is_reclaimed_by_the_next_call(self) -> None:
        self.admit("a", {"k": 1})
        self.admit("b", {"k": 1})
        self.e.expire_now(tag=T, job_id="a")
        res = self.admit("c", {"k": 1})
        self.assertEqual(res.reclaimed, [Woken("a", "d-a")])
        self.assertEqual(res.woken, [Woken("b", "d-b")])
        self.assertEqual(res.position, 1)

    def test_an_operation_reclaims_at_most_the_inline_batch_earliest_first(self) -> None:
        """Lua's RECLAIM_BATCH is what ops.INLINE_RECLAIM (and the model) say it is."""
        jobs = [f"e{i:02d}" for i in range(INLINE_RECLAIM + 2)]
        for job in jobs:
            self.admit(job, {f"x:{job}": 1})
        for job in jobs:
            self.e.expire_now(tag=T, job_id=job)  # all at 0: earliest first is job id order
        res = self.admit("c", {"k": 1})
        self.assertEqual([r.job_id for r in res.reclaimed], jobs[:INLINE_RECLAIM])
        self.assertEqual([r.job_id for r in self.e.release(tag=T, job_id="c").reclaimed], jobs[INLINE_RECLAIM:])
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_real_short_lease_runs_out(self) -> None:
        self.admit("a", {"k": 1}, lease=0.2)
        self.admit("b", {"k": 1})
        self.assertEqual(self.e.reclaim(tag=T).reclaimed, [])
        time.sleep(0.3)
        res = self.e.release(tag=T, job_id="nobody")
        self.assertFalse(res.found)
        self.assertEqual((res.reclaimed, res.woken), ([Woken("a", "d-a")], [Woken("b", "d-b")]))
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_clock_key_reads_server_time_and_survives_loss_and_tampering(self) -> None:
        clock = tag_keys("fq", T)[3]
        client = self.e.client

        def server_ms() -> int:
            seconds, micros = client.time()
            return seconds * 1000 + micros // 1000

        def lease_ends_at(job: str) -> int:
            ends = self.e.inspect_job(tag=T, job_id=job).lease_expires_ms
            assert ends is not None
            return ends

        before = server_ms()
        self.admit("a", {"k": 5}, lease=60)  # a fresh tag: no clock key yet, TIME, then set
        self.assertEqual(client.pexpiretime(clock), 10**15)
        self.admit("b", {"k": 5}, lease=60)  # read from the clock key
        after = server_ms()
        for job in ("a", "b"):
            self.assertTrue(before + 60_000 <= lease_ends_at(job) <= after + 60_000, job)
        # Lost (or evicted), then set by someone else to expire soon: a clock read from it
        # would be centuries ahead and reclaim every lease. Both fall back to TIME and reset.
        for damage in (lambda: client.delete(clock), lambda: client.set(clock, "", px=100_000)):
            damage()
            before = server_ms()
            res = self.admit(f"c{before}", {"k": 5}, lease=60)
            self.assertTrue(res.admitted)
            self.assertEqual(res.reclaimed, [])
            self.assertTrue(before + 60_000 <= lease_ends_at(f"c{before}") <= server_ms() + 60_000)
            self.assertEqual(client.pexpiretime(clock), 10**15)
        self.assertEqual(self.e.release(tag=T, job_id="a").reclaimed, [])

    def test_renew_extends_a_real_lease(self) -> None:
        self.admit("a", {"k": 1}, lease=0.3)
        for _ in range(3):
            time.sleep(0.15)
            self.assertTrue(self.e.renew(tag=T, job_id="a", lease_seconds=0.3))
        self.assertEqual(self.e.reclaim(tag=T).reclaimed, [])

    def test_sweep_and_sweeper(self) -> None:
        self.e.admit(tag="t1", job_id="a", keys={"k": 1}, lease_seconds=60)
        self.e.admit(tag="t2", job_id="b", keys={"k": 1}, lease_seconds=60)
        self.e.expire_now(tag="t1", job_id="a")
        result = self.e.sweep(["t1", "t2"])
        self.assertEqual([w.job_id for w in result["t1"].reclaimed], ["a"])
        self.assertEqual(result["t2"].reclaimed, [])
        self.e.expire_now(tag="t2", job_id="b")
        seen: list[str] = []
        sweeper = Sweeper(self.e, lambda: ["t1", "t2"], lambda tag, r: seen.append(tag), interval=0.05, jitter=0.5)
        sweeper.start()
        try:
            deadline = time.monotonic() + 5
            while not seen and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            sweeper.stop()
        self.assertEqual(seen, ["t2"])

    def test_admit_many_is_one_pipeline(self) -> None:
        items = [AdmitRequest(tag=T, job_id=f"j{i}", keys={"k": 2}, lease_seconds=60, data=str(i)) for i in range(4)]
        res = self.e.admit_many(items)
        self.assertEqual([r.admitted for r in res], [True, True, False, False])
        self.assertEqual([r.position for r in res], [None, None, 1, 2])
        self.assertEqual(self.e.admit_many([]), [])

    def test_admit_many_after_sends_the_callers_commands_first_in_the_same_round_trip(self) -> None:
        self.admit("a", {"k": 1})
        # The caller's commands are opaque to the engine; an error is a reply, and the
        # admissions after it stand.
        before = [["RPUSH", "caller:log", "first"], ["INCR", "caller:log"], ["LLEN", "caller:log"]]
        replies, res = self.e.admit_many_after(before, [AdmitRequest(T, "b", {"k": 1}, 60)])
        self.assertEqual(replies[0], 1)
        self.assertIsInstance(replies[1], redis.ResponseError)  # INCR on a list
        self.assertEqual(replies[2], 1)
        self.assertEqual((res[0].admitted, res[0].parked_on), (False, "k"))
        # Sent once even when the library has to be loaded and the admissions sent again.
        self.e.client.function_flush()
        replies, res = self.e.admit_many_after([["RPUSH", "caller:log", "again"]], [AdmitRequest(T, "c", {"k": 1}, 60)])
        self.assertEqual((replies, res[0].position), ([2], 2))
        self.assertEqual(self.e.client.llen("caller:log"), 2)
        self.assertEqual(self.e.admit_many_after([], []), ([], []))

    def test_library_reloads_after_function_flush(self) -> None:
        # What a fresh server (or FUNCTION FLUSH) looks like: the first call loads the library.
        self.admit("a", {"k": 1})
        self.e.client.function_flush()
        self.assertTrue(self.admit("b", {"k": 2}).admitted)
        self.e.client.function_flush()
        self.assertEqual(len(self.e.admit_many([AdmitRequest(T, "c", {"k": 3}, 60)])), 1)
        self.assertIn(library().name, loaded_libraries(self.e.client))

    def test_sweep_reclaims_whatever_the_due_hint_says_and_repairs_it(self) -> None:
        # "\1due" lets operations skip the lease scan; the sweep must not depend on it.
        self.admit("a", {"k": 1}, lease=60)
        state, leases = tag_keys("fq", T)[0], tag_keys("fq", T)[2]
        self.e.client.zadd(leases, {"a": 0}, xx=True)  # expired, behind the hint's back
        self.e.client.hset(state, "\1due", 10**13)  # and a hint that says "nothing before 2286"
        self.assertIn("due after the earliest lease", self.e.check_invariants(tag=T))
        self.assertEqual(self.e.reclaim(tag=T).reclaimed, [Woken("a", "d-a")])
        self.assertEqual(self.e.check_invariants(tag=T), [])
        self.assertTrue(self.admit("b", {"k": 1}).admitted)
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_engine_libraries_lists_and_prunes_other_versions(self) -> None:
        self.admit("a", {"k": 1})  # loads this code's library
        old = "fairqueue_000000000000"
        self.e.client.function_load(
            f"#!lua name={old}\nredis.register_function('fq_000000000000_admit_job', function() return 1 end)",
            replace=True,
        )
        out = io.StringIO()
        call_command("engine_libraries", stdout=out)
        self.assertIn(old, out.getvalue())
        self.assertIn(f"{library().name}  (this code)", out.getvalue())
        out = io.StringIO()
        call_command("engine_libraries", "--prune", stdout=out)
        self.assertIn(f"deleted {old}", out.getvalue())
        self.assertNotIn(old, loaded_libraries(self.e.client))
        self.assertIn(library().name, loaded_libraries(self.e.client))
        self.assertTrue(self.admit("b", {"k": 2}).admitted)

    def test_counts_and_clean_state_after_release(self) -> None:
        self.admit("a", {"x": 2, "y": 2})
        self.assertEqual(self.e.counts(tag=T, keys=["x", "y", "z"]), {"x": 1, "y": 1, "z": 0})
        self.e.release(tag=T, job_id="a")
        self.assertEqual(stored_kinds(self.e.client), {"state", "clock"})  # no waiters or leases left
        fields = set(self.e.client.hkeys(tag_keys("fq", T)[0]))
        self.assertEqual({f for f in fields if f[:1] != b"\1"}, set())  # idle keys forget their limits too

    def test_counts_many_of_the_same_long_key_list_follow_every_change(self) -> None:
        """A periodic reader passes the same list of thousands of keys each time: it is
        checked once and a reply equal to the last is not decoded again, but a changed
        reply is, and the caller may change the dict it gets."""
        keys = [f"t:{i}" for i in range(200)]
        self.admit("a", {"t:7": 2})
        first = self.e.counts_many({T: keys})[T]
        self.assertEqual(first["t:7"], 1)
        first["t:7"] = 99  # the caller's own copy
        self.assertEqual(self.e.counts_many({T: keys})[T]["t:7"], 1)
        self.admit("b", {"t:7": 2, "t:150": 1})
        again = self.e.counts_many({T: keys})[T]
        self.assertEqual((again["t:7"], again["t:150"], again["t:0"]), (2, 1, 0))
        self.assertEqual(self.e.counts_many({T: ["t:7"]})[T], {"t:7": 2})  # another list, same tag
        self.e.release(tag=T, job_id="a")
        self.assertEqual(self.e.counts_many({T: keys})[T]["t:7"], 1)

    def test_idle_keys_keep_no_fields_and_a_parked_job_brings_its_own_limit(self) -> None:
        """A tag's hash holds nothing for a key nobody holds or waits on, however many keys
        were ever used (a customer naming a sub-tenant per job must not grow it)."""
        state_key = tag_keys("fq", T)[0]
        for i in range(50):
            self.admit(f"j{i}", {f"sub:{i}": 1 if i % 2 else 3})  # odd: the hinted hot path
            self.e.release(tag=T, job_id=f"j{i}", keys=[f"sub:{i}"] if i % 2 else None)
        self.assertEqual({f for f in self.e.client.hkeys(state_key) if f[:1] != b"\1"}, set())
        # A limit-0 key keeps its limit while jobs wait on it (they are not idle).
        self.assertFalse(self.admit("z", {"zero": 0}).admitted)
        self.assertEqual(self.e.inspect_key(tag=T, key="zero").limit, 0)
        # j parks on "a" holding nothing; "b" is used by others meanwhile and goes idle, so
        # its limit is forgotten; when j is woken it takes "b" with the limit it passed.
        self.admit("ha", {"a": 1})
        self.assertFalse(self.admit("j", {"a": 1, "b": 2}).admitted)
        self.admit("hb", {"b": 7})
        self.e.release(tag=T, job_id="hb")
        self.assertIsNone(self.e.inspect_key(tag=T, key="b").limit)
        self.assertEqual(self.e.release(tag=T, job_id="ha").woken, [Woken("j", "d-j")])
        self.assertEqual(self.e.inspect_key(tag=T, key="b").limit, 2)
        self.assertEqual(self.e.inspect_job(tag=T, job_id="j").held_keys, ["a", "b"])
        # ... and parks on a later key with its own limit when that one is idle at 0.
        self.admit("hc", {"c": 1})
        self.assertFalse(self.admit("k", {"c": 1, "d": 0}).admitted)  # parks on c, holding nothing
        self.e.release(tag=T, job_id="hc")  # k takes c, then parks on d (limit 0, its own)
        state = self.e.inspect_job(tag=T, job_id="k")
        self.assertEqual((state.held_keys, state.parked_on), (["c"], "d"))
        self.assertEqual(self.e.inspect_key(tag=T, key="d").limit, 0)
        self.assertEqual([w.job_id for w in self.e.set_limits(tag=T, limits={"d": 1})], ["k"])
        self.assertEqual(self.e.check_invariants(tag=T), [])
        for job in ("j", "k", "z"):
            self.e.cancel(tag=T, job_id=job) if job == "z" else self.e.release(tag=T, job_id=job)
        # Left: the limit-0 key's limit (its waiter was cancelled, which frees no room).
        self.assertEqual({f for f in self.e.client.hkeys(state_key) if f[:1] != b"\1"}, {b"\0zero"})

    def test_require_ready_admits_nothing_until_the_tag_is_initialised(self) -> None:
        # A fresh (or flushed) tag is not ready: a guarded admit stores nothing at all.
        out = self.e.admit(tag=T, job_id="a", keys={"k": 5}, lease_seconds=60, require_ready=True)
        self.assertEqual((out.admitted, out.parked_on, out.position, out.not_ready), (False, None, None, True))
        self.assertLessEqual(stored_kinds(self.e.client), {"clock"})  # no state stored
        bulk = self.e.admit_many([AdmitRequest(T, "b", {"k": 5}, 60)], require_ready=True)
        self.assertTrue(bulk[0].not_ready)
        bulk = self.e.admit_many([AdmitRequest(T, "b", {"k": 5}, 60, require_ready=True)])
        self.assertTrue(bulk[0].not_ready)
        self.assertEqual(self.e.set_limits(tag=T, limits={"k": 3}, require_ready=True), [])
        self.assertLessEqual(stored_kinds(self.e.client), {"clock"})  # no state stored
        # A rebuild re-enters what it knows unguarded, then marks the tag ready (idempotent).
        self.assertTrue(self.admit("running", {"k": 1}).admitted)
        self.assertTrue(self.e.init_tag(tag=T))
        self.assertFalse(self.e.init_tag(tag=T))
        out = self.e.admit(tag=T, job_id="a", keys={"k": 1}, lease_seconds=60, require_ready=True)
        self.assertEqual((out.admitted, out.parked_on, out.position, out.not_ready), (False, "k", 1, False))
        again = self.e.admit(tag=T, job_id="running", keys={"k": 1}, lease_seconds=60, require_ready=True)
        self.assertTrue(again.admitted and again.duplicate and not again.not_ready)
        self.assertFalse(self.e.admit(tag="s:other", job_id="x", keys={"k": 1}, lease_seconds=60).not_ready)
        self.assertEqual(self.e.set_limits(tag=T, limits={"k": 2}, require_ready=True), [Woken("a", "")])
        self.assertEqual(self.e.check_invariants(tag=T), [])
        # Losing the data (FLUSHDB) loses readiness with it.
        self.e.client.flushdb()
        self.assertTrue(self.e.admit(tag=T, job_id="c", keys={"k": 1}, lease_seconds=60, require_ready=True).not_ready)

    def test_validation(self) -> None:
        bad = [
            dict(keys={}),
            dict(keys=[("a", 1), ("a", 2)]),
            dict(keys={"a\0b": 1}),
            dict(keys={"a\1": 1}),
            dict(keys={"": 1}),
            dict(keys={"a": -1}),
            dict(keys={"a": 1.5}),
            dict(keys={"a": True}),
            dict(keys={"a": 1}, priority=251),
            dict(keys={"a": 1}, priority=-1),
            dict(keys={"a": 1}, lease_seconds=0),
            dict(keys={"a": 1}, lease_seconds=-1),
            dict(keys={"a": 1}, job_id=""),
            dict(keys={"a": 1}, tag=""),
            dict(keys={"a": 1}, tag="x}y"),
            dict(keys=[KeyLimit("a", 1, "f\0g")]),
            dict(keys=[KeyLimit("a", 1, "f\1g")]),
            dict(keys=[KeyLimit("a", 1, "f", 0)]),
            dict(keys=[KeyLimit("a", 1, "f", -1.0)]),
            dict(keys=[KeyLimit("a", 1, "f", float("nan"))]),
            dict(keys=[KeyLimit("a", 1, "f", float("inf"))]),
            dict(keys=[KeyLimit("a", 1, "f", True)]),
            dict(keys=[KeyLimit("a", 1, 7)]),  # type: ignore[arg-type]
        ]
        for override in bad:
            kwargs = dict(tag=T, job_id="j", keys={"a": 1}, lease_seconds=10, priority=0)
            kwargs.update(override)
            with self.subTest(override=override), self.assertRaises(ValueError):
                self.e.admit(**kwargs)  # type: ignore[arg-type]
        with self.assertRaises(ValueError):
            self.e.renew(tag=T, job_id="j", lease_seconds=0)
        with self.assertRaises(ValueError):
            self.e.reclaim(tag=T, max_jobs=0)
        with self.assertRaises(ValueError):
            Engine(self.e.client, prefix="a{b")
        self.assertEqual(self.e.client.dbsize(), 0)


class AsyncEngineBehaviour(RedisTestCase):
    def test_async_api_matches_sync(self) -> None:
        async def scenario() -> None:
            client = redis.asyncio.Redis.from_url(settings.REDIS_URL)
            e = AsyncEngine(client)
            try:
                self.assertTrue((await e.admit(tag=T, job_id="a", keys={"k": 1}, lease_seconds=60, data="A")).admitted)
                b = await e.admit(tag=T, job_id="b", keys={"k": 1}, priority=3, lease_seconds=60, data="B")
                self.assertEqual((b.parked_on, b.position), ("k", 1))
                many = await e.admit_many([AdmitRequest(T, "c", {"k": 1}, 60, 0, "C")])
                self.assertEqual(many[0].position, 2)
                replies, after = await e.admit_many_after([["SET", "caller:mark", "1"]], [])
                self.assertEqual((replies, after), ([True], []))
                self.assertEqual((await e.inspect_key(tag=T, key="k")).waiters_by_priority, {3: 1, 0: 1})
                self.assertTrue(await e.renew(tag=T, job_id="a", lease_seconds=60))
                self.assertEqual((await e.release(tag=T, job_id="a")).woken, [Woken("b", "B")])
                self.assertTrue((await e.cancel(tag=T, job_id="c")).cancelled)
                self.assertTrue(await e.expire_now(tag=T, job_id="b"))
                self.assertEqual((await e.sweep([T]))[T].reclaimed, [Woken("b", "B")])
                self.assertEqual(await e.set_limits(tag=T, limits={"k": 2}), [])
                self.assertEqual((await e.inspect_job(tag=T, job_id="b")).status, "unknown")
                self.assertEqual(await e.counts(tag=T, keys=["k"]), {"k": 0})
                self.assertEqual((await e.reclaim(tag=T)).reclaimed, [])
                self.assertEqual(await e.check_invariants(tag=T), [])
                nr = await e.admit(tag="s:new", job_id="n", keys={"k": 1}, lease_seconds=60, require_ready=True)
                self.assertTrue(nr.not_ready)
                self.assertTrue(await e.init_tag(tag="s:new"))
                nr = await e.admit(tag="s:new", job_id="n", keys={"k": 1}, lease_seconds=60, require_ready=True)
                self.assertTrue(nr.admitted and not nr.not_ready)
            finally:
                await client.aclose()

        asyncio.run(scenario())
