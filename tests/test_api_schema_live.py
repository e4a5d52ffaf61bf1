"""Schemathesis's own runner (`st run`) with every check, in every phase (coverage, fuzzing
and the stateful phase that follows the document's links from a submit's `id` to the job's
operations), against the production server (gunicorn + uvicorn) and the OpenAPI document it
publishes: no failure, no error, no warning.

Every check includes "schema-valid request rejected" and "schema-violating request
accepted": the document must say exactly what the server takes (each registered task with
its own arguments, the configured latency classes and resources, each task's bounds). What
no static schema can say is steered in tests/schemathesis_hooks.py (named there: a callback
URL that resolves, a run_at relative to the server's clock, a cursor the server gave); and
strings are generated without NUL and unpaired surrogates, which the server refuses in any
string of a body (docs/security.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.selectors import JobListFilters, job_list
from fairqueue.jobs.submission import JobRequest, job_submit
from tenants.policy import policy_invalidate
from tests.base import RedisTransactionTestCase
from tests.factories import make_tenant
from tests.web import web_server
from tests.workers import ROOT

SEED = 1
MAX_EXAMPLES = 30
RUN_TIMEOUT = 600.0
OPERATIONS = 7
# The server's webhook check lets this network through (the test's callback URLs point here;
# nothing is sent: no worker runs, so no job finishes but by a cancel, whose event waits).
CALLBACK_URL = "http://127.0.0.1:9/fuzz-hook"
# No state kept between runs (nothing written into the checkout): each run stands alone.
CONFIG = """
[cache]
enabled = false

[generation]
allow-x00 = false
codec = "utf-8"
max-examples = {max_examples}
database = "none"

[warnings]
fail-on = true
"""


class LiveSchemaTests(RedisTransactionTestCase):
    serialized_rollback = True  # the migrations' latency classes, which the document lists

    def setUp(self) -> None:
        super().setUp()
        tenant, self.key = make_tenant("fuzz", batch_enabled=True, max_concurrency=2)
        tenant.rotate_webhook_secret()
        tenant.save()
        self.tenant = tenant
        policy_invalidate()
        for _ in range(3):
            job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args={"seconds": 1}))
        page = job_list(tenant=tenant, filters=JobListFilters(), limit=1)
        self.cursor = page["next"]
        self.server = web_server(production=True, processes=1, FAIRQUEUE_WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8")
        self.server.start()
        self.addCleanup(self.server.stop)

    def test_every_check_in_every_phase_finds_nothing(self) -> None:
        with tempfile.TemporaryDirectory() as folder:
            config = Path(folder) / "schemathesis.toml"
            config.write_text(CONFIG.format(max_examples=MAX_EXAMPLES))
            report = Path(folder) / "report.json"
            env = {
                **os.environ,
                "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
                "PYTHONPATH": str(ROOT),
                "FQ_FUZZ_CURSOR": self.cursor,
                "FQ_FUZZ_CALLBACK_URL": CALLBACK_URL,
            }
            run = subprocess.run(
                [
                    str(Path(sys.executable).parent / "st"),
                    "--config-file",
                    str(config),
                    "run",
                    f"{self.server.base_url}/api/v1/openapi.json",
                    "--checks",
                    "all",
                    "--phases",
                    "examples,coverage,fuzzing,stateful",
                    "--header",
                    f"Authorization: Bearer {self.key}",
                    "--seed",
                    str(SEED),
                    "--workers",
                    "1",
                    "--no-color",
                    "--report",
                    "json",
                    "--report-json-path",
                    str(report),
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT,
            )
            output = run.stdout + run.stderr
            self.assertEqual(run.returncode, 0, output[-6000:])
            result = json.loads(report.read_text())
        self.assertEqual((result["exit_code"], result["failures"], result["errors"]), (0, [], []), output[-6000:])
        self.assertEqual(result["operations"]["tested"], OPERATIONS)
        self.assertEqual({k: v for k, v in result["warnings"].items() if v}, {})
        phases = {name: phase["status"] for name, phase in result["phases"].items()}
        self.assertEqual(
            phases, {"examples": "skip", "coverage": "success", "fuzzing": "success", "stateful": "success"}
        )
        self.assertGreater(result["test_cases"]["generated"], OPERATIONS * MAX_EXAMPLES)
        # The stateful phase followed the links from submits to the job's operations: only
        # there is a job id the server made known, and cancelling needs one.
        links = re.search(r"API Links:\s+(\d+) covered / (\d+) selected", output)
        self.assertIsNotNone(links, output[-3000:])
        covered, selected = int(links.group(1)), int(links.group(2))  # type: ignore[union-attr]
        self.assertGreaterEqual(covered * 2, selected, output[-3000:])
        self.assertTrue(Job.objects.filter(tenant=self.tenant, status=JobStatus.CANCELLED).exists())
