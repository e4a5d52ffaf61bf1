"""`manage.py bench throughput --quick` on the real stack (the test suite's database engine:
PostgreSQL when DATABASE_URL names one, else SQLite): the result's shape, not its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import redis
from django.db import connection
from django.test import SimpleTestCase

from fairqueue.bench.throughput import RESULT_KEYS
from fairqueue.jobs.groupcommit import MAX_BATCH
from tests.test_bench_noisy import bench_redis_url

ROOT = Path(__file__).resolve().parent.parent


def postgres_server_url() -> str | None:
    """The PostgreSQL server the suite runs on (the bench creates its own database there)."""
    if connection.vendor != "postgresql":
        return None
    db = connection.settings_dict
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/"


class BenchThroughputQuickTests(SimpleTestCase):
    def test_quick_run_writes_every_figure(self) -> None:
        url = bench_redis_url()
        server = postgres_server_url()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "throughput.json"
            argv = [sys.executable, "manage.py", "bench", "throughput", "--quick", "--redis-url", url]
            argv += ["--json", str(out)]
            if server:
                argv += ["--database-url", server]
            env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            self.assertEqual(done.returncode, 0, done.stdout[-2000:] + done.stderr[-3000:])
            doc = json.loads(out.read_text())
        self.assertEqual(list(doc), list(RESULT_KEYS))
        self.assertEqual(doc["database"], "postgresql" if server else "sqlite")
        for key in RESULT_KEYS[:-1]:
            with self.subTest(key=key):
                self.assertIsInstance(doc[key], float)
                self.assertGreater(doc[key], 0)
        self.assertLessEqual(doc["single_http_p50_ms_at_200"], doc["single_http_p99_ms_at_200"])
        # Every no-op job was submitted, admitted and run through the database and Redis: its
        # row read, claim and outcome each at least a share of one group-commit statement.
        self.assertGreaterEqual(doc["db_queries_per_job"], 3 / MAX_BATCH)
        self.assertGreaterEqual(doc["redis_cmds_per_job"], 6)
        for key in RESULT_KEYS:
            self.assertIn(key, done.stdout)
        self.assertEqual(redis.Redis.from_url(url).dbsize(), 0, "the bench must leave its Redis database empty")
