"""`manage.py bench job-list --quick`: the JSON has its shape, every case ran against the
seeded tenant (pages that list jobs where the seed has them), and the walk by cursor listed
each job once."""

from __future__ import annotations

import json
import tempfile
from io import StringIO
from pathlib import Path

from django.core.management import call_command
from django.db import connection

from fairqueue.bench.joblist_bench import FILTER_INDEXES, SIZES, TARGET_MS, TENANT
from fairqueue.jobs.models import Job
from tests.base import RedisTransactionTestCase

CASE_KEYS = {"name", "params", "p50_ms", "p99_ms", "max_ms", "items", "has_more", "statements", "met", "in_target"}


class JobListBenchTests(RedisTransactionTestCase):
    serialized_rollback = True  # the seeded latency classes outlive the bench's rows

    def test_quick_run_writes_every_case(self) -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "job-list.json"
            # --force: the test Redis database is the suite's own, flushed around every test.
            call_command("bench", "job-list", "--quick", "--force", "--json", str(path), stdout=StringIO())
            result = json.loads(path.read_text())
        quick = SIZES["quick"]
        self.assertEqual((result["rows"], result["other_rows"]), (quick["rows"], quick["other_rows"]))
        self.assertEqual(result["database"], connection.vendor)
        self.assertEqual(result["target_ms"], TARGET_MS)
        walk = result["walk"]
        self.assertEqual(walk["pages"], quick["walk_pages"] - 1)
        self.assertEqual(walk["jobs_listed"], walk["pages"] * result["limit"])
        self.assertTrue(walk["each_once"])
        cases = {c["name"]: c for c in result["cases"]}
        for name in (
            "first page",
            f"page {quick['walk_pages']} by cursor",
            "status=parked",
            "status=parked, deep page by cursor",
            "task=invoices.send",
            "sub_tenant=cust-big",
            "time range (1 % of the rows)",
            "status=failed&task=reports.build",
            "total=true (past its cap)",
            "offset=10,000 (deprecated; its cap)",
        ):
            self.assertIn(name, cases)
        for case in result["cases"]:
            with self.subTest(case=case["name"]):
                self.assertTrue(set(case) >= CASE_KEYS, case)
                self.assertGreater(case["p99_ms"], 0)
                self.assertGreaterEqual(case["max_ms"], case["p99_ms"])
                self.assertGreaterEqual(case["statements"], 1)
                if connection.vendor == "postgresql":
                    # Which indexes: at this size the planner may rightly scan instead
                    # (explain_queries checks the plans, tests/test_query_plans.py).
                    self.assertIn("indexes", case)
                    self.assertGreater(case["db_ms"], 0)
        # The target: the first page, page 1,000 and each filter alone; the rest beside it
        # (a deep page only where the quick seed has rows for one).
        beside = {c["name"] for c in result["cases"] if not c["in_target"]}
        combined = ("status=failed&task=reports.build", "status=parked&sub_tenant=cust-7")
        self.assertLessEqual(
            {
                "total=true (past its cap)",
                "status=running&total=true",
                "offset=10,000 (deprecated; its cap)",
                *combined,
            },
            beside,
        )
        self.assertTrue(all(name.startswith(combined) or "total" in name or "offset" in name for name in beside))
        for name in ("first page", "status=parked", "task=invoices.send", "sub_tenant=cust-big"):
            self.assertEqual(cases[name]["items"], result["limit"], name)
            self.assertTrue(cases[name]["has_more"], name)
        write = result["write_cost"]
        self.assertEqual((write["rows"], write["rounds"]), (quick["write_rows"], quick["write_rounds"]))
        for key in ("insert_ms_per_1000", "insert_ms_per_1000_without", "updates_ms_per_1000", "insert_ratio"):
            self.assertGreater(write[key], 0, key)
        # Past the quick seed's 3,000 rows: an empty page, as the API answers it.
        self.assertEqual(cases["offset=10,000 (deprecated; its cap)"]["items"], 0)
        # The bench leaves its rows to the next run (--reuse), not the write rounds' (rolled
        # back, the indexes they dropped with them), and nothing in Redis.
        self.assertEqual(Job.objects.filter(tenant__slug=TENANT).count(), quick["rows"])
        with connection.cursor() as cursor:
            found = connection.introspection.get_constraints(cursor, Job._meta.db_table)
        self.assertLessEqual(set(FILTER_INDEXES), set(found))
        self.assertEqual(self.redis.dbsize(), 0)
