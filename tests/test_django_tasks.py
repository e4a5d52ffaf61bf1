"""The Django Tasks backend (fairqueue.tasks_backend): `@task(...).enqueue()` goes through
FairQueue's throttle as a tenant, runs on a real FairQueue worker, and `get_result()`
reports its status and return value; priority is a latency class, run_after a delay."""

from __future__ import annotations

import json
from datetime import timedelta

from django.utils import timezone
from django_tasks import TaskResultStatus, task_backends
from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist

import fairqueue
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.tasks_backend import FairQueueBackend
from tenants.policy import policy_snapshot
from tests import django_tasks_sample as sample
from tests.factories import make_tenant
from tests.test_jobs_e2e import E2EBase
from tests.workers import WorkerProcess, wait_for


class DjangoTasksBackendTests(E2EBase):
    def setUp(self) -> None:
        super().setUp()
        self.tenant, self.key = make_tenant("dtasks")

    def finished(self, result_id: str) -> object:
        return wait_for(
            lambda: (r := sample.add.get_backend().get_result(result_id)).is_finished and r,
            timeout=60,
            message="the task finished",
        )

    def test_the_project_uses_it_and_its_flags_say_what_is_true(self) -> None:
        backend = task_backends["default"]
        self.assertIsInstance(backend, FairQueueBackend)
        flags = (
            backend.supports_defer,
            backend.supports_async_task,
            backend.supports_get_result,
            backend.supports_priority,
        )
        self.assertEqual(flags, (True, True, True, True))

    def test_enqueued_tasks_run_on_a_worker_and_report_their_values(self) -> None:
        added = sample.add.using(queue_name="dtasks").enqueue(2, b=3)
        shouted = sample.shout.using(queue_name="dtasks").enqueue("fair")
        failing = sample.explode.using(queue_name="dtasks").enqueue()
        self.assertEqual(added.status, TaskResultStatus.READY)
        job = Job.objects.get(pk=added.id)
        self.assertEqual((job.tenant_id, job.task), (self.tenant.pk, "django.task"))
        with WorkerProcess(slots=2):
            done = self.finished(added.id)
            self.assertEqual((done.status, done.return_value), (TaskResultStatus.SUCCESSFUL, 5))
            self.assertEqual((done.args, done.kwargs), ([2], {"b": 3}))
            self.assertEqual(self.finished(shouted.id).return_value, "FAIR")
            failed = self.finished(failing.id)
        self.assertEqual(failed.status, TaskResultStatus.FAILED)
        self.assertIn("boom", failed.errors[0].traceback)
        refreshed = sample.add.get_result(added.id)
        self.assertEqual(refreshed.return_value, 5)

    def test_priority_is_a_latency_class_and_run_after_a_delay(self) -> None:
        ranked = sorted(policy_snapshot().classes.values(), key=lambda c: -c.rank)
        urgent = sample.add.using(queue_name="dtasks", priority=100).enqueue(1, 1)
        lowest = sample.add.using(queue_name="dtasks", priority=-100).enqueue(1, 1)
        plain = sample.add.using(queue_name="dtasks").enqueue(1, 1)
        self.assertEqual(Job.objects.get(pk=urgent.id).latency_class, ranked[0].name)
        self.assertEqual(Job.objects.get(pk=lowest.id).latency_class, ranked[-1].name)
        tenant_default = fairqueue.submit(self.tenant, "demo.sleep", {"seconds": 0}).latency_class
        self.assertEqual(Job.objects.get(pk=plain.id).latency_class, tenant_default)
        later = sample.add.using(queue_name="dtasks", run_after=timezone.now() + timedelta(hours=1)).enqueue(1, 1)
        self.assertEqual(Job.objects.get(pk=later.id).status, JobStatus.SCHEDULED)
        self.assertEqual(sample.add.get_result(later.id).status, TaskResultStatus.READY)

    def test_a_tenant_must_be_named_and_exist(self) -> None:
        with self.assertRaises(InvalidTaskError):
            sample.add.enqueue(1, 2)  # the default queue, and no default tenant configured
        with self.assertRaises(JobError):
            sample.add.using(queue_name="nobody").enqueue(1, 2)
        with self.assertRaises(TaskResultDoesNotExist):
            sample.add.get_result("not-a-job")

    def test_over_rest_django_task_runs_only_fairqueue_backend_tasks(self) -> None:
        body = {"task": "django.task", "args": {"task": "os.getcwd", "args": []}}
        job = self.submit(self.key, body)
        with WorkerProcess(slots=1):
            (done,) = self.wait_all_finished([job["id"]])
        self.assertEqual(done.status, JobStatus.FAILED)
        self.assertIn("is not a Django task of FairQueue's backend", json.dumps(done.error))
