"""Schemathesis against the API's own OpenAPI schema: no 5xx, every response as documented.

Runs in-process on the WSGI application with a valid tenant key and a bounded,
derandomized number of examples per operation (positive and negative), so the run is
reproducible and takes seconds. Generated cases are steered part of the time towards
inputs the schema cannot express (ids of jobs that exist, including another tenant's) and
towards the plainest jobs, so the fuzzing reaches past the first 400/404. (The schema lists
the registered tasks and their arguments: tests/test_api_schema_live.py runs every check.)
"""

from __future__ import annotations

import json
import time
from typing import Any

import schemathesis
from django.conf import settings
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from django.test import Client, override_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from fairqueue.jobs.api import api
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.submission import JobRequest, job_submit
from fairqueue.wsgi import application
from tenants.policy import policy_invalidate
from tests.base import RedisTestCase
from tests.factories import make_tenant

SCHEMA_PATH = "/api/v1/openapi.json"
MAX_EXAMPLES = 30
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance, content_type_conformance]
EXPECTED_OPERATIONS = {
    "POST /api/v1/jobs",
    "POST /api/v1/jobs/bulk",
    "GET /api/v1/jobs",
    "GET /api/v1/jobs/{job_id}",
    "POST /api/v1/jobs/{job_id}/cancel",
    "GET /api/v1/jobs/{job_id}/webhooks",
    "GET /api/v1/limits",
}


def _steer_job(item: Any, steer: int) -> None:
    """Make a generated job body plausible: a registered task with valid arguments."""
    if not isinstance(item, dict) or steer == 0:
        return
    echo = item.get("args")
    item["task"] = "demo.sleep" if steer != 2 else "demo.parse"
    item["args"] = {"seconds": 0.01, "echo": echo} if steer != 2 else {"pages": 1}
    if steer == 3:
        item.pop("priority", None)  # the tenant's default class; otherwise a generated (unknown) name
        item.pop("callback_url", None)  # a generated one is almost never a public URL (400)


class ApiFuzzTests(RedisTestCase):
    """Every operation of the published schema against the documented responses."""

    def setUp(self) -> None:
        super().setUp()
        # The WSGI handler closes "old" connections around each request, which would end
        # this test's transaction; Django's own test client disconnects it the same way.
        request_started.disconnect(close_old_connections)
        request_finished.disconnect(close_old_connections)
        self.addCleanup(request_started.connect, close_old_connections)
        self.addCleanup(request_finished.connect, close_old_connections)
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, self.key = make_tenant("fuzz", max_concurrency=1, batch_enabled=True)
            self.other, _ = make_tenant("other")
        policy_invalidate()
        sleep = JobRequest(task="demo.sleep", args={"seconds": 1})
        mine = [job_submit(tenant=self.tenant, req=sleep).job for _ in range(4)]  # 1 queued, 3 parked
        Job.objects.filter(id=mine[-1].id).update(status=JobStatus.SUCCEEDED, result={"ok": True})
        self.theirs = job_submit(tenant=self.other, req=sleep).job
        self.job_ids = [str(j.id) for j in mine] + [str(self.theirs.id)]
        self.schema = schemathesis.openapi.from_wsgi(SCHEMA_PATH, application)

    def operations(self) -> list[Any]:
        ops = [result.ok() for result in self.schema.get_all_operations() if isinstance(result, Ok)]
        self.assertEqual({op.label for op in ops}, EXPECTED_OPERATIONS)
        return ops

    def run_operation(self, operation: Any, mode: GenerationMode) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        other_id = str(self.theirs.id)

        @given(
            case=operation.as_strategy(generation_mode=mode),
            steer=st.integers(0, 3),
            job_id=st.sampled_from(self.job_ids),
        )
        @hypothesis_settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any, steer: int, job_id: str) -> None:
            if mode == GenerationMode.POSITIVE:
                if case.path_parameters and "job_id" in case.path_parameters and steer:
                    case.path_parameters["job_id"] = job_id
                if operation.label == "POST /api/v1/jobs":
                    _steer_job(case.body, steer)
                elif operation.label == "POST /api/v1/jobs/bulk" and isinstance(case.body, dict):
                    for item in case.body.get("jobs") or []:
                        _steer_job(item, steer)
            response = case.call_and_validate(headers=headers, checks=CHECKS)
            if (case.path_parameters or {}).get("job_id") == other_id and response.status_code != 401:
                # Another tenant's job does not exist for this key, whatever the operation.
                self.assertEqual(response.status_code, 404, response.text)

        check()
        # Another tenant's job is never touched by this tenant's requests.
        self.assertEqual(Job.objects.get(id=self.theirs.id).status, self.theirs.status)

    def test_every_operation_with_valid_inputs(self) -> None:
        for operation in self.operations():
            with self.subTest(operation=operation.label):
                self.run_operation(operation, GenerationMode.POSITIVE)

    def test_every_operation_with_invalid_inputs(self) -> None:
        for operation in self.operations():
            with self.subTest(operation=operation.label):
                self.run_operation(operation, GenerationMode.NEGATIVE)


