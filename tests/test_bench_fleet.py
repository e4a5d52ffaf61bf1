"""`manage.py bench fleet --quick`: the JSON has the issue's shape, the cases run in the
issue's order, and the figures are sane (measured, positive where work was done)."""

from __future__ import annotations

import json
import tempfile
from io import StringIO
from pathlib import Path

from django.core.management import call_command

from fairqueue.bench.fleet_bench import CASES
from tests.base import RedisTransactionTestCase

CASE_KEYS = {
    "workers",
    "tenants",
    "waiting",
    "duty_wall_s_per_tick",
    "duty_redis_cmds_per_s",
    "duty_db_queries_per_s",
    "snapshot_ms",
    "scrape_ms",
    "admit_us",
    "frame_first_bytes",
    "frame_update_bytes_max",
    "frame_update_bytes_median",
}


class FleetBenchTests(RedisTransactionTestCase):
    serialized_rollback = True  # the seeded latency classes outlive the bench's reset

    def test_quick_run_writes_the_issue_shape(self) -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "fleet.json"
            # --force: the test Redis database is the suite's own, flushed around every test.
            call_command("bench", "fleet", "--quick", "--force", "--json", str(path), stdout=StringIO())
            result = json.loads(path.read_text())
        self.assertIn(result["database"], ("sqlite", "postgresql"))
        cases = result["cases"]
        self.assertEqual([(c["workers"], c["tenants"], c["waiting"]) for c in cases], CASES["quick"])
        for case in cases:
            self.assertTrue(set(case) >= CASE_KEYS, case)
            self.assertGreater(case["ticks"], 0, "a worker held the lease and ran the duties")
            self.assertGreater(case["duty_wall_s_per_tick"], 0)
            self.assertGreater(case["duty_redis_cmds_per_s"], 0)
            self.assertGreater(case["duty_db_queries_per_s"], 0)
            for key in ("snapshot_ms", "scrape_ms", "admit_us"):
                self.assertGreater(case[key], 0, key)
            # The first frame is the whole (bounded) picture; a tick's frame says what changed.
            self.assertGreater(case["frame_first_bytes"], case["frame_update_bytes_max"])
            self.assertGreater(case["frame_update_bytes_median"], 0)
        # The bench leaves nothing behind it in Redis but its own counters.
        self.assertEqual(self.redis.dbsize(), 0)
