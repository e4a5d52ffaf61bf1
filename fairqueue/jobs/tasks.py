"""The one Celery task: run a FairQueue job delivery. Thin; the work is in fairqueue.jobs.execution."""

from __future__ import annotations

from celery import shared_task

from fairqueue.jobs.execution import job_execute


@shared_task(name="fairqueue.run_job", bind=True, acks_late=True, ignore_result=True)
def run_job(self, job_id: str, generation: int) -> str:  # type: ignore[no-untyped-def]
    return job_execute(job_id=job_id, generation=generation, worker=self.request.hostname or "unknown")
