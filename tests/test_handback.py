"""Rolling deploys: an old worker hands back what only the new version can run (without
counting a failure or a worker loss); past the time limit the job fails `unknown_task`."""

from __future__ import annotations

from fairqueue.jobs.handback import UNKNOWN_TASK, handback_key
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.runtime import engine
from fairqueue.jobs.submission import JobRequest, job_submit
from tests import worker_tasks_v2  # noqa: F401  (the web tier runs the new version)
from tests.base import RedisTransactionTestCase
from tests.factories import make_tenant
from tests.workers import WorkerProcess, wait_for

OLD = "tests.worker_tasks_v1"
NEW = "tests.worker_tasks_v2"


class RollingDeployTests(RedisTransactionTestCase):
    serialized_rollback = True  # the latency classes the migrations seed survive the flush

    def setUp(self) -> None:
        super().setUp()
        self.tenant, _ = make_tenant("acme", floor=4, max_concurrency=4)

    def submit(self, task: str, args: dict[str, object]) -> Job:
        return job_submit(tenant=self.tenant, req=JobRequest(task=task, args=args)).job

    def handed_back(self, job: Job) -> int:
        return int(self.redis.hget(handback_key(str(job.id)), "count") or 0)

    def status(self, job: Job) -> Job:
        return Job.objects.get(id=job.id)

    def test_old_workers_hand_back_what_only_new_workers_run(self) -> None:
        old = WorkerProcess(slots=2, name="old", FAIRQUEUE_TASK_MODULES=OLD)
        new = WorkerProcess(slots=2, name="new", FAIRQUEUE_TASK_MODULES=NEW)
        with old:
            unknown = self.submit("test.new_only", {"text": "hi"})
            newer_args = self.submit("test.versioned", {"n": 1, "label": "v2"})
            compatible = self.submit("test.versioned", {"n": 2})
            # The old worker runs what its version accepts...
            wait_for(lambda: self.status(compatible).status == JobStatus.SUCCEEDED, timeout=60, message="v1 ran")
            self.assertEqual(self.status(compatible).result["version"], 1)
            # ...and keeps handing back the rest, which waits (admitted again each time, or
            # parked while the pool's slots are taken), uncounted.
            for job in (unknown, newer_args):
                wait_for(lambda job=job: self.handed_back(job) >= 2, timeout=60, message="handed back twice")
                row = self.status(job)
                self.assertIn(row.status, (JobStatus.QUEUED, JobStatus.PARKED))
                self.assertEqual((row.attempts, row.worker_losses, row.error_reason), (0, 0, ""))
            with new:
                for job, expected in ((unknown, {"text": "HI"}), (newer_args, {"version": 2, "label": "v2"})):
                    wait_for(
                        lambda job=job: self.status(job).status == JobStatus.SUCCEEDED,
                        timeout=60,
                        message="the new worker ran it",
                    )
                    row = self.status(job)
                    self.assertEqual(row.worker, new.hostname)
                    self.assertEqual((row.attempts, row.worker_losses), (1, 0))
                    self.assertLessEqual(expected.items(), row.result.items())

    def test_a_job_no_worker_can_run_fails_unknown_task_after_the_limit(self) -> None:
        with WorkerProcess(slots=2, name="old", FAIRQUEUE_TASK_MODULES=OLD, FAIRQUEUE_HANDBACK_SECONDS="2"):
            job = self.submit("test.new_only", {"text": "hi"})
            wait_for(lambda: self.status(job).status == JobStatus.FAILED, timeout=60, message="unknown_task")
            row = self.status(job)
            self.assertEqual(row.error_reason, UNKNOWN_TASK)
            self.assertIn("not registered on this worker", row.error)
            self.assertEqual((row.attempts, row.worker_losses), (0, 0))
            # Its slots are given back (right after the status): the tenant is not held up by it.
            wait_for(
                lambda: sum(engine().counts(tag=row.engine_tag, keys=row.engine_key_names).values()) == 0,
                timeout=30,
                message="the failed job's slots released",
            )
