"""One fleet, one duty: of several real workers one runs the periodic duties; when it is
killed another takes them over within one lease; and the duties still do their work."""

from __future__ import annotations

import math
import time

from django.test import SimpleTestCase

from fairqueue.jobs.duties import RECENT_USE_SECONDS, RecentUse
from fairqueue.jobs.fleet import (
    BUSY_BATCH_KEY,
    BUSY_KEY,
    FORGET_AFTER_SECONDS,
    SEEN_KEY,
    WORKERS_KEY,
    fleet_read,
    worker_heartbeat,
)
from fairqueue.jobs.leadership import LEASE_MS, DutyLease, duty_leader
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.stats import STATS_KEY
from fairqueue.jobs.worker import TICK_SECONDS
from tenants.models import Tenant
from tests.base import RedisTestCase
from tests.factories import make_tenant
from tests.test_jobs_e2e import E2EBase
from tests.workers import WorkerProcess, wait_for

WINDOW_SECONDS = 6.0
TICKS_PER_SECOND_ONE_WORKER = 1 / TICK_SECONDS  # the ticker's mean interval


class FleetDutyTests(E2EBase):
    def duty_ticks(self) -> int:
        return int(self.redis.hget(STATS_KEY, "duty_ticks") or 0)

    def test_three_workers_tick_the_duties_as_one_and_a_killed_leader_is_replaced(self) -> None:
        workers = [WorkerProcess(slots=1, name=f"fleet{i}").start() for i in range(3)]
        leader = wait_for(duty_leader, timeout=30, message="a duty leader")
        self.assertIn(leader, {w.hostname for w in workers})
        wait_for(self.duty_ticks, timeout=30, message="the first duty tick counted")
        before = self.duty_ticks()
        time.sleep(WINDOW_SECONDS)
        ticked = self.duty_ticks() - before
        # Three workers each ticking would count about 3 x 2/s; the fleet ticks as one.
        self.assertLessEqual(ticked, 1.5 * TICKS_PER_SECOND_ONE_WORKER * WINDOW_SECONDS, ticked)
        self.assertGreater(ticked, 0)
        victim = next(w for w in workers if w.hostname == leader)
        victim.kill()
        successor = wait_for(
            lambda: (h := duty_leader()) not in (None, leader) and h,
            timeout=LEASE_MS / 1000 + 10,
            message="another worker to take the duties over",
        )
        self.assertIn(successor, {w.hostname for w in workers if w is not victim})
        # The duties run under the new leader: a raised limit wakes a parked job (limits refresh).
        tenant, key = make_tenant("raised", max_concurrency=1)
        first = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 30}})
        second = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0}})
        self.assertEqual(second["status"], "parked")
        wait_for(lambda: Job.objects.get(id=first["id"]).status == JobStatus.RUNNING, timeout=30, message="first")
        Tenant.objects.filter(pk=tenant.pk).update(max_concurrency=2)
        Tenant.objects.get(pk=tenant.pk).save()  # the admin's save: policy synced on commit
        wait_for(
            lambda: Job.objects.get(id=second["id"]).status == JobStatus.SUCCEEDED,
            timeout=30,
            message="the parked job woken by the new leader's limit refresh",
        )

    def test_a_clean_shutdown_hands_the_duties_on_at_once(self) -> None:
        first = WorkerProcess(slots=1, name="first").start()
        wait_for(lambda: duty_leader() == first.hostname, timeout=30, message="the first worker to lead")
        self.assertEqual(first.terminate(), 0)
        self.assertIsNone(duty_leader(), "the lease was released, not left to expire")
        second = WorkerProcess(slots=1, name="second").start()
        wait_for(lambda: duty_leader() == second.hostname, timeout=30, message="the second worker to lead")


