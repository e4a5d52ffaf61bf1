"""The short chaos run: real workers SIGKILLed and Redis flushed under REST load (issue 8, point 4).

Needs its own empty Redis database (FAIRQUEUE_CHAOS_REDIS_URL, default db 6); it runs
its own daphne and workers on a fresh SQLite file under var/chaos/quick/.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import SimpleTestCase, tag

from fairqueue.chaos import DEFAULT_REDIS_URL


@tag("slow", "chaos")
class ChaosQuickTests(SimpleTestCase):
    def test_quick_chaos_run_loses_nothing_and_runs_everything_once(self) -> None:
        out = io.StringIO()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "chaos.json"
            redis_url = os.environ.get("FAIRQUEUE_CHAOS_REDIS_URL", DEFAULT_REDIS_URL)
            failed = None
            try:
                call_command("chaos", "--quick", "--json", str(path), "--redis-url", redis_url, stdout=out)
            except CommandError as exc:
                failed = exc
            self.assertTrue(path.exists(), f"no report written ({failed}); output:\n{out.getvalue()}")
            report = json.loads(path.read_text())
        summary = {k: v for k, v in report.items() if k != "details"}
        context = f"{summary}\n{out.getvalue()}"
        self.assertIsNone(failed, context)
        self.assertTrue(report["ok"], context)
        self.assertGreater(report["accepted"], 0, context)
        self.assertEqual(report["accepted"], report["succeeded"], context)
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
