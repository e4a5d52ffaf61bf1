"""Running one delivery of a job on a worker: claim it, run its task, record the outcome,
release its slots. The claim is a conditional update keyed on the job's generation, so a
stale or duplicate message does nothing.

When the release hands the freed slot to a job this worker may run
(fairqueue.jobs.handoff), the same delivery runs that job next, in the same slot, with
the same claim and lease, and so on; when a release hands it nothing, the slot takes the
broker's next delivery itself (pulled: fairqueue.jobs.handoff). A chain of jobs under one
broker message, which is acknowledged when the chain ends (at most MAX_INLINE_CHAIN jobs).
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import redis
from django.utils import timezone

from fairqueue import tracing
from fairqueue.backoff import Backoff
from fairqueue.conf import fq_settings
from fairqueue.engine import Woken
from fairqueue.jobs import fanout, groupcommit, handback, live, payloads, stats, task_events
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.admission import key_names, shard_tag
from fairqueue.jobs.backoff import job_back_off, job_resources_succeeded
from fairqueue.jobs.broker import delivery_unpull, split_engine_id
from fairqueue.jobs.database import TRANSIENT_DB_ERRORS, db_wait
from fairqueue.jobs.dispatch import KeepPick, job_release, job_release_keeping, jobs_admit, outcomes_handle
from fairqueue.jobs.handoff import inline_pick, next_delivery
from fairqueue.jobs.isolation import isolated_run
from fairqueue.jobs.leases import active_leases
from fairqueue.jobs.models import KEY_SEPARATOR, TERMINAL_STATUSES, Job, JobStatus
from fairqueue.jobs.registry import HoldLost, JobContext, task_get
from fairqueue.jobs.retries import attempt_end_fields
from fairqueue.jobs.retry_policy import NO_RETRY
from fairqueue.jobs.runtime import engine
from fairqueue.jobs.task_limits import effective_timeout, failure_reason

log = logging.getLogger("fairqueue.jobs.execution")

# A chain of inline handoffs and pulled deliveries runs under its first job's broker
# message, acknowledged when the chain ends; past this many jobs the next is published (or
# left to Celery's consumer) instead, so a delivery is acknowledged at least every so many
# jobs (what the broker and `celery inspect` show of this worker stays current, and a
# redelivery after a visibility timeout stays rare; it would be harmless: the generation
# guard skips a job already run).
MAX_INLINE_CHAIN = 100


def job_execute(*, job_id: str, generation: int, worker: str) -> str:
    """Run one delivery of a job, then what the slot takes next without a broker message
    of its own: each job its releases hand it, else the broker's next delivery, pulled
    (see the module docstring); returns what happened to the delivered job (for logs and
    tests)."""
    outcome, kept = _delivery_run(job_id=job_id, generation=generation, worker=worker, keep=inline_pick)
    chain = 1
    while chain < MAX_INLINE_CHAIN:
        keep = inline_pick if chain + 1 < MAX_INLINE_CHAIN else None
        if kept is not None:
            stats.count("handoff:inline")
            kept_id, kept_generation = split_engine_id(kept.job_id)
            try:
                _, kept = _delivery_run(
                    job_id=kept_id, generation=kept_generation, worker=worker, keep=keep, inline=True
                )
            except Exception:
                # Whatever failed (the database, say), the job must not sit on its slot without
                # a delivery: publish it. Had it been claimed already, that delivery is skipped.
                if kept is not None:
                    outcomes_handle(woken=[kept], reclaimed=[])
                raise
        else:
            pulled = next_delivery()
            if pulled is None:
                break
            stats.count("delivery:pulled")
            try:
                _, kept = _delivery_run(job_id=pulled.job_id, generation=pulled.generation, worker=worker, keep=keep)
            except Exception:
                # The same for a pulled delivery: back to the broker (a second delivery of a
                # job claimed meanwhile is skipped by the generation guard).
                delivery_unpull(pulled)
                raise
        chain += 1
    return outcome


def _delivery_run(
    *, job_id: str, generation: int, worker: str, keep: KeepPick | None, inline: bool = False
) -> tuple[str, Woken | None]:
    """Run one job; returns what happened and the woken job `keep` picked to run next.
    `inline`: the job was handed this slot by the release before it, with no delivery."""
    # On its way to a claim: a claim batch forming now waits a moment for it.
    with groupcommit.claims.expecting() as arrived:
        return _delivery_run_expected(
            job_id=job_id, generation=generation, worker=worker, keep=keep, inline=inline, arrived=arrived
        )


def _delivery_run_expected(
    *, job_id: str, generation: int, worker: str, keep: KeepPick | None, inline: bool, arrived: Callable[[], None]
) -> tuple[str, Woken | None]:
    # The database may be away (a restart, a failover): wait for it rather than drop the
    # delivery. The slot's hold stays on its dispatch lease meanwhile.
    job = db_wait(
        lambda: groupcommit.job_for_delivery(job_id=job_id, generation=generation), what=f"reading job {job_id}"
    )
    if job is None:
        # Stale generation, cancelled, or already run: the guard that makes it once.
        arrived()
        return "skipped", _release_if_finished(job_id, generation, keep)
    # In the job's own trace: under the broker delivery's span when it came through the
    # broker, else (an inline handoff) under its submit, linked to the job before it.
    with tracing.span(
        "fairqueue.run",
        parent=job.traceparent,
        job_id=str(job.id),
        generation=generation,
        tenant=job.tenant.slug,
        sub_tenant=job.sub_tenant or None,
        shard=job.tenant.shard.name,
        latency_class=job.latency_class,
        batch=job.in_batch_lane,
        task=job.task,
        worker=worker,
        inline=inline,
    ):
        outcome, kept = _job_run(job, worker=worker, keep=keep, inline=inline, arrived=arrived)
        tracing.set_attributes(outcome=outcome)
        return outcome, kept


def _job_run(
    job: Job, *, worker: str, keep: KeepPick | None, inline: bool, arrived: Callable[[], None]
) -> tuple[str, Woken | None]:
    """`arrived`: this thread comes to no claim batch after all (called by the claim, or
    on any way out before it)."""
    job_id, generation = str(job.id), job.generation
    waiting = [JobStatus.QUEUED, JobStatus.PARKED]
    if not job.engine_tag:  # a row from before placements were stored
        job.engine_tag = shard_tag(job.tenant.shard.name)
        job.engine_keys = KEY_SEPARATOR.join(
            key_names(
                tenant_slug=job.tenant.slug,
                sub_tenant=job.sub_tenant,
                batch=job.in_batch_lane,
                document=job.document,
                quarantined=job.quarantined,
            )
        )
    tag = job.engine_tag
    # Rolling deploys: a job this worker's version cannot run goes back for another worker.
    cannot = handback.refusal(job)
    if cannot:
        arrived()
        return handback.hand_back(job, cannot, worker=worker), None
    # Shorten the hold from the dispatch lease to the running one *before* claiming the job:
    # a worker killed between the two then leaves a queued job whose hold runs out within
    # one running lease (and is re-delivered without counting a loss). Claiming first left a
    # `running` job holding its slots for the whole dispatch lease (a CI run hit that window).
    lease = float(fq_settings().LEASE_SECONDS)
    try:
        if active_leases.fenced():
            # This worker cannot confirm the holds it has: take no new job until it can.
            raise redis.ConnectionError("worker fenced: its lease renewals are not confirmed")
        renewed = engine().renew(tag=tag, job_id=job.engine_id, lease_seconds=lease)
    except redis.RedisError:
        arrived()
        # Whether we hold the slot is unknown until Redis is back: hand the job to the
        # pending sweep, which admits it again (or finds it held) and publishes it then.
        Job.objects.filter(id=job_id, generation=generation, status__in=waiting).update(
            status=JobStatus.QUEUED,
            admitted_at=None,
            timeline=tl.appended(tl.line(tl.PENDING, "engine unreachable at start")),
        )
        return "engine_unreachable", None
    if not renewed:
        arrived()
        # The hold was reclaimed before we started (the dispatch lease ran out): the job has
        # been or will be re-delivered under a new generation.
        return "lost", None
    now = timezone.now()
    steps = [tl.line(tl.STARTED, worker, at=now)]
    if inline:  # handed this slot by a release: nobody else writes its wake-up
        steps.insert(0, tl.line(tl.WOKEN, "inline", at=now))

    # Renewed from here on, also while the claim waits for an unreachable database.
    active_leases.add(job.engine_id, tag, batch=job.in_batch_lane)
    # The compare-and-set, sent with the claims other threads make now (groupcommit).
    if not _claim(job, worker=worker, now=now, lines="".join(steps), arrived=arrived):
        active_leases.remove(job.engine_id)
        return "skipped", None  # claimed by another delivery in between: it renews the hold itself
    tracing.event("started", attempt=job.attempts + 1, worker=worker)
    tracing.job_span_hold(job.engine_id)
    # The row is as read above (the claim's filter guarantees it) but for what the claim set;
    # the task reads its attempt number.
    job.attempts += 1
    job.started_at = now
    task_events.run_started(
        job_id=job_id,
        task=job.task,
        tenant=job.tenant.slug,
        sub_tenant=job.sub_tenant,
        attempt=job.attempts,
        args={"ref": job.args_ref} if job.args_ref else job.args,
    )
    outcome = "succeeded"
    fields: dict[str, Any] = {}
    retry_policy = NO_RETRY
    fanned_out = False
    in_task = False  # only an error the task itself raised is retried (fairqueue.jobs.retries)
    task_error: BaseException | None = None
    summary = ""
    try:
        registered = task_get(job.task)
        if registered is None:
            raise LookupError(f"task {job.task!r} is not registered on this worker")
        retry_policy = registered.retry
        raw_args = payloads.payload_get(job.args_ref) if job.args_ref else job.args
        args = registered.args_model.model_validate(raw_args)
        ctx = JobContext(
            job_id=str(job.id),
            attempt=job.attempts,
            worker=worker,
            generation=generation,
            timeout_seconds=effective_timeout(registered.timeout_seconds, job.timeout_seconds),
        )
        ctx.bind_hold(lambda: active_leases.hold_lost(job.engine_id))
        ctx.bind_children(
            lambda task, args, then, max_fan_out: fanout.children_submit(
                parent_id=job_id, generation=generation, task=task, args=args, then=then, max_fan_out=max_fan_out
            )
        )
        in_task = True
        if registered.isolated:  # in a child process, killed at its limits (fairqueue.jobs.isolation)
            value = isolated_run(
                task=registered.name, raw_args=raw_args, ctx=ctx, memory_limit_mb=registered.memory_limit_mb
            )
        else:  # in this thread: past its timeout, ctx.check_deadline() stops it
            value = registered.func(ctx.start_clock(), args)
        in_task = False
        fanned_out = ctx.fanned_out
        encoded = payloads.payload_encode(value)
        if len(encoded) > payloads.payload_threshold():
            fields.update(result=None, result_ref=payloads.payload_put(data=encoded, kind="results"))
        else:
            fields.update(result=json.loads(encoded))
        fields["status"] = JobStatus.SUCCEEDED
        if job.attempt_failures:  # an earlier attempt's error stays in attempt_history only
            fields.update(error="", error_reason="")
    except HoldLost:
        # Fenced: another delivery may own the job now. Record and release nothing: the
        # engine reclaims the hold when its lease ends and the job is delivered again.
        _holding_end(job)
        task_events.run_retried(job_id=job_id, exception="HoldLost: another delivery may own the job")
        log.warning("job %s generation %s fenced at %.3f: stopped, its hold is lost", job_id, generation, time.time())
        return "fenced", None
    except Backoff as refusal:
        # An outside resource refused it: back to wait, not failed (fairqueue.jobs.backoff).
        _holding_end(job)
        task_events.run_retried(job_id=job_id, exception=f"Backoff: {refusal}")
        return job_back_off(job, refusal, started=now), None
    except Exception as exc:
        outcome = "failed"
        reason = failure_reason(exc)  # "timeout", "memory_limit", "crashed" or "exception"
        task_error = exc if in_task else None
        summary = f"{type(exc).__name__}: {exc}"
        fields.update(
            status=JobStatus.FAILED,
            error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"[:10_000],
            error_reason=reason,
        )
        stats.count(f"attempt_failed:{reason}")
    except BaseException:  # the thread is being torn down: nothing more is recorded here
        _holding_end(job)
        raise
    tracing.job_span_drop(job.engine_id)
    lost = active_leases.hold_lost(job.engine_id)
    finished = timezone.now()
    fields["finished_at"] = finished
    fields.update(
        attempt_end_fields(
            job=job,
            policy=retry_policy,
            worker=worker,
            started=now,
            finished=finished,
            failed=outcome == "failed",
            task_error=task_error,
            error=summary,
            error_reason=fields.get("error_reason", ""),
        )
    )
    if fanned_out and fields["status"] == JobStatus.SUCCEEDED:
        # Its children run now, and their join decides its end (fairqueue.jobs.fanout): it
        # waits for them holding no slot (released below like any finished attempt's).
        outcome = "awaiting"
        fields.update(status=JobStatus.AWAITING, result=None, result_ref="", finished_at=None)
        lines = [tl.line(tl.AWAITING, at=finished)]
        tracing.event("awaiting children")
    elif fields["status"] == JobStatus.RETRYING:
        outcome = "retrying"
        due_at = fields["due_at"].isoformat(timespec="milliseconds")
        lines = [
            tl.line(tl.ATTEMPT_FAILED, f"{job.attempts} {fields['error_reason']}", at=finished),
            tl.line(tl.RETRY_SCHEDULED, due_at, at=finished),
        ]
        tracing.event("attempt failed", attempt=job.attempts, reason=fields["error_reason"], lost=lost)
        tracing.event("retry scheduled", due_at=due_at)
    else:
        lines = [tl.line(tl.FINISHED, fields["status"], at=finished)]
        tracing.event("finished", status=str(fields["status"]), lost=lost)
    if lost:
        log.warning("job %s lost its hold while running; a newer delivery owns it", job_id)
    # The compare-and-set on `running` that makes the attempt's end final, sent with the
    # outcomes other threads record now (groupcommit); alone, its own statement (job_finish).
    # While the database is away it waits, the hold still renewed: the job's outcome is
    # kept, not failed (were the worker to die meanwhile, the job runs again).
    try:
        recorded = db_wait(
            lambda: groupcommit.job_outcome(job, fields=fields, lines=lines),
            what=f"recording the outcome of job {job_id}",
        )
    finally:
        active_leases.remove(job.engine_id)
    if recorded:
        stats.count({"retrying": "retried", "awaiting": "fanout:parents"}.get(outcome, f"finished:{fields['status']}"))
        if job.resources and fields["status"] in (JobStatus.SUCCEEDED, JobStatus.AWAITING):
            job_resources_succeeded(job)
    try:
        _run_events(job_id, recorded=recorded, outcome=outcome, fields=fields, error=summary, runtime=finished - now)
    except Exception:  # Celery's monitoring only: the outcome is recorded, the slot must be released
        log.warning("could not send the task event of job %s", job_id, exc_info=True)
    kept = job_release_keeping(job, keep)
    # After the release: the join may submit the continuation, which may take this slot.
    if recorded and outcome == "awaiting":
        _join_safely(job)
    elif recorded and job.parent_id is not None and fields["status"] in TERMINAL_STATUSES:
        fanout.child_finished_safely(job)
    try:
        live.record_finish(tenant_slug=job.tenant.slug, seconds=(finished - now).total_seconds(), batch=job.batch)
    except Exception:  # a statistic; the job's outcome is already recorded
        log.warning("could not record the duration of job %s", job_id, exc_info=True)
    return outcome, kept


def _join_safely(parent: Job) -> None:
    """The parent's own run just ended awaiting: its children may all have ended already."""
    try:
        fanout.parent_join(parent.id)
    except Exception:
        log.exception("join check of parent %s failed; the duty's sweep joins it", parent.id)


