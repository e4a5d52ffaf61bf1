"""The OpenAPI document's submit bodies (fairqueue.jobs.api_schema): a union discriminated by
`task` with one member per registered task and that task's own `args` schema, for single
and bulk submits; each task's bounds and the configured names; links from a submit's `id`
to the operations that take it; the demo's tasks only in the demo."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from django.test import Client

from fairqueue.fairqueue_tasks import BRIDGE_TASKS
from fairqueue.jobs.api import CANCEL_JOB, GET_JOB, GET_JOB_WEBHOOKS, LIST_JOBS
from fairqueue.jobs.api_schema import SUBMISSION, member_name
from fairqueue.jobs.registry import is_continuation, task_get, task_names
from tenants.models import LatencyClass, Resource
from tests.base import RedisTestCase
from tests.workers import ROOT, worker_env

REF = "#/components/schemas/"


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].removeprefix(REF)]
    return node


class SubmitBodyTests(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.schema = json.loads(Client().get("/api/v1/openapi.json").content)
        self.components = self.schema["components"]["schemas"]

    def test_one_member_per_registered_task_with_its_own_args_schema(self) -> None:
        union = self.components[SUBMISSION]
        mapping = union["discriminator"]["mapping"]
        self.assertEqual(union["discriminator"]["propertyName"], "task")
        # A continuation (a fan-out's join) is no task a customer submits.
        submittable = [n for n in task_names() if not is_continuation(task_get(n))]  # type: ignore[arg-type]
        self.assertEqual(sorted(mapping), submittable)
        self.assertNotIn("demo.document_join", mapping)
        self.assertEqual(sorted(r["$ref"] for r in union["oneOf"]), sorted(mapping.values()))
        self.assertIn("demo.sleep", mapping)
        self.assertIn("invoices.send", mapping)
        for name, ref in mapping.items():
            with self.subTest(task=name):
                task = task_get(name)
                assert task is not None
                member = resolve(self.schema, {"$ref": ref})
                self.assertEqual(member["properties"]["task"]["const"], name)
                self.assertFalse(member["additionalProperties"])
                args = resolve(self.schema, member["properties"]["args"])
                own = task.args_model.model_json_schema()
                self.assertEqual(set(args.get("properties", {})), set(own.get("properties", {})))
                self.assertEqual(args.get("required", []), own.get("required", []))
                self.assertEqual("args" in member["required"], bool(own.get("required")))
                max_attempts = member["properties"]["max_attempts"]["anyOf"][0]
                self.assertEqual(max_attempts["maximum"], task.retry.max_attempts)
                timeout = member["properties"]["timeout_seconds"]["anyOf"][0]
                self.assertEqual(timeout.get("maximum"), task.timeout_seconds)
        # What a task's arguments may be, as its model says: demo.sleep's seconds are 0-3600.
        sleep = resolve(self.schema, resolve(self.schema, {"$ref": mapping["demo.sleep"]})["properties"]["args"])
        self.assertEqual(
            (sleep["properties"]["seconds"]["minimum"], sleep["properties"]["seconds"]["maximum"]), (0, 3600)
        )
        self.assertEqual(member_name("demo.sleep", set()), "DemoSleepJob")
        self.assertEqual(member_name("demo.sleep", {"DemoSleepJob"}), "DemoSleepJob2")

    def test_single_and_bulk_submits_take_the_union(self) -> None:
        single = self.schema["paths"]["/api/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]
        self.assertEqual(single["schema"], {"$ref": REF + SUBMISSION})
        bulk = self.schema["paths"]["/api/v1/jobs/bulk"]["post"]["requestBody"]["content"]["application/json"]
        jobs = resolve(self.schema, bulk["schema"])["properties"]["jobs"]
        self.assertEqual(jobs["items"], {"$ref": REF + SUBMISSION})
        self.assertNotIn("JobIn", self.components)
        self.assertNotIn('"#/components/schemas/JobIn"', json.dumps(self.schema))

    def test_priorities_and_resources_are_the_configured_names(self) -> None:
        member = resolve(self.schema, {"$ref": self.components[SUBMISSION]["oneOf"][0]["$ref"]})
        priority = member["properties"]["priority"]["anyOf"][0]
        classes = list(LatencyClass.objects.order_by("-rank", "name").values_list("name", flat=True))
        self.assertEqual(priority["enum"], ["", *classes])
        self.assertEqual(member["properties"]["resources"]["maxItems"], 0, "none configured: none may be named")
        Resource.objects.create(name="smtp", limit=3)
        again = json.loads(Client().get("/api/v1/openapi.json").content)
        member = resolve(again, {"$ref": again["components"]["schemas"][SUBMISSION]["oneOf"][0]["$ref"]})
        self.assertEqual(member["properties"]["resources"]["items"]["enum"], ["smtp"])

    def test_links_from_a_submits_id_to_the_operations_that_take_it(self) -> None:
        ids = {op["operationId"] for item in self.schema["paths"].values() for op in item.values()}
        for path, status, pointer in (
            ("/api/v1/jobs", "202", "$response.body#/id"),
            ("/api/v1/jobs", "200", "$response.body#/id"),
            ("/api/v1/jobs/bulk", "202", "$response.body#/0/id"),
        ):
            with self.subTest(path=path, status=status):
                links = self.schema["paths"][path]["post"]["responses"][status]["links"]
                self.assertEqual(
                    {link["operationId"] for link in links.values()},
                    {GET_JOB, CANCEL_JOB, GET_JOB_WEBHOOKS, LIST_JOBS},
                )
                for link in links.values():
                    self.assertIn(link["operationId"], ids)
                    # The list takes the id as the parent whose children it lists (fan-out).
                    param = "parent_id" if link["operationId"] == LIST_JOBS else "job_id"
                    self.assertEqual(link["parameters"], {param: pointer})

    def test_outside_the_demo_the_document_has_no_demo_task(self) -> None:
        probe = (
            "import django, json; django.setup()\n"
            "from fairqueue.jobs.api import api\n"
            "schemas = api.get_openapi_schema()['components']['schemas']\n"
            "union = schemas.get('JobSubmission')\n"
            "print(json.dumps(sorted(union['discriminator']['mapping']) if union else None))\n"
        )
        env = worker_env(
            FAIRQUEUE_DEMO="0",
            FAIRQUEUE_DEMO_TASKS="0",
            SECRET_KEY="x" * 60,
            DJANGO_SETTINGS_MODULE="fairqueue.settings",
            FAIRQUEUE_TASK_MODULES="tests.lifecycle_tasks",
        )
        out = subprocess.run(
            [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=120
        )
        listed = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertTrue(listed, "the listed module's tasks")
        # FairQueue's own bridge (django.task: a Django Tasks @task of FairQueue's backend) is always there.
        self.assertTrue(all(name.startswith("test.") for name in set(listed) - BRIDGE_TASKS), listed)
        # And in this (demo) process, the demo's.
        self.assertIn("DemoSleepJob", self.components)
