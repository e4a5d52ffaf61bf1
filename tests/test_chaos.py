"""The short chaos run: real workers SIGKILLed and Redis flushed under REST load (issue 8, point 4).

Runs on a private redis-server of its own (or on FAIRQUEUE_CHAOS_REDIS_URL, which must be
an empty database), so two runs of the suite on one machine cannot meet in one database;
it runs its own daphne and workers on a fresh SQLite file under var/chaos/quick/.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path

from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import SimpleTestCase, tag

from tests.redis_server import RedisServer


def chaos_run(test: SimpleTestCase, *args: str) -> tuple[dict, str]:
    """Run `manage.py chaos --quick` with `args`; return its JSON report and the context to
    show when an assertion fails (the report's summary and the run's output)."""
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        path = Path(tmp) / "chaos.json"
        redis_url = os.environ.get("FAIRQUEUE_CHAOS_REDIS_URL") or stack.enter_context(RedisServer()).url
        failed = None
        try:
            call_command("chaos", "--quick", *args, "--json", str(path), "--redis-url", redis_url, stdout=out)
        except CommandError as exc:
            failed = exc
        test.assertTrue(path.exists(), f"no report written ({failed}); output:\n{out.getvalue()}")
        report = json.loads(path.read_text())
    summary = {k: v for k, v in report.items() if k != "details"}
    context = f"{summary}\n{out.getvalue()}"
    test.assertIsNone(failed, context)
    test.assertTrue(report["ok"], context)
    test.assertGreater(report["accepted"], 0, context)
    test.assertEqual(report["accepted"], report["succeeded"], context)
    return report, context


@tag("slow", "chaos")
class ChaosQuickTests(SimpleTestCase):
    def test_quick_chaos_run_loses_nothing_and_runs_everything_once(self) -> None:
        report, context = chaos_run(self)
        self.assertEqual(report["lost"], 0, context)
        self.assertEqual(report["duplicated"], 0, context)
        self.assertEqual(report["over_limit_events"], 0, context)
        self.assertEqual(report["leaked_holds"], 0, context)
        self.assertGreaterEqual(report["workers_killed"], 1, context)
        self.assertEqual(report["redis_restarts"], 1, context)
        for key in ("failed", "missing_side_effects", "duration_s"):
            self.assertIn(key, report)
        # The limits really bit (the check is not vacuous): capped tenants reached their max.
        scopes = report["details"]["concurrency"]["scopes"]
        self.assertEqual(scopes["tenant:tiny"]["peak"], 1, context)


@tag("slow", "chaos")
class ChaosRestartsQuickTests(SimpleTestCase):
    """`chaos --restart database,broker,channels`: the database (a private PostgreSQL), the
    broker and the channel layer (Redis servers of their own) each restarted under load, on
    top of the worker kills and the Redis flush (issue 40)."""

    def test_restarts_under_load_fail_lose_and_strand_nothing(self) -> None:
        report, context = chaos_run(self, "--restart", "database,broker,channels")
        for count in ("failed_by_infrastructure", "lost", "stuck", "duplicated", "over_limit_events", "leaked_holds"):
            self.assertEqual(report[count], 0, f"{count}: {context}")
        self.assertEqual(report["dependency_restarts"], 3, context)
        restarts = {r["dependency"]: r for r in report["restarts"]}
        self.assertEqual(set(restarts), {"database", "broker", "channels"}, context)
        self.assertIsNotNone(restarts["channels"]["dashboard_resumed_s"], context)
        # The outage was felt: submits during the database's answered 503, not 500.
        http = report["details"]["http"]
        self.assertGreater(http.get("http_503", 0), 0, context)
        self.assertEqual(http.get("http_500", 0), 0, context)


@tag("slow", "chaos", "distributed", "cluster")
class ChaosClusterQuickTests(SimpleTestCase):
    """The chaos run with the engine on a Redis Cluster it starts: worker SIGKILLs, a
    failover that loses acknowledged writes (the replica is cut off before the primary's
    SIGKILL) and a primary's data loss. FAIRQUEUE_CHAOS_CLUSTER_PORTS (e.g. 7111-7116) fixes
    the nodes' ports; free ones otherwise."""

    def test_quick_cluster_chaos_run_loses_nothing_runs_everything_once_and_reports_the_failover(self) -> None:
        args = ["--cluster"]
        if os.environ.get("FAIRQUEUE_CHAOS_CLUSTER_PORTS"):
            args += ["--cluster-ports", os.environ["FAIRQUEUE_CHAOS_CLUSTER_PORTS"]]
        report, context = chaos_run(self, *args)
        for zero in ("lost", "duplicated", "missing_side_effects", "leaked_holds"):
            self.assertEqual(report[zero], 0, f"{zero}: {context}")
        self.assertEqual((report["failovers"], report["primary_data_losses"]), (1, 1), context)
        cluster = report["cluster"]
        self.assertEqual(cluster["over_limit_events_elsewhere"], 0, context)
        # Reported, whatever they are: the over-limit events inside the failover window and
        # what the promoted replica had lost.
        self.assertEqual(
            cluster["over_limit_events_in_failover_window"] + cluster["over_limit_events_elsewhere"],
            report["over_limit_events"],
        )
        self.assertEqual(set(cluster["writes_lost"]), {"admissions", "parks", "releases"})
        failover = cluster["failover"]
        self.assertGreater(failover["promotion_s"], 0, context)
        self.assertIsNotNone(failover["trusted_again_s"], f"the tag was never rebuilt after the failover: {context}")
        self.assertGreaterEqual(failover["trusted_again_s"], failover["promotion_s"], context)
        self.assertGreaterEqual(cluster["foreign_rebuilds"], 1, context)
        self.assertIsNotNone(cluster["data_loss"]["rebuilt_s"], context)
        self.assertEqual(report["details"]["concurrency"]["scopes"]["tenant:tiny"]["peak"], 1, context)