class LeaseTests(RedisTestCase):
    def test_a_follower_tries_again_only_once_the_leaders_lease_may_have_ended(self) -> None:
        leader, follower = DutyLease("leader"), DutyLease("follower")
        self.assertTrue(leader.hold())
        self.assertFalse(follower.hold())  # told how long the lease runs
        self.redis.config_resetstat()
        for _ in range(5):
            self.assertFalse(follower.hold())
        calls = {k: v["calls"] for k, v in self.redis.info("commandstats").items()}
        self.assertNotIn("cmdstat_eval", calls, calls)  # no try while the lease surely runs
        # The leader stops extending (killed): the follower takes over once the lease ends.
        deadline = time.monotonic() + LEASE_MS / 1000 + 5
        while not follower.hold() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(duty_leader(), "follower")
        self.assertGreater(follower.epoch, 0)
        self.assertFalse(leader.hold())  # fenced out

    def test_a_follower_checks_a_renewed_lease_with_one_command(self) -> None:
        leader, follower = DutyLease("leader"), DutyLease("follower")
        self.assertTrue(leader.hold())
        self.assertFalse(follower.hold())
        self.redis.config_resetstat()
        leader_holds = 0
        deadline = time.monotonic() + 2 * LEASE_MS / 1000 + 1
        while time.monotonic() < deadline:  # past the first lease: the follower looks again
            self.assertTrue(leader.hold())
            leader_holds += 1
            self.assertFalse(follower.hold())
            time.sleep(0.25)
        calls = {k: v["calls"] for k, v in self.redis.info("commandstats").items()}
        self.assertEqual(calls.get("cmdstat_eval"), leader_holds, "only the leader ran the script")
        self.assertGreaterEqual(calls.get("cmdstat_pttl", 0), 1, calls)
        self.assertEqual(duty_leader(), "leader")


class RegistryTests(RedisTestCase):
    def test_a_worker_silent_for_long_is_forgotten_everywhere(self) -> None:
        dead, alive = "crashed@host", "alive@host"
        for key in (WORKERS_KEY, BUSY_KEY, BUSY_BATCH_KEY):
            self.redis.hset(key, dead, 4)
        self.redis.zadd(SEEN_KEY, {dead: time.time() - FORGET_AFTER_SECONDS - 1})
        worker_heartbeat(hostname=alive, slots=2, running=1, running_batch=0)
        for key in (WORKERS_KEY, BUSY_KEY, BUSY_BATCH_KEY):
            self.assertEqual(self.redis.hkeys(key), [alive.encode()], key)
        self.assertEqual(self.redis.zrange(SEEN_KEY, 0, -1), [alive.encode()])
        self.assertEqual(
            fleet_read(),
            {
                "workers": 1,
                "slots": 2,
                "busy": 1,
                "busy_batch": 0,
                "quarantine_workers": 0,
                "quarantine_slots": 0,
                "quarantine_busy": 0,
            },
        )


class RecentUseTests(SimpleTestCase):
    """What a tenant held of late, the room a binding shard keeps free for it (duties.RecentUse)."""

    def test_follows_what_a_tenant_holds_and_forgets_a_quiet_one(self) -> None:
        use = RecentUse()
        self.assertEqual(use.observe({"steady": 2, "idle": 0}, now=100.0), {"steady": 2.0}, "starts from what it holds")
        after_one = use.observe({"steady": 0, "idle": 0}, now=100.0 + RECENT_USE_SECONDS)
        self.assertAlmostEqual(after_one["steady"], 2.0 * math.exp(-1.0))
        # Gaps between a steady tenant's jobs do not erase it: holding 1 every other tick
        # keeps it near its mean.
        now = 100.0 + RECENT_USE_SECONDS
        for tick in range(60):
            now += 0.5
            use.observe({"steady": tick % 2, "idle": 0}, now=now)
        self.assertAlmostEqual(use.held["steady"], 0.5, delta=0.1)
        for _ in range(200):
            now += 0.5
            use.observe({"steady": 0, "idle": 0}, now=now)
        self.assertEqual(use.held, {}, "a tenant quiet for long is forgotten")

    def test_frequent_ticks_with_unchanged_holders_still_let_a_mean_move(self) -> None:
        # The tick passes the very same holders dict while nothing changed; ticks closer
        # together than a hundredth of a slot's move must not freeze the mean short of it.
        use = RecentUse()
        use.observe({"mate": 2}, now=0.0)
        unchanged = {"mate": 0}
        now = 0.0
        for _ in range(5000):
            now += 0.01
            use.observe(unchanged, now=now)
        self.assertNotIn("mate", use.held, "forgotten after 50 s of holding nothing")

    def test_its_version_moves_only_when_a_mean_does(self) -> None:
        use = RecentUse()
        use.observe({"a": 1, "b": 0}, now=0.0)
        settled = use.version
        use.observe({"a": 1, "b": 0}, now=0.5)
        self.assertEqual(use.version, settled, "nothing moved: a tick may reuse its plan")
        use.observe({"a": 3, "b": 0}, now=1.0)
        self.assertGreater(use.version, settled)
