"""The customer REST API (/api/v1/): submit, bulk, read, list, cancel, and every error path.

No workers run here: admitted jobs' Celery messages sit unconsumed in the test Redis.
Every response is checked never to be a 500.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.test import Client, override_settings

from fairqueue.jobs.admission import tenant_key
from fairqueue.jobs.models import Job, JobStatus
from tenants.policy import policy_invalidate
from tests.base import RedisTestCase
from tests.factories import make_tenant

JOBS = "/api/v1/jobs"
BULK = "/api/v1/jobs/bulk"
JOB_KEYS = {"id", "status", "task", "priority", "batch", "sub_tenant", "submitted_at", "started_at", "finished_at"}
JOB_KEYS |= {"result", "error"}


def sleep_job(**extra: Any) -> dict[str, Any]:
    return {"task": "demo.sleep", "args": {"seconds": 0.1}, **extra}


class ApiTestCase(RedisTestCase):
    """A tenant `acme` with a key, and request helpers that refuse any 500."""

    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        self.client = Client(raise_request_exception=False)
        self.tenant, self.key = self.tenant_with("acme")

    def tenant_with(self, slug: str, **kwargs: Any) -> tuple[Any, str]:
        with self.captureOnCommitCallbacks(execute=True):
            tenant, key = make_tenant(slug, **kwargs)
        policy_invalidate()
        return tenant, key

    # --- requests ---------------------------------------------------------------------------

    def _auth(self, key: str | None) -> dict[str, str]:
        return {} if key is None else {"HTTP_AUTHORIZATION": f"Bearer {key}"}

    def _check(self, response: Any) -> Any:
        self.assertNotEqual(response.status_code, 500, f"500 from {response.request}: {response.content[:500]!r}")
        self.assertLess(response.status_code, 500, response.content[:500])
        return response

    def post(
        self, path: str, body: Any = None, *, key: str | bool | None = True, raw: str | bytes | None = None
    ) -> Any:
        auth_key = self.key if key is True else (None if key is False else key)
        data: str | bytes = raw if raw is not None else json.dumps(body if body is not None else {})
        return self._check(
            self.client.post(path, data=data, content_type="application/json", **self._auth(auth_key))  # type: ignore[arg-type]
        )

    def get(self, path: str, params: dict[str, Any] | None = None, *, key: str | bool | None = True) -> Any:
        auth_key = self.key if key is True else (None if key is False else key)
        return self._check(self.client.get(path, data=params or {}, **self._auth(auth_key)))  # type: ignore[arg-type]

    def submit(self, body: dict[str, Any] | None = None, *, key: str | None = None) -> dict[str, Any]:
        response = self.post(JOBS, body or sleep_job(), key=key or self.key)
        self.assertEqual(response.status_code, 202, response.content)
        return response.json()  # type: ignore[no-any-return]

    def job(self, job_id: str, *, key: str | None = None) -> dict[str, Any]:
        response = self.get(f"{JOBS}/{job_id}", key=key or self.key)
        self.assertEqual(response.status_code, 200, response.content)
        return response.json()  # type: ignore[no-any-return]

    # --- assertions ----------------------------------------------------------------------------

    def assert_error(self, response: Any, status: int, code: str | None = None, field: Any = ...) -> dict[str, Any]:
        """Exact status, the {"error": {"code", "message", "field"}} shape, and code/field when given."""
        self.assertEqual(response.status_code, status, response.content)
        self.assertTrue(response["Content-Type"].startswith("application/json"), response["Content-Type"])
        body = response.json()
        self.assertEqual(set(body), {"error"}, body)
        error = body["error"]
        self.assertEqual(set(error), {"code", "message", "field"}, body)
        self.assertIsInstance(error["code"], str)
        self.assertIsInstance(error["message"], str)
        self.assertTrue(error["message"], body)
        self.assertTrue(error["field"] is None or isinstance(error["field"], str), body)
        if code is not None:
            self.assertEqual(error["code"], code, body)
        if field is not ...:
            self.assertEqual(error["field"], field, body)
        return error  # type: ignore[no-any-return]


class SubmitTests(ApiTestCase):
    def test_submit_returns_202_with_the_job(self) -> None:
        response = self.post(JOBS, sleep_job(sub_tenant="cust-1", idempotency_key="k1"))
        self.assertEqual(response.status_code, 202, response.content)
        job = response.json()
        self.assertLessEqual(JOB_KEYS, set(job))
        uuid.UUID(job["id"])
        self.assertIn(job["status"], {"queued", "parked"})
        self.assertEqual(job["task"], "demo.sleep")
        self.assertEqual(job["priority"], "default")
        self.assertIs(job["batch"], False)
        self.assertEqual(job["sub_tenant"], "cust-1")
        self.assertIsNone(job["started_at"])
        self.assertIsNone(job["finished_at"])
        self.assertIsNone(job["result"])
        self.assertIsNone(job["error"])
        submitted = datetime.fromisoformat(job["submitted_at"])
        self.assertIsNotNone(submitted.tzinfo, "submitted_at must carry its timezone")
        row = Job.objects.get(id=job["id"])
        self.assertEqual(row.tenant, self.tenant)
        self.assertEqual(row.args, {"seconds": 0.1})
        self.assertEqual(row.idempotency_key, "k1")

    def test_submit_with_a_named_priority(self) -> None:
        job = self.submit({"task": "demo.parse", "args": {"pages": 3}, "priority": "critical"})
        self.assertEqual(job["priority"], "critical")
        self.assertEqual(job["task"], "demo.parse")
        self.assertIsNone(job["sub_tenant"])

    def test_first_job_within_the_limit_is_queued_not_parked(self) -> None:
        job = self.submit()
        self.assertEqual(job["status"], "queued")
        self.assertIsNone(self.job(job["id"])["waiting_on"])

    def test_same_idempotency_key_returns_the_same_job_with_200(self) -> None:
        first = self.post(JOBS, sleep_job(idempotency_key="order-42"))
        self.assertEqual(first.status_code, 202, first.content)
        again = self.post(JOBS, sleep_job(idempotency_key="order-42"))
        self.assertEqual(again.status_code, 200, again.content)
        self.assertEqual(again.json()["id"], first.json()["id"])
        self.assertEqual(Job.objects.count(), 1)
        # A different body under the same key still answers with the original job.
        third = self.post(JOBS, {"task": "demo.parse", "args": {"pages": 1}, "idempotency_key": "order-42"})
        self.assertEqual(third.status_code, 200, third.content)
        self.assertEqual(third.json()["id"], first.json()["id"])
        self.assertEqual(Job.objects.count(), 1)

    def test_idempotency_keys_are_per_tenant(self) -> None:
        _, other_key = self.tenant_with("globex")
        mine = self.submit(sleep_job(idempotency_key="same"))
        theirs = self.submit(sleep_job(idempotency_key="same"), key=other_key)
        self.assertNotEqual(mine["id"], theirs["id"])
        self.assertEqual(Job.objects.count(), 2)

    def test_unknown_task(self) -> None:
        self.assert_error(self.post(JOBS, {"task": "demo.nope", "args": {}}), 400, "unknown_task", "task")
        self.assertEqual(Job.objects.count(), 0)

    def test_unknown_priority(self) -> None:
        self.assert_error(self.post(JOBS, sleep_job(priority="urgent")), 400, "unknown_priority", "priority")
        self.assertEqual(Job.objects.count(), 0)

    def test_bad_args(self) -> None:
        cases = [
            ("missing field", {"task": "demo.sleep", "args": {}}, "args.seconds"),
            ("wrong type", {"task": "demo.sleep", "args": {"seconds": "soon"}}, "args.seconds"),
            ("out of range", {"task": "demo.sleep", "args": {"seconds": 4000}}, "args.seconds"),
            ("negative", {"task": "demo.sleep", "args": {"seconds": -1}}, "args.seconds"),
            ("extra field", {"task": "demo.sleep", "args": {"seconds": 1, "colour": "red"}}, "args.colour"),
            ("int field given a float", {"task": "demo.parse", "args": {"pages": 1.5}}, "args.pages"),
            ("zero pages", {"task": "demo.parse", "args": {"pages": 0}}, "args.pages"),
            ("args omitted", {"task": "demo.parse"}, "args.pages"),
        ]
        for label, body, field in cases:
            with self.subTest(label):
                self.assert_error(self.post(JOBS, body), 400, "invalid_args", field)
        self.assertEqual(Job.objects.count(), 0)

    def test_args_not_an_object(self) -> None:
        for args in ([1, 2], "seconds=1", 5, None):
            with self.subTest(args=args):
                error = self.assert_error(self.post(JOBS, {"task": "demo.sleep", "args": args}), 400)
                self.assertEqual(error["field"], "args")
        self.assertEqual(Job.objects.count(), 0)

    def test_args_not_an_object_uses_the_invalid_args_code(self) -> None:
        # The service defines invalid_args for this; the schema answers first with a generic code.
        self.assert_error(self.post(JOBS, {"task": "demo.sleep", "args": [1]}), 400, "invalid_args", "args")

    def test_wrong_types_of_top_level_fields(self) -> None:
        cases = [
            ({"task": 5, "args": {"seconds": 1}}, "task"),
            ({"args": {"seconds": 1}}, "task"),
            ({"task": "", "args": {"seconds": 1}}, "task"),
            (sleep_job(batch="sometimes"), "batch"),
            (sleep_job(priority=3), "priority"),
            (sleep_job(idempotency_key=""), "idempotency_key"),
            (sleep_job(idempotency_key="k" * 201), "idempotency_key"),
            (sleep_job(sub_tenant="x" * 201), "sub_tenant"),
        ]
        for body, field in cases:
            with self.subTest(body=body):
                self.assert_error(self.post(JOBS, body), 400, "invalid_request", field)
        self.assertEqual(Job.objects.count(), 0)

    def test_invalid_sub_tenant(self) -> None:
        self.assert_error(self.post(JOBS, sleep_job(sub_tenant="has space")), 400, "invalid_sub_tenant", "sub_tenant")
        self.assertEqual(Job.objects.count(), 0)

    def test_unknown_top_level_field(self) -> None:
        self.assert_error(self.post(JOBS, sleep_job(colour="red")), 400, "invalid_request", "colour")
        self.assertEqual(Job.objects.count(), 0)

    def test_unknown_top_level_field_named_like_a_request_part(self) -> None:
        # The error's field must still name it, though "payload" and "body" are also ninja's loc prefixes.
        for name in ("payload", "body"):
            with self.subTest(name=name):
                self.assert_error(self.post(JOBS, sleep_job(**{name: 1})), 400, "invalid_request", name)

    def test_batch_without_opt_in(self) -> None:
        self.assert_error(self.post(JOBS, sleep_job(batch=True)), 400, "batch_not_enabled", "batch")
        self.assertEqual(Job.objects.count(), 0)

    def test_batch_with_opt_in(self) -> None:
        _, key = self.tenant_with("bulkco", batch_enabled=True)
        job = self.submit(sleep_job(batch=True), key=key)
        self.assertIs(job["batch"], True)
        self.assertTrue(Job.objects.get(id=job["id"]).batch)

    def test_invalid_json(self) -> None:
        for raw in ('{"task": "demo.sleep", ', "not json", "{'task': 'demo.sleep'}"):
            with self.subTest(raw=raw):
                self.assert_error(self.post(JOBS, raw=raw), 400, "invalid_json", None)
        self.assertEqual(Job.objects.count(), 0)

    def test_body_that_is_not_valid_utf8(self) -> None:
        self.assert_error(self.post(JOBS, raw=b'{"task": "\xff\xfe"}'), 400, "invalid_json", None)

    def test_json_body_that_is_not_an_object(self) -> None:
        for raw in ("[]", '"demo.sleep"', "42", "null"):
            with self.subTest(raw=raw):
                self.assert_error(self.post(JOBS, raw=raw), 400, "invalid_request", None)
        self.assertEqual(Job.objects.count(), 0)

    def test_empty_body(self) -> None:
        self.assert_error(self.post(JOBS, raw=""), 400, "invalid_request", None)
        self.assertEqual(Job.objects.count(), 0)

    def test_deeply_nested_json_is_a_400_not_a_crash(self) -> None:
        depth = 100_000
        raw = '{"task": "demo.sleep", "args": {"seconds": 1, "echo": ' + "[" * depth + "]" * depth + "}}"
        self.assert_error(self.post(JOBS, raw=raw), 400, "invalid_json", None)
        self.assertEqual(Job.objects.count(), 0)

    @override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
    def test_body_over_the_size_cap(self) -> None:
        body = sleep_job()
        body["args"]["echo"] = "x" * 2000
        self.assert_error(self.post(JOBS, body), 413, "payload_too_large", None)
        self.assertEqual(Job.objects.count(), 0)
        # Just under the cap is accepted.
        small = sleep_job()
        small["args"]["echo"] = "x" * 500
        self.submit(small)

    @override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
    def test_bulk_body_over_the_size_cap(self) -> None:
        self.assert_error(self.post(BULK, {"jobs": [sleep_job() for _ in range(40)]}), 413, "payload_too_large")
        self.assertEqual(Job.objects.count(), 0)


class LargePayloadTests(ApiTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.dir = Path(tempfile.mkdtemp(prefix="fq-payloads-"))
        self.addCleanup(shutil.rmtree, self.dir, True)
        storages = {
            **settings.STORAGES,
            "payloads": {**settings.STORAGES["payloads"], "OPTIONS": {"location": str(self.dir)}},
        }
        fairqueue = {**settings.FAIRQUEUE, "PAYLOAD_DIR": str(self.dir), "PAYLOAD_THRESHOLD_BYTES": 1000}
        override = override_settings(STORAGES=storages, FAIRQUEUE=fairqueue)
        override.enable()
        self.addCleanup(override.disable)

    def files(self) -> list[Path]:
        return [p for p in self.dir.rglob("*") if p.is_file()]

    def big_job(self) -> dict[str, Any]:
        return {"task": "demo.sleep", "args": {"seconds": 0, "echo": "x" * 5000}}

    def test_large_args_are_offloaded(self) -> None:
        job = self.submit(self.big_job())
        row = Job.objects.get(id=job["id"])
        self.assertTrue(row.args_ref)
        self.assertEqual(row.args, {})
        self.assertEqual(len(self.files()), 1)

    def test_failed_bulk_leaves_no_offloaded_payloads_behind(self) -> None:
        jobs = [self.big_job(), self.big_job(), sleep_job(), {"task": "demo.nope", "args": {}}]
        self.assert_error(self.post(BULK, {"jobs": jobs}), 400, "unknown_task", "jobs[3].task")
        self.assertEqual(Job.objects.count(), 0)
        self.assertEqual(self.files(), [], "a rejected bulk request must not leave payload files behind")


class AuthTests(ApiTestCase):
    def test_missing_authorization(self) -> None:
        for path, method in ((JOBS, "post"), (BULK, "post"), (JOBS, "get"), (f"{JOBS}/{uuid.uuid4()}", "get")):
            with self.subTest(path=path, method=method):
                response = self.post(path, sleep_job(), key=False) if method == "post" else self.get(path, key=False)
                self.assert_error(response, 401, "unauthorized", None)
        self.assertEqual(Job.objects.count(), 0)

    def test_wrong_or_malformed_keys(self) -> None:
        prefix = self.tenant.api_key_prefix
        keys = {
            "wrong secret, right prefix": f"fq_{prefix}_{'A' * 43}",
            "unknown prefix": f"fq_00000000_{'A' * 43}",
            "garbage": "garbage",
            "too many underscores": f"{self.key}_x",
            "truncated": self.key[:-1],
            "blank": " ",
        }
        for label, key in keys.items():
            with self.subTest(label):
                self.assert_error(self.post(JOBS, sleep_job(), key=key), 401, "unauthorized", None)
        self.assertEqual(Job.objects.count(), 0)

    def test_wrong_scheme(self) -> None:
        for header in (f"Basic {self.key}", self.key, "Bearer"):
            with self.subTest(header=header):
                response = self._check(
                    self.client.post(
                        JOBS, data=json.dumps(sleep_job()), content_type="application/json", HTTP_AUTHORIZATION=header
                    )
                )
                self.assert_error(response, 401, "unauthorized", None)

    def test_key_of_a_deleted_tenant(self) -> None:
        tenant, key = self.tenant_with("gone")
        self.submit(key=key)
        with self.captureOnCommitCallbacks(execute=True):
            tenant.delete()
        policy_invalidate()
        self.assert_error(self.post(JOBS, sleep_job(), key=key), 401, "unauthorized", None)
        self.assert_error(self.get(JOBS, key=key), 401, "unauthorized", None)

    def test_rotated_key_stops_working(self) -> None:
        old = self.key
        new = self.tenant.rotate_api_key()
        self.tenant.save()
        self.assert_error(self.post(JOBS, sleep_job(), key=old), 401, "unauthorized")
        self.submit(key=new)

    def test_inactive_tenant(self) -> None:
        _, key = self.tenant_with("sleepy", active=False)
        self.assert_error(self.post(JOBS, sleep_job(), key=key), 403, "tenant_inactive", None)
        self.assert_error(self.post(BULK, {"jobs": [sleep_job()]}, key=key), 403, "tenant_inactive", None)
        self.assert_error(self.get(JOBS, key=key), 403, "tenant_inactive", None)
        self.assertEqual(Job.objects.count(), 0)

    def test_openapi_schema_is_served(self) -> None:
        response = self._check(self.client.get("/api/v1/openapi.json"))
        self.assertEqual(response.status_code, 200)
        schema = response.json()
        self.assertIn("paths", schema)
        for path in ("/api/v1/jobs", "/api/v1/jobs/bulk", "/api/v1/jobs/{job_id}", "/api/v1/jobs/{job_id}/cancel"):
            self.assertIn(path, schema["paths"])


class ParkedTests(ApiTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.tenant, self.key = self.tenant_with("narrow", max_concurrency=1, floor=1)
        self.jobs = [self.submit() for _ in range(3)]

    def test_jobs_over_the_limit_are_parked_in_order(self) -> None:
        first, second, third = self.jobs
        self.assertEqual(first["status"], "queued")
        self.assertEqual(second["status"], "parked")
        self.assertEqual(third["status"], "parked")
        self.assertIsNone(self.job(first["id"])["waiting_on"])
        for job, position in ((second, 1), (third, 2)):
            detail = self.job(job["id"])
            self.assertEqual(detail["status"], "parked")
            self.assertEqual(
                detail["waiting_on"],
                {
                    "key": tenant_key("narrow"),
                    "lane": None,
                    "limit": 1,
                    "holders": 1,
                    "position": position,
                    "document": None,
                },
                detail,
            )

    def test_cancel_a_parked_job_moves_the_next_one_up(self) -> None:
        _, second, third = self.jobs
        response = self.post(f"{JOBS}/{second['id']}/cancel")
        self.assertEqual(response.status_code, 200, response.content)
        cancelled = response.json()
        self.assertEqual(cancelled["id"], second["id"])
        self.assertEqual(cancelled["status"], "cancelled")
        self.assertIsNotNone(datetime.fromisoformat(cancelled["finished_at"]))
        self.assertEqual(Job.objects.get(id=second["id"]).status, JobStatus.CANCELLED)
        detail = self.job(third["id"])
        self.assertEqual(detail["status"], "parked")
        self.assertEqual(detail["waiting_on"]["position"], 1)
        self.assertIsNone(self.job(second["id"])["waiting_on"])

    def test_cancel_the_queued_job_admits_the_one_behind(self) -> None:
        first, second, third = self.jobs
        response = self.post(f"{JOBS}/{first['id']}/cancel")
        self.assertEqual(response.status_code, 200, response.content)
        self.assertEqual(response.json()["status"], "cancelled")
        promoted = self.job(second["id"])
        self.assertEqual(promoted["status"], "queued")
        self.assertIsNone(promoted["waiting_on"])
        self.assertIsNotNone(Job.objects.get(id=second["id"]).admitted_at)
        behind = self.job(third["id"])
        self.assertEqual(behind["status"], "parked")
        self.assertEqual(behind["waiting_on"]["position"], 1)
        self.assertEqual(behind["waiting_on"]["holders"], 1)

    def test_cancelling_twice_is_a_409(self) -> None:
        _, second, _ = self.jobs
        self.assertEqual(self.post(f"{JOBS}/{second['id']}/cancel").status_code, 200)
        self.assert_error(self.post(f"{JOBS}/{second['id']}/cancel"), 409, "not_cancellable", None)

    def test_running_and_finished_jobs_are_not_cancellable(self) -> None:
        first, second, _ = self.jobs
        Job.objects.filter(id=first["id"]).update(status=JobStatus.RUNNING)
        Job.objects.filter(id=second["id"]).update(status=JobStatus.SUCCEEDED)
        self.assert_error(self.post(f"{JOBS}/{first['id']}/cancel"), 409, "not_cancellable", None)
        self.assert_error(self.post(f"{JOBS}/{second['id']}/cancel"), 409, "not_cancellable", None)

    def test_status_filter(self) -> None:
        parked = self.get(JOBS, {"status": "parked", "total": "true"}).json()
        self.assertEqual(parked["total"], {"value": 2, "relation": "eq"})
        self.assertEqual({j["id"] for j in parked["items"]}, {self.jobs[1]["id"], self.jobs[2]["id"]})
        self.assertTrue(all(j["status"] == "parked" for j in parked["items"]))
        queued = self.get(JOBS, {"status": "queued"}).json()
        self.assertEqual([j["id"] for j in queued["items"]], [self.jobs[0]["id"]])
        self.assertEqual(self.get(JOBS, {"status": "succeeded"}).json()["items"], [])


class BulkTests(ApiTestCase):
    def test_bulk_submit_of_50(self) -> None:
        response = self.post(BULK, {"jobs": [sleep_job(idempotency_key=f"doc-{i}") for i in range(50)]})
        self.assertEqual(response.status_code, 202, response.content[:500])
        jobs = response.json()
        self.assertIsInstance(jobs, list)
        self.assertEqual(len(jobs), 50)
        self.assertEqual(len({j["id"] for j in jobs}), 50)
        for job in jobs:
            self.assertLessEqual(JOB_KEYS, set(job))
            self.assertIn(job["status"], {"queued", "parked"})
        # Answered in request order.
        keys = list(Job.objects.filter(id__in=[j["id"] for j in jobs]).values_list("id", "idempotency_key"))
        by_id = {str(i): k for i, k in keys}
        self.assertEqual([by_id[j["id"]] for j in jobs], [f"doc-{i}" for i in range(50)])
        self.assertEqual(Job.objects.filter(tenant=self.tenant).count(), 50)

    def test_bulk_resubmit_returns_the_existing_jobs(self) -> None:
        first = self.post(BULK, {"jobs": [sleep_job(idempotency_key=f"d{i}") for i in range(3)]}).json()
        again = self.post(BULK, {"jobs": [sleep_job(idempotency_key=f"d{i}") for i in range(4)]})
        self.assertEqual(again.status_code, 202, again.content)
        self.assertEqual([j["id"] for j in again.json()[:3]], [j["id"] for j in first])
        self.assertEqual(Job.objects.count(), 4)

    def test_bulk_with_one_invalid_job_writes_nothing(self) -> None:
        cases = [
            ({"task": "demo.nope", "args": {}}, "unknown_task", "jobs[3].task"),
            ({"task": "demo.sleep", "args": {"seconds": "x"}}, "invalid_args", "jobs[3].args.seconds"),
            (sleep_job(priority="urgent"), "unknown_priority", "jobs[3].priority"),
            (sleep_job(batch=True), "batch_not_enabled", "jobs[3].batch"),
        ]
        for bad, code, field in cases:
            with self.subTest(code=code):
                jobs = [sleep_job() for _ in range(6)]
                jobs[3] = bad
                self.assert_error(self.post(BULK, {"jobs": jobs}), 400, code, field)
                self.assertEqual(Job.objects.count(), 0)
                self.assertEqual(self.get(JOBS).json()["items"], [])

    def test_bulk_schema_errors_name_the_job_like_service_errors(self) -> None:
        jobs = [sleep_job() for _ in range(6)]
        jobs[3] = sleep_job(colour="red")
        self.assert_error(self.post(BULK, {"jobs": jobs}), 400, "invalid_request", "jobs[3].colour")
        self.assertEqual(Job.objects.count(), 0)

    def test_bulk_over_1000(self) -> None:
        self.assert_error(self.post(BULK, {"jobs": [sleep_job() for _ in range(1001)]}), 400, "invalid_request", "jobs")
        self.assertEqual(Job.objects.count(), 0)

    def test_bulk_empty_or_malformed(self) -> None:
        for body in ({"jobs": []}, {}, {"jobs": "many"}, {"jobs": [sleep_job()], "extra": 1}):
            with self.subTest(body=body):
                self.assert_error(self.post(BULK, body), 400)
        self.assert_error(self.post(BULK, raw="[{"), 400, "invalid_json")
        self.assertEqual(Job.objects.count(), 0)

    def test_bulk_with_duplicate_idempotency_keys(self) -> None:
        jobs = [sleep_job(idempotency_key="a"), sleep_job(idempotency_key="b"), sleep_job(idempotency_key="a")]
        self.assert_error(self.post(BULK, {"jobs": jobs}), 400, "duplicate_idempotency_key")
        self.assertEqual(Job.objects.count(), 0)

    def test_bulk_of_exactly_1000(self) -> None:
        response = self.post(BULK, {"jobs": [sleep_job() for _ in range(1000)]})
        self.assertEqual(response.status_code, 202, response.content[:500])
        self.assertEqual(len(response.json()), 1000)
        self.assertEqual(Job.objects.count(), 1000)


class ReadTests(ApiTestCase):
    def test_get_job(self) -> None:
        submitted = self.submit(sleep_job(idempotency_key="k"))
        job = self.job(submitted["id"])
        self.assertLessEqual(JOB_KEYS | {"waiting_on"}, set(job))
        self.assertEqual(job["id"], submitted["id"])
        self.assertEqual(job["submitted_at"], submitted["submitted_at"])

    def test_malformed_and_unknown_job_ids(self) -> None:
        for job_id in ("not-a-uuid", "123", str(uuid.uuid4()), "%20"):
            with self.subTest(job_id=job_id):
                self.assert_error(self.get(f"{JOBS}/{job_id}"), 404, "not_found", None)
                self.assert_error(self.post(f"{JOBS}/{job_id}/cancel"), 404, "not_found", None)

    def test_pagination(self) -> None:
        ids = [self.submit()["id"] for _ in range(5)]
        page = self.get(JOBS, {"limit": 2}).json()
        self.assertEqual(set(page), {"items", "limit", "has_more", "next", "total", "offset", "next_offset"})
        self.assertEqual((page["limit"], page["has_more"], page["total"]), (2, True, None))
        seen: list[str] = []
        cursor: str | None = None
        while True:
            page = self.get(JOBS, {"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
            self.assertLessEqual(len(page["items"]), 2)
            seen += [j["id"] for j in page["items"]]
            if not page["has_more"]:
                self.assertIsNone(page["next"])
                break
            cursor = page["next"]
        self.assertEqual(seen, list(reversed(ids)), "newest first, each job exactly once")
        default = self.get(JOBS).json()
        self.assertEqual((default["limit"], default["has_more"], len(default["items"])), (50, False, 5))

    def test_deprecated_offset_pages(self) -> None:
        ids = [self.submit()["id"] for _ in range(5)]
        seen: list[str] = []
        offset: int | None = 0
        while offset is not None:
            page = self.get(JOBS, {"limit": 2, "offset": offset}).json()
            self.assertEqual(page["offset"], offset)
            seen += [j["id"] for j in page["items"]]
            offset = page["next_offset"]
        self.assertEqual(seen, list(reversed(ids)))
        last = self.get(JOBS, {"limit": 2, "offset": 4}).json()
        self.assertEqual((len(last["items"]), last["has_more"], last["next_offset"]), (1, False, None))
        beyond = self.get(JOBS, {"offset": 100}).json()
        self.assertEqual((beyond["items"], beyond["has_more"], beyond["next_offset"]), ([], False, None))

    def test_invalid_list_parameters(self) -> None:
        for params, field in (
            ({"status": "done"}, "status"),
            ({"limit": 0}, "limit"),
            ({"limit": 501}, "limit"),
            ({"limit": "ten"}, "limit"),
            ({"offset": -1}, "offset"),
            ({"offset": 10_001}, "offset"),
            ({"submitted_since": "2030-01-01T00:00:00"}, "submitted_since"),  # no UTC offset
            ({"submitted_before": "yesterday"}, "submitted_before"),
            ({"task": "x" * 101}, "task"),
            ({"sub_tenant": "x" * 201}, "sub_tenant"),
            ({"total": "maybe"}, "total"),
        ):
            with self.subTest(params=params):
                self.assert_error(self.get(JOBS, params), 400, "invalid_request", field)

    def test_cross_tenant_access_is_a_404(self) -> None:
        _, other_key = self.tenant_with("globex")
        mine = self.submit()
        theirs = self.submit(key=other_key)
        self.assert_error(self.get(f"{JOBS}/{mine['id']}", key=other_key), 404, "not_found", None)
        self.assert_error(self.post(f"{JOBS}/{mine['id']}/cancel", key=other_key), 404, "not_found", None)
        self.assertNotEqual(Job.objects.get(id=mine["id"]).status, JobStatus.CANCELLED)
        listing = self.get(JOBS, {"total": "true"}, key=other_key).json()
        self.assertEqual([j["id"] for j in listing["items"]], [theirs["id"]])
        self.assertEqual(listing["total"], {"value": 1, "relation": "eq"})
        for status in ("queued", "parked"):
            other = self.get(JOBS, {"status": status}, key=other_key).json()
            self.assertNotIn(mine["id"], [j["id"] for j in other["items"]])
        self.assertEqual([j["id"] for j in self.get(JOBS).json()["items"]], [mine["id"]])
