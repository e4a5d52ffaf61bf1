"""Your own tasks (docs/tasks.md): the example app's task is discovered in its installed
app, submitted through the REST API and run by a real worker; the demo tasks exist only in
the demo (tests run in demo mode), so a production submit of demo.sleep is refused."""

from __future__ import annotations

import json
import subprocess
import sys

from examples.invoices.models import InvoiceSent
from fairqueue.fairqueue_tasks import BRIDGE_TASKS
from fairqueue.jobs.registry import task_get
from tests.factories import make_tenant
from tests.test_jobs_e2e import E2EBase
from tests.workers import ROOT, WorkerProcess, wait_for, worker_env

INVOICE = {"invoice_number": "INV-2026-0001", "customer_email": "billing@example.com", "amount_cents": 12_500}

# Runs in a fresh process with the environment given: the tasks it registered, and what a
# submit of demo.sleep answers (through the API, over "https" as production requires).
PROBE = """
import json, sys, django
django.setup()
from fairqueue.fairqueue_tasks import BRIDGE_TASKS
from django.test import Client
from fairqueue.jobs.registry import task_names
response = Client().post(
    "/api/v1/jobs", json.dumps({"task": "demo.sleep", "args": {"seconds": 3600}}),
    content_type="application/json", HTTP_AUTHORIZATION="Bearer " + sys.argv[1], secure=True,
)
print(json.dumps({"tasks": task_names(), "status": response.status_code, "body": response.json()}))
"""


class ExampleTaskTests(E2EBase):
    def test_the_example_task_is_discovered_and_runs_once_per_invoice_on_a_real_worker(self) -> None:
        # Registered by discovery (examples/invoices/fairqueue_tasks.py), not by a listed module.
        self.assertIsNotNone(task_get("invoices.send"))
        _, key = make_tenant("billing")
        bad = self.client.post(
            "/api/v1/jobs",
            json.dumps({"task": "invoices.send", "args": {**INVOICE, "invoice_number": "no spaces allowed"}}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {key}",
        )
        self.assertEqual(bad.status_code, 400)
        self.assertEqual(bad.json()["error"]["field"], "args.invoice_number")
        with WorkerProcess(slots=2):
            first = self.submit(key, {"task": "invoices.send", "args": INVOICE})
            done = wait_for(
                lambda: (j := self.get(key, first["id"]))["status"] == "succeeded" and j, message="the invoice job"
            )
            # The same invoice again: the task finds it sent and does not send it twice.
            again = self.submit(key, {"task": "invoices.send", "args": INVOICE})
            repeat = wait_for(
                lambda: (j := self.get(key, again["id"]))["status"] == "succeeded" and j, message="the repeat"
            )
        self.assertEqual(done["result"], {"invoice": "INV-2026-0001", "sent": True, "attempt": 1, "generation": 0})
        self.assertEqual(repeat["result"], {"invoice": "INV-2026-0001", "sent": False, "already_sent_by": first["id"]})
        sent = InvoiceSent.objects.get()
        self.assertEqual((str(sent.job_id), sent.amount_cents), (first["id"], 12_500))

    def probe(self, key: str, **env: str) -> dict[str, object]:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, key],
            cwd=ROOT,
            env=worker_env(DJANGO_SETTINGS_MODULE="fairqueue.settings", SECRET_KEY="x" * 50, **env),
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    def test_production_registers_no_demo_task_unless_asked(self) -> None:
        _, key = make_tenant("prod")
        production = self.probe(key, FAIRQUEUE_DEMO="0", DEBUG="0")
        self.assertEqual(set(production["tasks"]), BRIDGE_TASKS)  # FairQueue's own bridge only
        self.assertEqual(production["status"], 400)
        self.assertEqual(production["body"]["error"]["code"], "unknown_task")  # type: ignore[index]
        asked = self.probe(key, FAIRQUEUE_DEMO="0", DEBUG="0", FAIRQUEUE_DEMO_TASKS="1")
        self.assertIn("demo.sleep", asked["tasks"])  # type: ignore[operator]
        self.assertEqual(asked["status"], 202)
