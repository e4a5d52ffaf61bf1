"""The one Celery task: run a FairQueue job delivery. Thin; the work is in services."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="fairqueue.run_job", bind=True, acks_late=True, ignore_result=True)
def run_job(self, job_id: str, generation: int) -> str:  # type: ignore[no-untyped-def]
    from fairqueue.jobs.services import job_execute

    return job_execute(job_id=job_id, generation=generation, worker=self.request.hostname or "unknown")
