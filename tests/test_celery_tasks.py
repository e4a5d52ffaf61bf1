"""A project's existing `@shared_task`s sent through FairQueue's throttle without rewriting
(fairqueue.jobs.celery_tasks): a schema inferred from the signature or given, validated on
submit, run on a real FairQueue worker."""

from __future__ import annotations

import fairqueue
from fairqueue.jobs.celery_tasks import SignatureNotInferable, args_model_of
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.models import Job, JobStatus
from tests import celery_sample
from tests.factories import make_tenant
from tests.test_jobs_e2e import E2EBase
from tests.workers import WorkerProcess

MODULES = "tests.celery_sample"


class ExistingCeleryTaskTests(E2EBase):
    def test_registered_tasks_run_through_the_throttle_on_a_worker(self) -> None:
        tenant, key = make_tenant("legacy", max_concurrency=1)
        inferred = fairqueue.submit(tenant, "project.multiply", {"x": 6})
        explicit = fairqueue.submit(tenant, "project.label", {"text": "fair", "upper": True})
        over_rest = self.submit(key, {"task": "project.multiply", "args": {"x": 2, "y": 5}})
        with WorkerProcess(slots=2, FAIRQUEUE_TASK_MODULES=MODULES):
            jobs = self.wait_all_finished([inferred.pk, explicit.pk, over_rest["id"]])
        self.assertEqual([j.status for j in jobs], [JobStatus.SUCCEEDED] * 3)
        results = {str(j.pk): j.result for j in Job.objects.all()}
        self.assertEqual(results[str(inferred.pk)], 12)
        self.assertEqual(results[str(explicit.pk)], "FAIR")
        self.assertEqual(results[over_rest["id"]], 10)

    def test_arguments_are_validated_by_the_schema(self) -> None:
        tenant, _ = make_tenant("legacy-bad")
        for args, field in (({"y": 3}, "args.x"), ({"x": "six"}, "args.x"), ({"x": 1, "z": 0}, "args.z")):
            with self.subTest(args=args), self.assertRaises(JobError) as caught:
                fairqueue.submit(tenant, "project.multiply", args)
            self.assertEqual((caught.exception.code, caught.exception.field), ("invalid_args", field))
        with self.assertRaises(JobError):
            fairqueue.submit(tenant, "project.label", {"text": "x" * 21})
        self.assertEqual(Job.objects.count(), 0)

    def test_a_signature_without_names_needs_a_schema_and_delay_is_untouched(self) -> None:
        with self.assertRaises(SignatureNotInferable):
            args_model_of(celery_sample.greet.run, "project.greet")
        self.assertEqual(celery_sample.multiply.run(3, 3), 9)  # the body, as .delay() would run it
