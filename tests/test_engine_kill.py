"""A worker killed with SIGKILL while holding slots leaks nothing: once its lease runs
out, the next call (or the sweep) reclaims its holds, reports the job for re-delivery
and hands the slots to the jobs parked behind it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis
from django.conf import settings

from fairqueue.engine import Engine, Woken
from tests.base import RedisTestCase

T = "s:kill"
VICTIM = """
import sys, time, redis
from fairqueue.engine import Engine
e = Engine(redis.Redis.from_url(sys.argv[1]))
assert e.admit(tag=sys.argv[2], job_id="victim-1", keys={"a": 1, "b": 1}, lease_seconds=1, data="v1").admitted
assert e.admit(tag=sys.argv[2], job_id="victim-2", keys={"c": 1}, lease_seconds=1, data="v2").admitted
print("ready", flush=True)
time.sleep(600)
"""


class SigkillTest(RedisTestCase):
    def kill_victim_after(self, park_waiters: Callable[[], object]) -> None:
        """Start VICTIM (it admits victim-1 on a+b and victim-2 on c, 1 s leases), let
        `park_waiters` queue jobs behind it, then SIGKILL it while it holds its slots."""
        root = Path(__file__).resolve().parent.parent
        proc = subprocess.Popen(
            [sys.executable, "-c", VICTIM, settings.REDIS_URL, T], cwd=root, stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            self.assertEqual(proc.stdout.readline().strip(), "ready")
            park_waiters()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.assertEqual(proc.returncode, -signal.SIGKILL)

    def test_killed_holder_slots_go_to_waiters_after_lease(self) -> None:
        e = Engine(redis.Redis.from_url(settings.REDIS_URL))

        def park_waiters() -> None:
            for job, keys in [("w-a", {"a": 1}), ("w-b", {"b": 1, "d": 1}), ("w-c", {"c": 1})]:
                self.assertFalse(e.admit(tag=T, job_id=job, keys=keys, lease_seconds=60, data=job).admitted)

        self.kill_victim_after(park_waiters)
        # Still held right after the kill: the lease has not run out.
        self.assertEqual(e.reclaim(tag=T).reclaimed, [])
        self.assertEqual(e.inspect_key(tag=T, key="a").holders, ["victim-1"])
        leases = [e.inspect_job(tag=T, job_id=v).lease_expires_ms for v in ("victim-1", "victim-2")]
        expires = max(lease or 0 for lease in leases)
        while True:
            sec, usec = e.client.time()
            if sec * 1000 + usec // 1000 > expires:
                break
            self.assertLess(expires - (sec * 1000 + usec // 1000), 1100)  # never longer than one lease
            time.sleep(0.05)
        # The next call touching the tag reclaims both holders and hands their slots on.
        res = e.admit(tag=T, job_id="late", keys={"a": 1}, lease_seconds=60, data="late")
        self.assertEqual(res.reclaimed, [Woken("victim-1", "v1"), Woken("victim-2", "v2")])
        self.assertEqual(res.woken, [Woken("w-a", "w-a"), Woken("w-b", "w-b"), Woken("w-c", "w-c")])
        self.assertEqual((res.admitted, res.parked_on, res.position), (False, "a", 1))
        self.assertEqual(e.inspect_key(tag=T, key="c").holders, ["w-c"])
        self.assertEqual(e.check_invariants(tag=T), [])

    def test_sweep_reclaims_an_idle_tag(self) -> None:
        e = Engine(redis.Redis.from_url(settings.REDIS_URL))
        self.kill_victim_after(lambda: e.admit(tag=T, job_id="w-c", keys={"c": 1}, lease_seconds=60, data="w-c"))
        deadline = time.monotonic() + 3
        reclaimed: list[str] = []
        woken: list[str] = []
        while time.monotonic() < deadline and len(reclaimed) < 2:
            result = e.sweep([T, "s:other"])[T]
            reclaimed += [w.job_id for w in result.reclaimed]
            woken += [w.job_id for w in result.woken]
            time.sleep(0.05)
        self.assertEqual(sorted(reclaimed), ["victim-1", "victim-2"])
        self.assertEqual(woken, ["w-c"])
