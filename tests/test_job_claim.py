"""The first steps of a delivery: the hold is shortened to the running lease before the
job is claimed, so a worker killed in between leaks nothing for longer than that lease."""

from __future__ import annotations

import time

from django.conf import settings

from fairqueue.jobs.admission import shard_tag
from fairqueue.jobs.execution import job_execute
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.runtime import engine
from tests.factories import make_tenant
from tests.test_jobs_api import ApiTestCase
from tests.test_jobs_e2e import E2EBase
from tests.workers import WorkerProcess, wait_for


class DeliveryStartTests(ApiTestCase):
    def queued_job(self) -> tuple[Job, str]:
        job = Job.objects.select_related("tenant__shard").get(id=self.submit()["id"])
        self.assertEqual(job.status, JobStatus.QUEUED)  # admitted, on its dispatch lease
        return job, shard_tag(job.tenant.shard.name)

    def test_a_hold_reclaimed_before_the_start_leaves_the_job_untouched(self) -> None:
        job, tag = self.queued_job()
        self.assertTrue(engine().expire_now(tag=tag, job_id=job.engine_id))
        engine().reclaim(tag=tag)  # reclaimed, not re-delivered yet
        self.assertEqual(job_execute(job_id=str(job.id), generation=job.generation, worker="w"), "lost")
        row = Job.objects.get(id=job.id)
        self.assertEqual((row.status, row.attempts, row.worker), (JobStatus.QUEUED, 0, ""))


class RunningJobLeaseTests(E2EBase):
    def test_a_job_seen_running_already_holds_the_short_running_lease(self) -> None:
        _, key = make_tenant("leases")
        with WorkerProcess(slots=1, name="leases"):
            job = Job.objects.get(id=self.submit(key, {"task": "demo.sleep", "args": {"seconds": 3}})["id"])
            tag = shard_tag(job.tenant.shard.name)
            wait_for(
                lambda: Job.objects.filter(id=job.id, status=JobStatus.RUNNING).exists(),
                interval=0.002,
                message="start",
            )
            state = engine().inspect_job(tag=tag, job_id=job.engine_id)
            left = (state.lease_expires_ms or 0) / 1000 - time.time()
            self.assertLessEqual(left, settings.FAIRQUEUE["LEASE_SECONDS"] + 1, "still on the dispatch lease")
