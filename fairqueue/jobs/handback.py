"""Rolling-deploy safety: a worker hands back a delivery it cannot run.

During a rolling deploy old and new workers consume the same queues. A worker that gets a
job whose task it does not know, or whose arguments its version of the task does not
accept, gives the delivery back before claiming it: it gives the job's slots back and the
job is admitted again like a new one (at once if there is room, else it waits its turn in
fair order), to be published for another worker. No slot is held by a job that no live
worker can run: the pool's slots are capped at the live slots
(fairqueue.jobs.admission.pool_room), and jobs only new workers know must not fill them.
Nothing is counted against the job (no attempt, no worker loss). Each hand-back waits a
little longer before giving the slot back (BACKOFF_*), so a worker that keeps drawing the
same job does not spin on it. The wait is jittered: Redis hands a pushed message to the
consumer that has waited longest in BRPOP, kombu renews an idle BRPOP every second, and
the refusing worker's free slot re-entered BRPOP the moment it took the job, so a wait of
whole seconds published each time just as that worker's BRPOP was the oldest, and it drew
the job again and again while a worker that could run it sat idle. Once the job has been
handed back for longer than `FAIRQUEUE_HANDBACK_SECONDS` since the first time, it ends
`failed` with `error_reason = "unknown_task"` and its slots are released.
"""

from __future__ import annotations

import logging
import random
import time

from django.utils import timezone
from pydantic import ValidationError

from fairqueue.conf import fq_settings
from fairqueue.jobs import cells, payloads, stats
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.dispatch import job_release_or_defer, jobs_admit
from fairqueue.jobs.models import WAITING_STATUSES, Job, JobStatus
from fairqueue.jobs.registry import task_get
from fairqueue.jobs.runtime import engine, redis_client
from webhooks.outbox import job_finish

log = logging.getLogger("fairqueue.jobs.handback")

UNKNOWN_TASK = "unknown_task"
BACKOFF_FIRST_SECONDS = 0.2
BACKOFF_MAX_SECONDS = 5.0
BACKOFF_JITTER = 0.5  # each wait is drawn from [1 - this, 1] of its step
HANDBACK_KEY_PREFIX = "fq:handback:"  # HASH per job: first (unix s), count


def handback_key(job_id: str) -> str:
    return f"{HANDBACK_KEY_PREFIX}{job_id}"


def refusal(job: Job) -> str | None:
    """Why this worker cannot run the job (None when it can): an unknown task, or
    arguments its version of the task does not accept."""
    registered = task_get(job.task)
    if registered is None:
        return f"task {job.task!r} is not registered on this worker"
    try:
        registered.args_model.model_validate(payloads.payload_get(job.args_ref) if job.args_ref else job.args)
    except ValidationError as exc:
        return f"this worker's {job.task!r} does not accept the arguments: {exc.error_count()} error(s)"
    return None


def hand_back(job: Job, reason: str, *, worker: str) -> str:
    """Give the delivery back (or fail it past the time limit); returns the outcome."""
    limit = float(fq_settings().HANDBACK_SECONDS)
    key = handback_key(str(job.id))
    client = redis_client()
    now = time.time()
    pipe = client.pipeline(transaction=True)
    pipe.hsetnx(key, "first", now)
    pipe.hincrby(key, "count", 1)
    pipe.hget(key, "first")
    pipe.expire(key, int(2 * limit) + 60)
    _, count, first, _ = pipe.execute()
    if now - float(first) >= limit:
        return _fail(job, reason, count=int(count), key=key)
    renewed = engine().renew(
        tag=job.engine_tag, job_id=job.engine_id, lease_seconds=float(fq_settings().DISPATCH_LEASE_SECONDS)
    )
    if not renewed:
        return "lost"  # the hold was reclaimed: the job is (or will be) re-delivered anyway
    # Wait before giving it back, longer each time: the worker that drew the job is busy with
    # this slot meanwhile, so another worker (one that knows the task) is likelier to take it.
    step = min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** (int(count) - 1))
    time.sleep(step * random.uniform(1 - BACKOFF_JITTER, 1))
    # Its slots go to whoever waits for them; the job is admitted again in its turn and
    # published then (the same generation: any copy of this delivery is one claim).
    if job_release_or_defer(job):
        jobs_admit([job])
    stats.count("handed_back")
    log.warning("worker %s handed job %s back (%s), %d time(s) so far", worker, job.id, reason, count)
    return "handed_back"


def _fail(job: Job, reason: str, *, count: int, key: str) -> str:
    failed = job_finish(
        job,
        where={"id": job.id, "generation": job.generation, "status__in": sorted(WAITING_STATUSES)},
        fields={
            "status": JobStatus.FAILED,
            "error_reason": UNKNOWN_TASK,
            "error": f"No worker ran this job within {fq_settings().HANDBACK_SECONDS:g} s: handed back "
            f"{count} time(s); the last worker said {reason}.",
            "finished_at": timezone.now(),
            "timeline": tl.appended(tl.line(tl.FINISHED, f"{JobStatus.FAILED} {UNKNOWN_TASK}")),
        },
    )
    redis_client().delete(key)
    if not failed:
        return "skipped"  # cancelled or re-delivered meanwhile: that path owns the slots
    stats.count("finished:failed")
    cells.jobs_leave([str(job.id)])
    job_release_or_defer(job)
    log.warning("job %s failed as unknown_task after %d hand-back(s): %s", job.id, count, reason)
    return "failed"
