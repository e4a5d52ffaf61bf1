"""The in-process API (fairqueue.submit / fairqueue.asubmit): the same validation, errors,
idempotency and delays as POST /api/v1/jobs, and the job returned."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from django.test import Client

import fairqueue
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.models import Job, JobStatus
from tests.base import RedisTestCase
from tests.factories import make_tenant
from tests.test_jobs_e2e import E2EBase


class InProcessSubmitTests(RedisTestCase):
    def setUp(self) -> None:
        self.tenant, self.key = make_tenant("inproc")
        self.http = Client()

    def rest(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        response = self.http.post(
            "/api/v1/jobs", json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {self.key}"
        )
        return response.status_code, response.json()

    def in_process_error(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        options = {k: v for k, v in body.items() if k not in ("task", "args")}
        with self.assertRaises(JobError) as caught:
            fairqueue.submit(self.tenant, body["task"], body.get("args"), **options)
        e = caught.exception
        return e.status, {"error": {"code": e.code, "message": e.message, "field": e.field}}

    def test_a_job_is_submitted_by_tenant_or_slug_and_returned(self) -> None:
        job = fairqueue.submit("inproc", "demo.sleep", {"seconds": 0}, priority="high", sub_tenant="c-1")
        self.assertIsInstance(job, Job)
        self.assertEqual(
            (job.tenant_id, job.task, job.latency_class, job.sub_tenant), (self.tenant.pk, "demo.sleep", "high", "c-1")
        )
        self.assertEqual(Job.objects.get(pk=job.pk).args, {"seconds": 0})
        again = fairqueue.submit(self.tenant, "demo.sleep", {"seconds": 0}, idempotency_key="k1")
        self.assertEqual(fairqueue.submit(self.tenant, "demo.sleep", {"seconds": 0}, idempotency_key="k1").pk, again.pk)
        later = fairqueue.submit(self.tenant, "demo.sleep", {"seconds": 0}, delay_seconds=3600)
        self.assertEqual(later.status, JobStatus.SCHEDULED)

    def test_bad_input_is_the_rest_apis_error(self) -> None:
        for body in (
            {"task": "no.such.task", "args": {}},
            {"task": "demo.sleep", "args": {"seconds": "long"}},
            {"task": "demo.sleep", "args": {"seconds": 0}, "priority": "nope"},
            {"task": "demo.sleep", "args": {"seconds": 0}, "delay_seconds": -1},
            {"task": "demo.sleep", "args": {"seconds": 0}, "surprise": 1},
            {"task": "demo.sleep", "args": {"seconds": 0}, "callback_url": "http://127.0.0.1/hook"},
        ):
            with self.subTest(body=body):
                status, answer = self.rest(body)
                self.assertGreaterEqual(status, 400)
                self.assertLess(status, 500)
                self.assertEqual(self.in_process_error(body), (status, answer))
        self.assertEqual(Job.objects.count(), 0, "nothing half-written")

    def test_an_unknown_or_inactive_tenant_is_refused(self) -> None:
        with self.assertRaises(JobError) as caught:
            fairqueue.submit("nobody", "demo.sleep", {"seconds": 0})
        self.assertEqual((caught.exception.status, caught.exception.code), (404, "tenant_not_found"))
        self.tenant.active = False
        self.tenant.save()
        with self.assertRaises(JobError) as caught:
            fairqueue.submit(self.tenant, "demo.sleep", {"seconds": 0})
        self.assertEqual((caught.exception.status, caught.exception.code), (403, "tenant_inactive"))


class AsyncSubmitTests(E2EBase):  # committed rows, seeded classes kept (serialized rollback)
    def test_the_async_twin_submits_from_async_code(self) -> None:
        make_tenant("inproc-async")
        job = asyncio.run(fairqueue.asubmit("inproc-async", "demo.sleep", {"seconds": 0}, priority="high"))
        self.assertEqual((Job.objects.get(pk=job.pk).task, job.latency_class), ("demo.sleep", "high"))
        with self.assertRaises(JobError):
            asyncio.run(fairqueue.asubmit("inproc-async", "demo.sleep", {"seconds": "x"}))