# --- input hardening ---------------------------------------------------------------------------------

JOBS = "/api/v1/jobs"
BULK = "/api/v1/jobs/bulk"
FAST = 1.0  # seconds: refusals must not cost the server real work


def sleep_job(**extra: Any) -> dict[str, Any]:
    return {"task": "demo.sleep", "args": {"seconds": 1}, **extra}


class InputHardeningTests(RedisTestCase):
    """Hostile input is refused with a documented 4xx, quickly, and writes nothing."""

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.documented = {
            (method.upper(), path.removeprefix("/api/v1")): {int(code) for code in op["responses"]}
            for path, item in api.get_openapi_schema()["paths"].items()
            for method, op in item.items()
        }

    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        self.http = Client(raise_request_exception=False)
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, self.key = make_tenant("acme", batch_enabled=True)
        policy_invalidate()
        self.job = job_submit(tenant=self.tenant, req=JobRequest(task="demo.sleep", args={"seconds": 1})).job
        self.jobs_before = Job.objects.count()

    def refused(
        self,
        method: str,
        path: str,
        template: str,
        status: int,
        code: str | None = None,
        *,
        body: bytes | str | None = None,
        content_type: str = "application/json",
        params: dict[str, Any] | None = None,
        **headers: str,
    ) -> dict[str, Any]:
        """Send one request; assert its status, speed, documentation and that nothing was written."""
        headers.setdefault("HTTP_AUTHORIZATION", f"Bearer {self.key}")
        started = time.monotonic()
        if method == "GET":
            response = self.http.get(path, params or {}, **headers)  # type: ignore[arg-type]
        else:
            response = self.http.post(path, body or b"", content_type=content_type, **headers)  # type: ignore[arg-type]
        elapsed = time.monotonic() - started
        self.assertLess(response.status_code, 500, response.content[:300])
        self.assertEqual(response.status_code, status, response.content[:300])
        self.assertLess(elapsed, FAST, f"{method} {path} took {elapsed:.2f}s to refuse")
        self.assertIn(status, self.documented[(method, template)], f"{status} is not in the OpenAPI responses")
        payload: dict[str, Any] = response.json()
        if code is not None:
            self.assertEqual(payload["error"]["code"], code, payload)
        self.assertEqual(Job.objects.count(), self.jobs_before, "a refused request wrote a job")
        return payload

    def post_json(self, path: str, value: Any, status: int, code: str | None = None) -> dict[str, Any]:
        return self.refused("POST", path, path.removeprefix("/api/v1"), status, code, body=json.dumps(value))

    # --- size -------------------------------------------------------------------------------------

    def test_bodies_over_the_cap_are_413_before_they_are_parsed(self) -> None:
        cap = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        self.assertEqual(cap, settings.FAIRQUEUE["MAX_REQUEST_BYTES"])
        self.assertEqual(cap, 16 * 1024 * 1024)
        body = json.dumps(sleep_job(args={"seconds": 1, "echo": "x" * cap}))
        for path in (JOBS, BULK):
            with self.subTest(path=path):
                self.refused("POST", path, path.removeprefix("/api/v1"), 413, "payload_too_large", body=body)

    def test_a_body_just_under_the_cap_is_parsed(self) -> None:
        with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=2000):
            fits = json.dumps(sleep_job(args={"seconds": 1, "echo": "x" * 1800}))
            self.assertLessEqual(len(fits), 2000)
            response = self.http.post(
                JOBS, fits, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {self.key}"
            )
            self.assertEqual(response.status_code, 202, response.content)
            self.jobs_before += 1
            self.post_json(JOBS, sleep_job(args={"seconds": 1, "echo": "x" * 2000}), 413, "payload_too_large")

    def test_bulk_over_1000_jobs(self) -> None:
        self.post_json(BULK, {"jobs": [sleep_job() for _ in range(1001)]}, 400, "invalid_request")

    # --- structure ------------------------------------------------------------------------------------

    def test_deeply_nested_json(self) -> None:
        for depth in (33, 1_000, 100_000):
            raw = '{"task": "demo.sleep", "args": {"seconds": 1, "echo": ' + "[" * depth + "]" * depth + "}}"
            with self.subTest(depth=depth):
                self.refused("POST", JOBS, "/jobs", 400, "invalid_json", body=raw)
                bulk = '{"jobs": [' + raw + "]}"
                self.refused("POST", BULK, "/jobs/bulk", 400, "invalid_json", body=bulk)
        objects = '{"task": "demo.sleep", "args": {"seconds": 1, "echo": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}}"
        self.refused("POST", JOBS, "/jobs", 400, "invalid_json", body=objects)

    def test_nesting_up_to_the_limit_is_accepted(self) -> None:
        # body (1) > args (2) > echo (3) ... : 29 more lists reach exactly 32 levels.
        raw = '{"task": "demo.sleep", "args": {"seconds": 1, "echo": ' + "[" * 30 + "]" * 30 + "}}"
        response = self.http.post(JOBS, raw, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {self.key}")
        self.assertEqual(response.status_code, 202, response.content)

    def test_values_no_database_column_can_store(self) -> None:
        for raw in (
            '{"task": "demo.sleep", "args": {"seconds": 1, "echo": 1e999}}',
            '{"task": "demo.sleep", "args": {"seconds": 1, "echo": -1e999}}',
            '{"task": "demo.sleep", "args": {"seconds": 1e999}}',
            '{"task": "demo.sleep", "args": {"seconds": 1, "echo": NaN}}',
            '{"task": "demo.sleep", "args": {"seconds": Infinity}}',
            '{"task": "demo.sleep", "args": {"seconds": 1, "echo": "a\\u0000b"}}',
            '{"task": "demo.sleep", "args": {"seconds": 1, "echo": {"k\\u0000": 1}}}',
            '{"task": "demo.sleep", "args": {"seconds": 1, "echo": "\\ud800"}}',
            '{"task": "demo.sleep", "args": {"seconds": 1}, "idempotency_key": "k\\u0000"}',
            '{"task": "demo.sleep", "args": {"seconds": 1}, "sub_tenant": "\\udfff"}',
            '{"task": "demo.sleep", "args": {"seconds": 1, "echo": ' + "9" * 5000 + "}}",
        ):
            with self.subTest(raw=raw[:80]):
                self.refused("POST", JOBS, "/jobs", 400, "invalid_json", body=raw)
                self.refused("POST", BULK, "/jobs/bulk", 400, "invalid_json", body='{"jobs": [' + raw + "]}")

    def test_wrong_content_types(self) -> None:
        body = json.dumps(sleep_job())
        for content_type in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=xyz",
            "application/xml",
            "application/json-patch+json",
            "text/json",
        ):
            for path in (JOBS, BULK):
                with self.subTest(content_type=content_type, path=path):
                    self.refused(
                        "POST",
                        path,
                        path.removeprefix("/api/v1"),
                        415,
                        "unsupported_media_type",
                        body=body,
                        content_type=content_type,
                    )
        # The charset parameter is fine.
        response = self.http.post(
            JOBS, body, content_type="application/json; charset=utf-8", HTTP_AUTHORIZATION=f"Bearer {self.key}"
        )
        self.assertEqual(response.status_code, 202, response.content)

    # --- field sizes ------------------------------------------------------------------------------------

    def test_huge_idempotency_keys(self) -> None:
        for size in (201, 10_000, 1_000_000):
            with self.subTest(size=size):
                payload = self.post_json(JOBS, sleep_job(idempotency_key="k" * size), 400)
                self.assertEqual(payload["error"]["field"], "idempotency_key")
                payload = self.post_json(BULK, {"jobs": [sleep_job(idempotency_key="k" * size)]}, 400)
                self.assertEqual(payload["error"]["field"], "jobs[0].idempotency_key")
        self.post_json(JOBS, sleep_job(idempotency_key=""), 400)

    def test_huge_task_names_sub_tenants_and_priorities(self) -> None:
        for field, limit in (("task", 100), ("sub_tenant", 200), ("priority", 32)):
            for size in (limit + 1, 1_000_000):
                with self.subTest(field=field, size=size):
                    payload = self.post_json(JOBS, {**sleep_job(), field: "a" * size}, 400, "invalid_request")
                    self.assertEqual(payload["error"]["field"], field)
                    self.assertLess(len(payload["error"]["message"]), 500, "the error does not echo the input")
        # Within length but not storable as a sub-tenant id.
        self.post_json(JOBS, sleep_job(sub_tenant="has space"), 400, "invalid_sub_tenant")
        self.post_json(JOBS, sleep_job(sub_tenant="ünïcode"), 400, "invalid_sub_tenant")

    def test_huge_headers_and_paths(self) -> None:
        self.refused("GET", JOBS, "/jobs", 401, "unauthorized", HTTP_AUTHORIZATION="Bearer " + "k" * 100_000)
        for job_id in ("x" * 100_000, "%00", str(self.job.id).upper() + "0"):
            with self.subTest(job_id=job_id[:20]):
                self.refused("GET", f"{JOBS}/{job_id}", "/jobs/{job_id}", 404, "not_found")
                self.refused("POST", f"{JOBS}/{job_id}/cancel", "/jobs/{job_id}/cancel", 404, "not_found")

    # --- query parameters -------------------------------------------------------------------------------

    def test_query_parameters_out_of_range(self) -> None:
        for params, field in (
            ({"limit": 0}, "limit"),
            ({"limit": 501}, "limit"),
            ({"limit": -1}, "limit"),
            ({"limit": "9" * 5000}, "limit"),
            ({"limit": "1e3"}, "limit"),
            ({"limit": "NaN"}, "limit"),
            ({"limit": "inf"}, "limit"),
            ({"offset": -1}, "offset"),
            ({"offset": 10_001}, "offset"),
            ({"offset": "9" * 40}, "offset"),
            ({"offset": "\x00"}, "offset"),
            ({"status": "done"}, "status"),
            ({"status": "x" * 100_000}, "status"),
        ):
            with self.subTest(params={k: str(v)[:20] for k, v in params.items()}):
                payload = self.refused("GET", JOBS, "/jobs", 400, "invalid_request", params=params)
                self.assertEqual(payload["error"]["field"], field)
                self.assertLess(len(payload["error"]["message"]), 500, "the error does not echo the input")
        # The edges are accepted.
        ok = self.http.get(JOBS, {"limit": 500, "offset": 10_000}, HTTP_AUTHORIZATION=f"Bearer {self.key}")
        self.assertEqual(ok.status_code, 200, ok.content)
