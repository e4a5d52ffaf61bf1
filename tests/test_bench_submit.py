"""`manage.py bench submit --smoke` on the real stack: the result's shape, with tracing off
and on paired in the same run (figures are for docs/observability.md, not for a test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import redis
from django.test import SimpleTestCase

from fairqueue.bench.submit import PATHS
from tests.test_bench_noisy import bench_redis_url

ROOT = Path(__file__).resolve().parent.parent


class BenchSubmitSmokeTests(SimpleTestCase):
    def test_smoke_run_reports_every_path_with_tracing_off_and_on(self) -> None:
        url = bench_redis_url()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "submit.json"
            argv = [sys.executable, "manage.py", "bench", "submit", "--smoke", "--redis-url", url, "--json", str(out)]
            env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            self.assertEqual(done.returncode, 0, done.stdout[-2000:] + done.stderr[-3000:])
            doc = json.loads(out.read_text())
        self.assertEqual(list(doc["paths"]), list(PATHS))
        tracing = doc["tracing"]
        self.assertEqual(tracing["exporter"], "in_memory")
        for path in PATHS:
            with self.subTest(path=path):
                self.assertGreater(doc["paths"][path]["jobs_per_s"], 0)
                self.assertEqual(doc["paths"][path]["jobs_per_s"], tracing["jobs_per_s"]["off"][path])
                self.assertGreater(tracing["jobs_per_s"]["on"][path], 0)
                self.assertGreater(tracing["ratio_on_vs_off"][path], 0)
                self.assertEqual(len(tracing["round_ratios"][path]), doc["rounds"])
                self.assertGreater(tracing["median_round_ratio"][path], 0)
                self.assertIn(path, done.stdout)
        self.assertIn("on/off", done.stdout)
        self.assertEqual(redis.Redis.from_url(url).dbsize(), 0, "the bench must leave its Redis database empty")
