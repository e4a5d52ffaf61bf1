"""Multi-process stress: several OS processes submit and run a few hundred random
multi-key jobs with random priorities and durations against the real scripts.

Each process records every hold interval with Redis TIME (start after admission, end
before release); jobs woken by a release go through a Redis list to whichever process
is free. Asserts: no key ever had more concurrent holders than its limit; the scripts'
audit (which includes "no key with room has waiters") was clean at every snapshot taken
during the run; every job finished; nothing is left held, parked or leased at the end.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import redis
from django.conf import settings

from fairqueue.engine import Engine
from fairqueue.engine.keys import LAYOUT, key_name
from tests.base import RedisTestCase

T = "s:stress"
LIMITS = {"k0": 1, "k1": 2, "k2": 3, "k3": 2, "k4": 1}
N_JOBS = 300
N_PROCS = 4
READY = "stress:ready"
INTERVALS = "stress:intervals"
DONE = "stress:done"


def make_jobs(seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    return [
        {
            "id": f"job{i:04d}",
            "keys": sorted(rng.sample(sorted(LIMITS), rng.randint(1, 3))),
            "priority": rng.choice([0, 0, 1, 2, 5]),
            "duration": rng.uniform(0, 0.02),
        }
        for i in range(N_JOBS)
    ]


def worker_main(url: str, index: int, seed: int) -> None:
    """One worker process: submit its share of jobs, run what it is handed, release."""
    client = redis.Redis.from_url(url)
    engine = Engine(client)
    jobs = make_jobs(seed)[index::N_PROCS]

    def now_us() -> int:
        sec, usec = client.time()
        return int(sec) * 1_000_000 + int(usec)

    def run(data: str) -> None:
        job = json.loads(data)
        start = now_us()
        time.sleep(job["duration"])
        end = now_us()
        client.rpush(INTERVALS, json.dumps([job["id"], job["keys"], start, end]))
        # Half the releases name their keys, as FairQueue's workers do (the hinted fast path).
        hint = job["keys"] if int(job["id"][3:]) % 2 else None
        woken = engine.release(tag=T, job_id=job["id"], keys=hint).woken
        if woken:
            client.rpush(READY, *[w.data for w in woken])
        client.incr(DONE)

    while True:
        if jobs:
            job = jobs.pop(0)
            data = json.dumps(job)
            res = engine.admit(
                tag=T,
                job_id=str(job["id"]),
                keys={k: LIMITS[k] for k in job["keys"]},  # type: ignore[attr-defined]
                priority=int(job["priority"]),  # type: ignore[call-overload]
                lease_seconds=60,
                data=data,
            )
            if res.woken:
                client.rpush(READY, *[w.data for w in res.woken])
            if res.admitted:
                run(data)
            continue
        popped = client.blpop([READY], timeout=0.05)
        if popped:
            run(popped[1].decode())
        elif int(client.get(DONE) or 0) >= N_JOBS:
            return


class MultiProcessStressTest(RedisTestCase):
    def test_many_processes_random_jobs(self) -> None:
        seed = random.randrange(1_000_000)
        engine = Engine(redis.Redis.from_url(settings.REDIS_URL))
        root = Path(__file__).resolve().parent.parent
        code = (
            "import sys; from tests.test_engine_stress import worker_main; "
            "worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))"
        )
        procs = [
            subprocess.Popen([sys.executable, "-c", code, settings.REDIS_URL, str(i), str(seed)], cwd=root)
            for i in range(N_PROCS)
        ]
        snapshots = 0
        try:
            deadline = time.monotonic() + 60
            while any(p.poll() is None for p in procs):
                self.assertLess(time.monotonic(), deadline, f"stress did not finish (seed {seed})")
                self.assertEqual(engine.check_invariants(tag=T), [], f"seed {seed}")
                for key in LIMITS:
                    state = engine.inspect_key(tag=T, key=key)
                    self.assertLessEqual(state.held, LIMITS[key])
                    if state.waiting:
                        self.assertEqual(state.held, LIMITS[key], f"{key} parked with room (seed {seed})")
                snapshots += 1
                time.sleep(0.01)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        self.assertEqual([p.returncode for p in procs], [0] * N_PROCS, f"seed {seed}")
        self.assertGreater(snapshots, 5)

        rows = [json.loads(r) for r in engine.client.lrange(INTERVALS, 0, -1)]
        self.assertEqual(sorted(r[0] for r in rows), sorted(str(j["id"]) for j in make_jobs(seed)))
        for key, limit in LIMITS.items():
            events = []
            for _job, keys, start, end in rows:
                if key in keys:
                    events += [(start, 1), (end, -1)]
            level = peak = 0
            for _t, delta in sorted(events, key=lambda ev: (ev[0], ev[1])):  # ends before starts
                level += delta
                peak = max(peak, level)
            self.assertLessEqual(peak, limit, f"{key} exceeded its limit (seed {seed})")
            self.assertGreaterEqual(peak, 1)
        names = {k.decode().rsplit(":", 1)[1] for k in engine.client.keys(f"fq:{{{T}}}:v{LAYOUT}:*")}
        self.assertEqual(names, {"state", "clock"}, "waiters or leases left over")
        fields = {f[:1] for f in engine.client.hkeys(key_name("fq", T, "state"))}
        self.assertEqual(fields - {b"\1"}, set(), "counts, limits or specs left over (only meta fields may stay)")
        self.assertEqual(engine.check_invariants(tag=T), [])