def _run_events(
    job_id: str, *, recorded: bool, outcome: str, fields: dict[str, Any], error: str, runtime: timedelta
) -> None:
    """The run's last event for Celery's tools (fairqueue.jobs.task_events). An outcome the
    compare-and-set refused (the job was cancelled, or another delivery owns it) is revoked."""
    if not recorded:
        task_events.run_revoked(job_id=job_id)
    elif outcome == "succeeded":
        result = fields.get("result") if fields.get("result_ref") is None else {"ref": fields["result_ref"]}
        task_events.run_succeeded(job_id=job_id, result=result, runtime=runtime.total_seconds())
    elif outcome == "awaiting":  # a fan-out parent's own run ended well: its children run next
        task_events.run_succeeded(job_id=job_id, result=None, runtime=runtime.total_seconds())
    elif outcome == "retrying":
        task_events.run_retried(job_id=job_id, exception=error, traceback=fields["error"])
    else:
        task_events.run_failed(job_id=job_id, exception=error, traceback=fields["error"])


def _holding_end(job: Job) -> None:
    """Stop renewing the job's hold (and its span's), on a way out that records nothing."""
    active_leases.remove(job.engine_id)
    tracing.job_span_drop(job.engine_id)


def _claim(job: Job, *, worker: str, now: datetime, lines: str, arrived: Callable[[], None]) -> bool:
    """The claim's compare-and-set, waiting out an unreachable database. A claim whose
    commit reached the server but whose answer was lost to the outage finds the row taken
    when it is sent again: by this very delivery if the row says so (same worker, same
    start), which then counts as won."""
    job_id, generation = str(job.id), job.generation
    interrupted = False

    def attempt() -> bool:
        nonlocal interrupted
        try:
            return groupcommit.job_claim(
                job_id=job_id, generation=generation, worker=worker, now=now, lines=lines, arrived=arrived
            )
        except TRANSIENT_DB_ERRORS:
            interrupted = True
            raise

    won = db_wait(attempt, what=f"claiming job {job_id}")
    if not won and interrupted:
        won = Job.objects.filter(
            id=job_id, generation=generation, status=JobStatus.RUNNING, worker=worker, started_at=now
        ).exists()
    return won


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
        status=JobStatus.QUEUED,
        generation=gen + 1,
        admitted_at=None,
        worker="",
        timeline=tl.appended(tl.line(tl.REQUEUED, "worker shutting down")),
    )
    job_release(tag=tag, engine_id=engine_id)
    if moved:
        jobs_admit(list(Job.objects.select_related("tenant__shard").filter(id=job_id)), enter_cells=True)
    return bool(moved)
