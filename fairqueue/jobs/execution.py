"""Running one delivery of a job on a worker: claim it, run its task, record the outcome,
release its slots. The claim is a conditional update keyed on the job's generation, so a
stale or duplicate message does nothing.

When the release hands the freed slot to a job this worker may run
(fairqueue.jobs.handoff), the same delivery runs that job next, in the same slot, with
the same claim and lease, and so on: a chain of jobs under one broker message, which is
acknowledged when the chain ends (at most MAX_INLINE_CHAIN jobs).
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from typing import Any

import redis
from django.conf import settings
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from fairqueue.engine import Woken
from fairqueue.jobs import cells, handback, live, payloads, stats
from fairqueue.jobs.admission import key_names, shard_tag
from fairqueue.jobs.broker import split_engine_id
from fairqueue.jobs.dispatch import KeepPick, job_release, job_release_keeping, jobs_admit, outcomes_handle
from fairqueue.jobs.handoff import inline_pick
from fairqueue.jobs.leases import active_leases
from fairqueue.jobs.models import KEY_SEPARATOR, TERMINAL_STATUSES, Job, JobStatus
from fairqueue.jobs.registry import HoldLost, JobContext, task_get
from fairqueue.jobs.runtime import engine

log = logging.getLogger("fairqueue.jobs.execution")

# A chain of inline handoffs runs under its first job's broker message, acknowledged when
# the chain ends; past this many jobs the next is published instead, so a delivery is
# acknowledged at least every so many jobs (what the broker and `celery inspect` show of
# this worker stays current, and a redelivery after a visibility timeout stays rare; it
# would be harmless: the generation guard skips a job already run).
MAX_INLINE_CHAIN = 100


def job_execute(*, job_id: str, generation: int, worker: str) -> str:
    """Run one delivery of a job, then each job its releases hand this slot (see the
    module docstring); returns what happened to the delivered job (for logs and tests)."""
    outcome, kept = _delivery_run(job_id=job_id, generation=generation, worker=worker, keep=inline_pick)
    chain = 1
    while kept is not None:
        chain += 1
        stats.count("handoff:inline")
        kept_id, kept_generation = split_engine_id(kept.job_id)
        try:
            _, kept = _delivery_run(
                job_id=kept_id,
                generation=kept_generation,
                worker=worker,
                keep=inline_pick if chain < MAX_INLINE_CHAIN else None,
            )
        except Exception:
            # Whatever failed (the database, say), the job must not sit on its slot without
            # a delivery: publish it. Had it been claimed already, that delivery is skipped.
            if kept is not None:
                outcomes_handle(woken=[kept], reclaimed=[])
            raise
    return outcome


def _delivery_run(*, job_id: str, generation: int, worker: str, keep: KeepPick | None) -> tuple[str, Woken | None]:
    """Run one job; returns what happened and the woken job `keep` picked to run next."""
    waiting = [JobStatus.QUEUED, JobStatus.PARKED]
    job = (
        Job.objects.select_related("tenant__shard").filter(id=job_id, generation=generation, status__in=waiting).first()
    )
    if job is None:
        # Stale generation, cancelled, or already run: the guard that makes it once.
        return "skipped", _release_if_finished(job_id, generation, keep)
    if not job.engine_tag:  # a row from before placements were stored
        job.engine_tag = shard_tag(job.tenant.shard.name)
        job.engine_keys = KEY_SEPARATOR.join(
            key_names(tenant_slug=job.tenant.slug, sub_tenant=job.sub_tenant, batch=job.in_batch_lane)
        )
    tag = job.engine_tag
    # Rolling deploys: a job this worker's version cannot run goes back for another worker.
    cannot = handback.refusal(job)
    if cannot:
        return handback.hand_back(job, cannot, worker=worker), None
    # Shorten the hold from the dispatch lease to the running one *before* claiming the job:
    # a worker killed between the two then leaves a queued job whose hold runs out within
    # one running lease (and is re-delivered without counting a loss). Claiming first left a
    # `running` job holding its slots for the whole dispatch lease (a CI run hit that window).
    lease = float(settings.FAIRQUEUE["LEASE_SECONDS"])
    try:
        if active_leases.fenced():
            # This worker cannot confirm the holds it has: take no new job until it can.
            raise redis.ConnectionError("worker fenced: its lease renewals are not confirmed")
        renewed = engine().renew(tag=tag, job_id=job.engine_id, lease_seconds=lease)
    except redis.RedisError:
        # Whether we hold the slot is unknown until Redis is back: hand the job to the
        # pending sweep, which admits it again (or finds it held) and publishes it then.
        Job.objects.filter(id=job_id, generation=generation, status__in=waiting).update(
            status=JobStatus.QUEUED, admitted_at=None
        )
        return "engine_unreachable", None
    if not renewed:
        # The hold was reclaimed before we started (the dispatch lease ran out): the job has
        # been or will be re-delivered under a new generation.
        return "lost", None
    now = timezone.now()
    claimed = Job.objects.filter(id=job_id, generation=generation, status__in=waiting).update(
        status=JobStatus.RUNNING,
        started_at=now,
        admitted_at=Coalesce("admitted_at", Value(now)),
        attempts=F("attempts") + 1,
        worker=worker,
    )
    if not claimed:
        return "skipped", None  # claimed by another delivery in between: it renews the hold itself
    cells.jobs_leave([str(job.id)])
    # The row is as read above (the claim's filter guarantees it) but for what the claim set;
    # the task reads its attempt number.
    job.attempts += 1
    active_leases.add(job.engine_id, tag, batch=job.in_batch_lane)
    outcome = "succeeded"
    fields: dict[str, Any] = {}
    try:
        registered = task_get(job.task)
        if registered is None:
            raise LookupError(f"task {job.task!r} is not registered on this worker")
        raw_args = payloads.payload_get(job.args_ref) if job.args_ref else job.args
        args = registered.args_model.model_validate(raw_args)
        ctx = JobContext(job_id=str(job.id), attempt=job.attempts, worker=worker, generation=generation)
        ctx.bind_hold(lambda: active_leases.hold_lost(job.engine_id))
        value = registered.func(ctx, args)
        encoded = payloads.payload_encode(value)
        if len(encoded) > payloads.payload_threshold():
            fields.update(result=None, result_ref=payloads.payload_put(data=encoded, kind="results"))
        else:
            fields.update(result=json.loads(encoded))
        fields["status"] = JobStatus.SUCCEEDED
    except HoldLost:
        # Fenced: another delivery may own the job now. Record and release nothing: the
        # engine reclaims the hold when its lease ends and the job is delivered again
        # (the finally below stops renewing it).
        log.warning("job %s generation %s fenced at %.3f: stopped, its hold is lost", job_id, generation, time.time())
        return "fenced", None
    except Exception as exc:
        outcome = "failed"
        fields.update(
            status=JobStatus.FAILED,
            error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"[:10_000],
            error_reason="exception",
        )
    finally:
        lost = active_leases.remove(job.engine_id)
    finished = timezone.now()
    fields["finished_at"] = finished
    if lost:
        log.warning("job %s lost its hold while running; a newer delivery owns it", job_id)
    if Job.objects.filter(id=job_id, generation=generation, status=JobStatus.RUNNING).update(**fields):
        stats.count(f"finished:{fields['status']}")
    kept = job_release_keeping(job, keep)
    try:
        live.record_finish(tenant_slug=job.tenant.slug, seconds=(finished - now).total_seconds(), batch=job.batch)
    except Exception:  # a statistic; the job's outcome is already recorded
        log.warning("could not record the duration of job %s", job_id, exc_info=True)
    return outcome, kept


def _release_if_finished(job_id: str, generation: int, keep: KeepPick | None) -> Woken | None:
    """A delivery of a job that finished (say, cancelled while its admission was in
    flight) may still hold the slots it was admitted with: give them back now rather than
    when its dispatch lease runs out. A no-op in the engine if nothing is held."""
    job = Job.objects.filter(id=job_id, generation=generation, status__in=sorted(TERMINAL_STATUSES)).first()
    if job is not None and job.engine_tag:
        return job_release_keeping(job, keep)
    return None


def job_requeue_graceful(*, engine_id: str, tag: str) -> bool:
    """Hand a running job back because its worker is shutting down on purpose.

    Unlike a reclaim after a crash, this is not the job's fault: worker_losses is not
    incremented, so scaling in never turns a job into a poison pill.
    """
    job_id, gen = split_engine_id(engine_id)
    moved = Job.objects.filter(id=job_id, generation=gen, status=JobStatus.RUNNING).update(
        status=JobStatus.QUEUED, generation=gen + 1, admitted_at=None, worker=""
    )
    job_release(tag=tag, engine_id=engine_id)
    if moved:
        again = list(Job.objects.select_related("tenant__shard").filter(id=job_id))
        cells.jobs_place(again)
        jobs_admit(again)
    return bool(moved)
