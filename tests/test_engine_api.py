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

from fairqueue.engine import Admission, AdmitRequest, AsyncEngine, Engine, KeyLimit, Sweeper, Woken
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


class ReservesAndGuarantees(RedisTestCase):
    """Issue 41's primitive (docs/engine.md, "Reserves and guarantees"): shard key "z" keeps
    slots for jobs within their guarantee, judged on their tenant key "t:<tenant>" (the
    guard, which sorts before "z")."""

    def setUp(self) -> None:
        super().setUp()
        self.e = Engine(redis.Redis.from_url(settings.REDIS_URL))

    def keys(self, tenant: str, limit: int = 4, reserve: int = 2, guarantee: int = 1) -> list[KeyLimit]:
        return [
            KeyLimit(f"t:{tenant}", 10),
            KeyLimit("z", limit, reserve=reserve, guard=f"t:{tenant}", guarantee=guarantee),
        ]

    def admit(self, job: str, tenant: str, priority: int = 0, **shard: int) -> Admission:
        keys = self.keys(tenant, **shard)
        return self.e.admit(tag=T, job_id=job, keys=keys, priority=priority, lease_seconds=60, data=f"d-{job}")

    def plain(self, job: str, keys: dict[str, int] | list[KeyLimit], priority: int = 0) -> Admission:
        return self.e.admit(tag=T, job_id=job, keys=keys, priority=priority, lease_seconds=60, data=f"d-{job}")

    def zstate(self) -> tuple[int, int, int, int]:
        """(held, reserve, waiting, floor_waiting) of the shard key."""
        s = self.e.inspect_key(tag=T, key="z", holders=False)
        return s.held, s.reserve, s.waiting, s.floor_waiting

    def woken(self, job: str, keys: list[str] | None = None) -> list[str]:
        return [w.job_id for w in self.e.release(tag=T, job_id=job, keys=keys).woken]

    def flood(self) -> None:
        """Limit 4, reserve 2: A's first job (within: A holds 1 <= 1) and second (above its
        guarantee, but below 4 - 2) get in; A's third parks in the general band."""
        self.assertTrue(self.admit("a1", "A").admitted)
        self.assertTrue(self.admit("a2", "A").admitted)
        a3 = self.admit("a3", "A")
        self.assertEqual((a3.admitted, a3.parked_on, a3.position), (False, "z", 1))
        self.assertEqual(self.zstate(), (2, 2, 1, 0))

    def test_the_reserve_admits_only_jobs_within_their_guarantee(self) -> None:
        self.flood()
        # B within its guarantee takes a reserved slot past A's waiter; C too.
        self.assertTrue(self.admit("b1", "B").admitted)
        # B's second job is above its guarantee (B holds 2 > 1): it waits like A's.
        self.assertEqual(self.admit("b2", "B").position, 2)
        self.assertTrue(self.admit("c1", "C").admitted)
        # Full: D, within its guarantee, parks in the floor band, ahead of A's and B's.
        d1 = self.admit("d1", "D")
        self.assertEqual((d1.admitted, d1.position), (False, 1))
        self.assertEqual(self.zstate(), (4, 2, 3, 1))
        # A guarantee of 2 lets a tenant's second job in; a guarantee of 0 none.
        self.assertEqual(self.e.inspect_job(tag=T, job_id="d1").priority, 0)
        self.assertEqual(self.e.check_invariants(tag=T), [])
        # Reserve limited to the limit: a reserve of 9 on limit 4 keeps all 4.
        self.e.client.flushdb()
        self.assertFalse(self.admit("x", "X", reserve=9, guarantee=0).admitted)
        self.assertTrue(self.admit("y", "Y", reserve=9).admitted)
        self.assertEqual(self.e.inspect_key(tag=T, key="z").reserve, 4)
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_the_floor_band_is_served_first_whatever_the_priority(self) -> None:
        self.flood()
        self.admit("b1", "B")
        self.admit("c1", "C")
        self.assertEqual(self.admit("top", "A", priority=250).position, 1)  # general band, priority first
        self.assertEqual(self.admit("d-low", "D", priority=0).position, 1)  # floor band: before it
        self.assertEqual(self.admit("e-mid", "E", priority=5).position, 1)  # the band by priority too
        state = self.e.inspect_key(tag=T, key="z", holders=False)
        self.assertEqual((state.waiters_by_priority, state.floor_waiting), ({250: 1, 5: 1, 0: 2}, 2))
        self.assertEqual(self.e.inspect_job(tag=T, job_id="e-mid").priority, 5)
        self.assertEqual(self.woken("a1"), ["e-mid"])
        self.assertEqual(self.woken("a2"), ["d-low"])
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_a_release_in_the_reserved_slots_wakes_only_the_floor_band(self) -> None:
        self.flood()
        self.admit("b1", "B")
        self.admit("c1", "C")  # 4 holders: a1 a2 b1 c1; a3 waits (general)
        self.assertEqual(self.woken("b1", ["t:B", "z"]), [])  # 3 holders: slot kept, a3 stays
        self.assertEqual(self.zstate(), (3, 2, 1, 0))
        self.assertTrue(self.admit("d1", "D").admitted)  # the kept slot goes to D at once
        self.assertEqual(self.admit("e1", "E").position, 1)  # full: E waits in the floor band
        self.assertEqual(self.woken("d1"), ["e1"])  # a floor-band head takes a reserved slot
        self.assertEqual(self.woken("c1"), [])  # 3 again: a3 still may not
        self.assertEqual(self.woken("e1"), [])  # nor at 2 = 4 - 2
        self.assertEqual(self.woken("a1"), ["a3"])  # 1 holder, below 4 - 2: a3's turn
        self.assertEqual(self.zstate(), (2, 2, 0, 0))
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_a_job_above_its_guarantee_stays_in_the_general_band(self) -> None:
        self.flood()
        self.admit("b1", "B")
        self.admit("c1", "C")
        self.assertEqual(self.admit("b2", "B").position, 2)  # above: B holds 2
        self.assertEqual(self.e.cancel(tag=T, job_id="a3").cancelled, True)
        self.e.release(tag=T, job_id="b1")  # B's count falls to 1: b2 is within now ...
        self.assertEqual(self.zstate(), (3, 2, 1, 0))  # ... but waits where it parked
        self.assertEqual(self.woken("a1"), [])  # general: served below 4 - 2 only
        self.assertEqual(self.woken("a2"), ["b2"])
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_a_lowered_reserve_or_a_raised_limit_hands_on_at_once(self) -> None:
        self.flood()
        self.admit("b1", "B")
        self.admit("b2", "B")  # general, behind a3
        self.admit("c1", "C")  # 4 holders; a3, b2 wait
        self.e.release(tag=T, job_id="c1")
        self.assertEqual(self.zstate(), (3, 2, 2, 0))
        # Reserve 1: the general band's room is 3: nobody yet. Reserve 0: a3 gets the 4th.
        self.assertEqual(self.e.set_limits(tag=T, limits=[KeyLimit("z", 4, reserve=1)]), [])
        woken = self.e.set_limits(tag=T, limits=[KeyLimit("z", 4, reserve=0)])
        self.assertEqual([w.job_id for w in woken], ["a3"])
        # A mapping passes no reserve: it sets reserve 0, like an admit without one.
        self.e.set_limits(tag=T, limits=[KeyLimit("z", 4, reserve=3)])
        self.assertEqual(self.e.inspect_key(tag=T, key="z").reserve, 3)
        self.assertEqual([w.job_id for w in self.e.set_limits(tag=T, limits={"z": 5})], ["b2"])
        self.assertEqual(self.zstate(), (5, 0, 0, 0))
        # An admit passing a lower reserve hands on before it competes (no barging).
        self.e.set_limits(tag=T, limits=[KeyLimit("z", 5, reserve=2)])
        self.assertEqual(self.admit("a4", "A", limit=5, reserve=2).position, 1)
        self.e.release(tag=T, job_id="b1")  # 4 holders, general room 3: a4 stays
        res = self.admit("a5", "A", limit=5, reserve=0)
        self.assertEqual(([w.job_id for w in res.woken], res.position), (["a4"], 1))
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_bulk_admits_decide_like_single_ones(self) -> None:
        jobs = [("a1", "A", 0), ("a2", "A", 0), ("a3", "A", 9), ("b1", "B", 0), ("b2", "B", 0), ("c1", "C", 0)]
        jobs += [("d1", "D", 0), ("e1", "E", 3), ("a4", "A", 0)]
        single = [(a.admitted, a.position) for a in (self.admit(j, t, p) for j, t, p in jobs)]
        items = [AdmitRequest("s:bulk", j, self.keys(t), 60, p, f"d-{j}") for j, t, p in jobs]
        bulk = [(a.admitted, a.position) for a in self.e.admit_many(items)]
        self.assertEqual(bulk, single)
        self.assertEqual(
            single,
            [(True, None), (True, None), (False, 1), (True, None), (False, 2), (True, None)]
            + [(False, 1)] * 2
            + [(False, 5)],
        )
        for tag in (T, "s:bulk"):
            self.assertEqual(self.e.check_invariants(tag=tag), [])
        self.assertEqual(
            self.e.inspect_key(tag="s:bulk", key="z").waiters_by_priority,
            self.e.inspect_key(tag=T, key="z").waiters_by_priority,
        )

    def test_a_woken_job_is_judged_at_its_later_key_by_its_guard_then(self) -> None:
        z = [KeyLimit("z", 3, reserve=1)]  # one-key jobs on z: never within a guarantee
        j_keys = [KeyLimit("t:A", 1), KeyLimit("z", 3, reserve=1, guard="t:A", guarantee=1)]
        # h holds t:A (limit 1): j parks there; z (limit 3, reserve 1) fills meanwhile.
        self.assertTrue(self.plain("h", {"t:A": 1}).admitted)
        self.assertEqual(self.plain("j", j_keys, priority=7).parked_on, "t:A")
        self.assertTrue(self.plain("o1", z).admitted)
        self.assertTrue(self.plain("o2", z).admitted)  # 2 = 3 - 1: others stop here
        self.assertEqual(self.plain("o3", z).position, 1)
        # Woken on t:A (A holds 1 <= 1, with j), j takes z's reserved slot past o3.
        self.assertEqual(self.woken("h"), ["j"])
        # Again with z full by then: j parks on z in the floor band, at its own priority.
        self.e.release(tag=T, job_id="j")
        self.plain("h", {"t:A": 1})
        self.assertEqual(self.plain("j", j_keys, priority=7).parked_on, "t:A")
        self.assertTrue(self.admit("b1", "B", limit=3, reserve=1).admitted)
        self.assertEqual(self.woken("h"), [])
        state = self.e.inspect_job(tag=T, job_id="j")
        self.assertEqual((state.held_keys, state.parked_on, state.position, state.priority), (["t:A"], "z", 1, 7))
        self.assertEqual(self.e.inspect_key(tag=T, key="z").waiters_by_priority, {7: 1, 0: 1})
        self.assertEqual(self.zstate(), (3, 1, 2, 1))
        self.assertEqual(self.woken("o1"), ["j"])  # the floor band first
        # A job woken from the floor band of one key waits at the next in its own band (none
        # there: no guard) at its real priority.
        self.plain("zh", {"zz": 1})
        k_keys = [*self.keys("K", 3, 1), KeyLimit("zz", 1)]
        self.assertEqual(self.plain("k", k_keys, priority=5).position, 1)  # z's floor band
        self.assertEqual(self.woken("j"), [])  # k takes z, then waits on zz
        state = self.e.inspect_job(tag=T, job_id="k")
        self.assertEqual((state.held_keys, state.parked_on, state.priority), (["t:K", "z"], "zz", 5))
        zz = self.e.inspect_key(tag=T, key="zz", holders=False)
        self.assertEqual((zz.waiters_by_priority, zz.floor_waiting), ({5: 1}, 0))
        self.assertEqual(self.woken("zh"), ["k"])
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_a_woken_job_reads_its_guard_count_as_it_is_mid_call(self) -> None:
        """A handoff writes its key's count at its end, a drop the counts of the keys it
        frees at its end: a woken job's guard count must be today's, not what Redis holds."""
        # In a drop: x holds g and p; y holds g and waits on p; z (limit 2, reserve 1) has
        # one holder. x's release frees g (g's count 1, not yet written), then p: y takes it
        # and goes on to z with g at 1 <= its guarantee 1: within, so z's kept slot.
        self.plain("o", {"z": 2})
        self.plain("x", {"g": 2, "p": 1})
        y_keys = [KeyLimit("g", 2), KeyLimit("p", 1), KeyLimit("z", 2, reserve=1, guard="g", guarantee=1)]
        self.assertEqual(self.e.admit(tag=T, job_id="y", keys=y_keys, lease_seconds=60).parked_on, "p")
        self.assertEqual(self.woken("x"), ["y"])
        self.assertEqual(self.e.inspect_key(tag=T, key="z", holders=True).holders, ["o", "y"])
        # In a handoff: a raised limit wakes w on g (g's count 2, not yet written: Redis says 1);
        # w's guarantee 1 is passed, so at z (full for it: 1 of 2, reserve 1) it waits,
        # in the general band.
        self.e.client.flushdb()
        self.plain("o", {"z": 2})
        self.plain("x", {"g": 1})
        w_keys = [KeyLimit("g", 1), KeyLimit("z", 2, reserve=1, guard="g", guarantee=1)]
        self.assertEqual(self.e.admit(tag=T, job_id="w", keys=w_keys, lease_seconds=60).parked_on, "g")
        self.assertEqual(self.e.set_limits(tag=T, limits={"g": 2}), [])
        state = self.e.inspect_job(tag=T, job_id="w")
        self.assertEqual((state.held_keys, state.parked_on), (["g"], "z"))
        self.assertEqual(self.zstate(), (1, 1, 1, 0))
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_hinted_release_at_a_key_with_a_reserve_takes_the_general_path(self) -> None:
        """The written-out busy-key release (release_job.lua) serves keys without a reserve;
        at a key with one it must leave what the general path leaves."""
        for hint in (["z"], None):
            with self.subTest(hint=hint):
                self.e.client.flushdb()
                one = [KeyLimit("z", 3, reserve=1)]
                self.assertTrue(self.plain("p1", one).admitted)  # one-key jobs: never within
                self.assertTrue(self.plain("p2", one).admitted)
                self.assertEqual(self.plain("p3", one).position, 1)
                self.assertTrue(self.admit("b1", "B", limit=3, reserve=1).admitted)  # 3 = the limit
                # The key is at its limit and p3 a one-key head: the busy-key path would hand
                # it the slot; the reserve keeps it.
                self.assertEqual(self.woken("p1", hint), [])
                self.assertEqual(self.zstate(), (2, 1, 1, 0))
                self.assertEqual(self.admit("c1", "C", limit=3, reserve=1).admitted, True)
                self.assertEqual(self.admit("d1", "D", limit=3, reserve=1).position, 1)  # floor band
                self.assertEqual(self.woken("p2", hint), ["d1"])
                self.assertEqual(self.woken("b1"), [])
                self.assertEqual(self.woken("c1"), ["p3"])
                self.assertEqual(self.e.check_invariants(tag=T), [])
        # Without a reserve, a floor-band head (a guarded job: at least two keys) at a full
        # key is served first by the hinted release too.
        self.e.client.flushdb()
        self.plain("h1", {"z": 2})
        self.plain("h2", {"z": 2})
        self.plain("w1", {"z": 2}, priority=9)
        self.assertEqual(self.admit("f1", "F", limit=2, reserve=0).position, 1)
        self.assertEqual(self.woken("h1", ["z"]), ["f1"])
        self.assertEqual(self.woken("h2", ["z"]), ["w1"])
        self.assertEqual(self.e.check_invariants(tag=T), [])

    def test_an_idle_key_forgets_its_reserve_unless_every_slot_is_reserved(self) -> None:
        state_key = tag_keys("fq", T)[0]
        self.admit("a1", "A")
        self.e.release(tag=T, job_id="a1", keys=["t:A", "z"])
        self.assertEqual({f for f in self.e.client.hkeys(state_key) if f[:1] != b"\1"}, set())
        self.assertEqual((self.e.inspect_key(tag=T, key="z").limit, self.zstate()[1]), (None, 0))
        # Every slot reserved: only jobs within their guarantee run; the others wait, and
        # the key keeps its limit and reserve while they do, even with nobody holding it.
        self.assertEqual(self.plain("o", {"z": 2}).admitted, True)
        self.e.set_limits(tag=T, limits=[KeyLimit("z", 2, reserve=2)])
        self.assertEqual(self.plain("w", {"z": 2}).admitted, True)  # a plain admit: reserve 0 again
        self.e.set_limits(tag=T, limits=[KeyLimit("z", 2, reserve=2)])
        self.assertEqual(self.admit("g1", "G", limit=2, reserve=2).position, 1)  # floor, full
        self.e.release(tag=T, job_id="o")  # g1 takes the slot
        self.assertEqual(self.admit("n1", "G", limit=2, reserve=2).position, 1)  # above: general
        self.e.release(tag=T, job_id="w")
        self.e.release(tag=T, job_id="g1")
        self.assertEqual(self.zstate(), (0, 2, 1, 0))
        self.assertEqual(self.e.inspect_key(tag=T, key="z").limit, 2)
        self.assertEqual(self.e.check_invariants(tag=T), [])
        self.assertEqual([w.job_id for w in self.e.set_limits(tag=T, limits=[KeyLimit("z", 2, reserve=1)])], ["n1"])

    def test_validation_of_reserves_and_guards(self) -> None:
        bad: list[list[KeyLimit]] = [
            [KeyLimit("a", 1, reserve=-1)],
            [KeyLimit("a", 1, reserve=1.5)],  # type: ignore[arg-type]
            [KeyLimit("a", 1, reserve=True)],
            [KeyLimit("a", 1), KeyLimit("b", 1, guarantee=-1, guard="a")],
            [KeyLimit("a", 1), KeyLimit("b", 1, guarantee=2)],  # a guarantee without a guard
            [KeyLimit("b", 1, guard="a", guarantee=1)],  # not one of the job's keys
            [KeyLimit("a", 1, guard="b", guarantee=1), KeyLimit("b", 1)],  # sorts after
            [KeyLimit("a", 1, guard="a", guarantee=1)],  # itself
            [KeyLimit("a", 1), KeyLimit("b", 1, guard=3, guarantee=1)],  # type: ignore[arg-type]
        ]
        for keys in bad:
            with self.subTest(keys=keys), self.assertRaises(ValueError):
                self.e.admit(tag=T, job_id="j", keys=keys, lease_seconds=10)
        with self.assertRaisesRegex(ValueError, "sorts before"):
            self.e.admit(tag=T, job_id="j", keys=[KeyLimit("z", 1, guard="t:A", guarantee=1)], lease_seconds=10)
        with self.assertRaisesRegex(ValueError, "belong to a job"):
            self.e.set_limits(tag=T, limits=[KeyLimit("a", 1), KeyLimit("b", 1, guard="a", guarantee=1)])
        with self.assertRaisesRegex(ValueError, "reserve"):
            self.e.set_limits(tag=T, limits=[KeyLimit("a", 1, reserve=-1)])
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
