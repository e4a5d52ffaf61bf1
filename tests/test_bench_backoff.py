"""`manage.py bench backoff --quick` on the real stack: the figures' shape and the run's
correctness, not its speed (the figures of full runs are in docs/resources.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import redis
from django.test import SimpleTestCase

from tests.test_bench_noisy import bench_redis_url
from tests.test_bench_throughput import postgres_server_url

ROOT = Path(__file__).resolve().parent.parent


class BenchBackoffQuickTests(SimpleTestCase):
    def test_quick_run_reports_the_throughput_ratio(self) -> None:
        url = bench_redis_url()
        server = postgres_server_url()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "backoff.json"
            argv = [sys.executable, "manage.py", "bench", "backoff", "--quick", "--redis-url", url, "--json", str(out)]
            if server:
                argv += ["--database-url", server]
            env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            self.assertEqual(done.returncode, 0, done.stdout[-2000:] + done.stderr[-3000:])
            doc = json.loads(out.read_text())
        self.assertEqual(doc["succeeded"], doc["jobs"])
        self.assertEqual(doc["calls_served"], doc["jobs"])
        self.assertGreater(doc["refusals"], 0, "configured at 8 against an upstream taking 3")
        self.assertEqual(doc["known_limit_refusals"], 0, "configured at what the upstream takes")
        self.assertLessEqual(doc["upstream_peak_concurrency"], 3)
        self.assertGreaterEqual(doc["effective_min"], 1.0)
        self.assertLessEqual(doc["effective_max"], doc["configured_limit"])
        for key in ("throughput_ratio", "known_limit_throughput_ratio", "aimd_vs_known"):
            with self.subTest(key=key):
                self.assertGreater(doc[key], 0)
                self.assertIn(key, done.stdout)
        self.assertEqual(redis.Redis.from_url(url).dbsize(), 0, "the bench must leave its Redis database empty")
