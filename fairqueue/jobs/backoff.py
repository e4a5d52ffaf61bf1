"""What a job's outcome tells its outside resources (docs/resources.md).

A task that raises `fairqueue.Backoff` was refused by a resource (HTTP 429): the
resource's effective limit is cut (tenants.resource_limits), stored on the job's tag before
anything else, then the job gives its slots back through the normal release, which wakes
waiters as far as the new limits allow, and is admitted again under a new generation, to
wait on the resource's key. It is not failed, and not a worker loss: the row goes from
running to queued by compare-and-set, like a graceful hand-back.

A job that succeeds adds its part to the recovery of each resource it called.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db.models import F

from fairqueue.backoff import Backoff
from fairqueue.jobs import stats
from fairqueue.jobs.admission import known_resources
from fairqueue.jobs.dispatch import job_release, jobs_admit
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.resource_keys import resource_limits_push
from tenants.policy import policy_snapshot
from tenants.resource_limits import clamp_slots, resource_refused, resource_succeeded

log = logging.getLogger("fairqueue.jobs.backoff")


def job_back_off(job: Job, refusal: Backoff, *, started: datetime) -> str:
    """Handle a refusal of the running `job` (this delivery: `job.generation`); returns the
    delivery's outcome for the logs."""
    policy = policy_snapshot()
    resource = policy.resources.get(refusal.resource)
    if resource is None:
        log.warning("job %s backed off from %r, which is not a configured resource", job.id, refusal.resource)
    else:
        cut = resource_refused(
            resource, started_ms=round(started.timestamp() * 1000), retry_after_seconds=refusal.retry_after
        )
        log.info(
            "job %s refused by %s: effective limit %.2f%s",
            job.id,
            resource.name,
            cut.effective,
            " (cut)" if cut.cut else "",
        )
        # Before the release: the slot it frees must be handed on under the new limit.
        resource_limits_push([resource], [job.engine_tag])
    stats.count("backoff")
    requeued = Job.objects.filter(id=job.id, generation=job.generation, status=JobStatus.RUNNING).update(
        status=JobStatus.QUEUED, generation=F("generation") + 1, admitted_at=None, worker=""
    )
    job_release(tag=job.engine_tag, engine_id=job.engine_id, keys=job.engine_key_names or None)
    if requeued:
        again = list(Job.objects.select_related("tenant__shard").filter(id=job.id, status=JobStatus.QUEUED))
        jobs_admit(again, policy=policy, enter_cells=True)  # it waits again, from when it first waited
    return "backoff"


def job_resources_succeeded(job: Job) -> None:
    """A job that called resources succeeded: each recovers a little (after its recovery
    time); where that gives a whole slot more, the new limit is pushed at once. A statistic
    as far as the job is concerned: a failure here is logged, never raised."""
    try:
        policy = policy_snapshot()
        raised = []
        for name in known_resources(policy, job.resource_names):
            resource = policy.resources[name]
            was, now = resource_succeeded(resource)
            if clamp_slots(now, resource.limit) > clamp_slots(was, resource.limit):
                raised.append(resource)
        if raised:
            resource_limits_push(raised, [job.engine_tag])
    except Exception:
        log.warning("could not record the success of job %s with its resources", job.id, exc_info=True)
