"""The one Celery task: run a FairQueue job delivery. Thin; the work is in fairqueue.jobs.execution.

Celery's tools see the jobs it runs, not this wrapper (fairqueue.jobs.task_events): it sends
no task events of its own, and its worker request reports the job its slot runs now.
"""

from __future__ import annotations

from celery import shared_task

from fairqueue.jobs import task_events
from fairqueue.jobs.execution import job_execute


# Acknowledged when the job ends, and given back if its worker dies: a worker then holds at
# most one message per slot. The broker's re-delivery is a late safety net: the engine's
# leases re-deliver a dead worker's jobs. Set here, so the project's own tasks keep theirs.
@shared_task(
    name="fairqueue.run_job",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    send_events=False,
    Request="fairqueue.jobs.task_events:SlotRequest",
)
def run_job(self, job_id: str, generation: int) -> str:  # type: ignore[no-untyped-def]
    with task_events.slot(self.request.id):
        return job_execute(job_id=job_id, generation=generation, worker=self.request.hostname or "unknown")
