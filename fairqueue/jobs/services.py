"""Writes on the jobs side: submit, admit, dispatch, execute, release, cancel, re-deliver.

The flow: a job row is committed first (the database is the truth), then the engine
admits or parks it in one round trip. Admitted jobs go to their class's Celery queue at
once; parked ones cost no worker slot and are dispatched by whichever release hands
them a slot. Workers claim a job with a conditional UPDATE keyed on its generation, so
stale or duplicate messages do nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
import traceback
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone
from pydantic import ValidationError as PydanticValidationError

from fairqueue.engine import Admission, AdmitRequest, Woken
from fairqueue.jobs import live, payloads, stats
from fairqueue.jobs.admission import admission_plan, key_names
from fairqueue.jobs.models import TERMINAL_STATUSES, Job, JobStatus
from fairqueue.jobs.registry import JobContext, task_get
from fairqueue.jobs.runtime import engine, queue_name
from tenants.limits import idle_shares
from tenants.models import Tenant
from tenants.policy import PolicySnapshot, policy_snapshot

log = logging.getLogger("fairqueue.jobs")

RUN_TASK_NAME = "fairqueue.run_job"
SUB_TENANT_RE = re.compile(r"^[\x21-\x7e]{1,200}$")  # printable ASCII, no spaces or control bytes
IDEMPOTENCY_MAX = 200
# Unheld slots are shared out up to slots * (1 + OVERCOMMIT): a job in transit to a worker
# holds a slot it is not yet using, and without a little overcommit workers would idle.
OVERCOMMIT = 0.125
BATCH_PROMOTE_AT = 0.75  # share of the batch objective after which a waiting batch job is promoted


class JobError(Exception):
    """A client error with the HTTP status, machine code and field it concerns."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field


@dataclass(frozen=True)
class JobRequest:
    task: str
    args: dict[str, Any] = field(default_factory=dict)
    sub_tenant: str | None = None
    priority: str | None = None
    batch: bool = False
    idempotency_key: str | None = None


@dataclass(frozen=True)
class SubmitResult:
    job: Job
    created: bool


# --- validation ------------------------------------------------------------------------


def _prepare(*, tenant: Tenant, policy: PolicySnapshot, req: JobRequest, where: str) -> Job:
    """Validate one request completely and build its (unsaved) row; raises JobError."""
    registered = task_get(req.task)
    if registered is None:
        raise JobError(400, "unknown_task", f"Unknown task {req.task!r}.", f"{where}task")
    if not isinstance(req.args, dict):
        raise JobError(400, "invalid_args", "args must be a JSON object.", f"{where}args")
    try:
        registered.args_model.model_validate(req.args)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise JobError(
            400, "invalid_args", f"Bad arguments for {req.task}: {loc}: {first['msg']}.", f"{where}args.{loc}"
        ) from None
    tenant_policy = policy.tenants.get(tenant.slug)
    class_name = req.priority or (tenant_policy.default_class if tenant_policy else "") or "default"
    latency_class = policy.classes.get(class_name)
    if latency_class is None:
        known = ", ".join(sorted(policy.classes))
        raise JobError(
            400, "unknown_priority", f"Unknown priority {class_name!r}; use one of: {known}.", f"{where}priority"
        )
    if req.batch and not tenant.batch_enabled:
        raise JobError(400, "batch_not_enabled", "This tenant has not opted into the batch lane.", f"{where}batch")
    sub = req.sub_tenant or ""
    if sub and not SUB_TENANT_RE.match(sub):
        raise JobError(
            400, "invalid_sub_tenant", "sub_tenant must be 1-200 printable ASCII characters.", f"{where}sub_tenant"
        )
    if req.idempotency_key is not None and not (0 < len(req.idempotency_key) <= IDEMPOTENCY_MAX):
        raise JobError(
            400,
            "invalid_idempotency_key",
            f"idempotency_key must be 1-{IDEMPOTENCY_MAX} characters.",
            f"{where}idempotency_key",
        )
    return Job(
        id=uuid.uuid4(),
        tenant=tenant,
        sub_tenant=sub,
        task=req.task,
        latency_class=class_name,
        priority=latency_class.rank,
        batch=req.batch,
        idempotency_key=req.idempotency_key,
        args=req.args,
    )


def _offload_large_args(jobs: Sequence[Job]) -> None:
    """Move arguments over the threshold to the payload store (after all jobs validated)."""
    threshold = payloads.payload_threshold()
    for job in jobs:
        encoded = payloads.payload_encode(job.args)
        if len(encoded) > threshold:
            job.args_ref = payloads.payload_put(data=encoded, kind="args")
            job.args = {}


def _discard_offloaded(jobs: Sequence[Job]) -> None:
    for job in jobs:
        if job.args_ref:
            payloads.payload_delete(job.args_ref)


# --- submit ---------------------------------------------------------------------------------


def job_submit(*, tenant: Tenant, req: JobRequest) -> SubmitResult:
    """Accept one job: same idempotency key, same job (and nothing new written)."""
    return job_submit_bulk(tenant=tenant, reqs=[req], single=True)[0]


def job_submit_bulk(*, tenant: Tenant, reqs: Sequence[JobRequest], single: bool = False) -> list[SubmitResult]:
    """Accept many jobs in one go: all valid or none written; Redis work in one pipeline."""
    policy = policy_snapshot()
    keys = [r.idempotency_key for r in reqs if r.idempotency_key is not None]
    if len(keys) != len(set(keys)):
        raise JobError(400, "duplicate_idempotency_key", "Two jobs in one request share an idempotency key.", "jobs")
    existing: dict[str, Job] = {}
    if keys:
        existing = {j.idempotency_key: j for j in Job.objects.filter(tenant=tenant, idempotency_key__in=keys)}  # type: ignore[misc]
    results: list[SubmitResult | None] = []
    fresh: list[Job] = []
    for i, req in enumerate(reqs):
        if req.idempotency_key is not None and req.idempotency_key in existing:
            results.append(SubmitResult(existing[req.idempotency_key], created=False))
            continue
        fresh.append(_prepare(tenant=tenant, policy=policy, req=req, where="" if single else f"jobs[{i}]."))
        results.append(None)
    if fresh:
        _offload_large_args(fresh)
        try:
            with transaction.atomic():
                Job.objects.bulk_create(fresh)
        except IntegrityError:
            # A concurrent request won the race on an idempotency key: answer with its jobs.
            _discard_offloaded(fresh)
            return job_submit_bulk(tenant=tenant, reqs=reqs, single=single)
        except BaseException:
            _discard_offloaded(fresh)
            raise
        live.record_submissions(tenant_slug=tenant.slug, count=len(fresh))
        stats.count("submitted", len(fresh))
        jobs_admit(fresh, policy=policy)
    it = iter(fresh)
    return [r if r is not None else SubmitResult(next(it), created=True) for r in results]


def jobs_admit(
    jobs: Sequence[Job],
    *,
    policy: PolicySnapshot | None = None,
    dispatch: bool = True,
    running: bool = False,
    rebuilding: bool = False,
) -> None:
    """Ask the engine for a slot for each job (one pipelined round trip); dispatch or park.

    Redis trouble here leaves the jobs `queued` in the database, where recovery admits
    them later (fairqueue.jobs.recovery). `running=True` re-enters jobs that are already
    running (after Redis lost its state) with a running lease and no dispatch.

    Normal admissions require the shard's engine tag to be ready: after Redis lost its
    state the engine does not know the jobs still running until a worker rebuilds it, and
    admitting a newcomer then could run a tenant above its limit. Such jobs stay `queued`
    with no admission; the rebuild (`rebuilding=True`, unguarded) or the pending sweep
    admits them. A shard with no unfinished job at all has nothing to rebuild: its tag is
    marked ready on the spot and the admission retried once (a fresh Redis, tests).
    """
    if not jobs:
        return
    try:
        _jobs_admit(
            jobs,
            policy=policy or policy_snapshot(),
            dispatch=dispatch,
            running=running,
            require_ready=not running and not rebuilding,
        )
    except redis.RedisError:
        log.warning("Redis unreachable: %d job(s) stay queued until it is back", len(jobs))


def _tags_init_if_idle(tags: set[str], policy: PolicySnapshot, exclude: Sequence[Job]) -> set[str]:
    """Mark ready each tag whose shard has no unfinished job besides `exclude` (nothing the
    engine could have lost, so nothing to rebuild); returns the tags marked."""
    from fairqueue.jobs.admission import shard_tag

    excluded = [j.id for j in exclude]
    ready: set[str] = set()
    for shard_name in policy.shards:
        tag = shard_tag(shard_name)
        if tag not in tags:
            continue
        busy = (
            Job.objects.filter(
                tenant__shard__name=shard_name,
                status__in=[JobStatus.RUNNING, JobStatus.QUEUED, JobStatus.PARKED],
            )
            .exclude(id__in=excluded)
            .exists()
        )
        if not busy:
            engine().init_tag(tag=tag)
            ready.add(tag)
    return ready


def _jobs_admit(
    jobs: Sequence[Job], *, policy: PolicySnapshot, dispatch: bool, running: bool, require_ready: bool
) -> None:
    lease_seconds = float(settings.FAIRQUEUE["LEASE_SECONDS" if running else "DISPATCH_LEASE_SECONDS"])
    items = []
    admitted_jobs = []
    for job in jobs:
        tp = policy.tenants.get(job.tenant.slug)
        if tp is None:
            continue
        plan = admission_plan(
            policy=policy,
            tenant=tp,
            sub_tenant=job.sub_tenant,
            priority=job.priority,
            signals=live.live_signals(tenant_slug=tp.slug),
            batch=job.in_batch_lane,
            # Batch work must see the pool as it is now, not as cached a second ago.
            batch_limit=live.fleet_state(max_age=0.05).batch_limit(tp.shard) if job.in_batch_lane else 0,
        )
        items.append(
            AdmitRequest(
                tag=plan.tag,
                job_id=job.engine_id,
                keys=plan.keys,
                priority=plan.priority,
                lease_seconds=lease_seconds,
                data=queue_name(job.latency_class, batch=job.in_batch_lane),
                require_ready=require_ready,
            )
        )
        admitted_jobs.append(job)
    started = time.perf_counter()
    outcomes: list[Admission] = engine().admit_many(items)
    stats.observe("admit", (time.perf_counter() - started) / max(len(items), 1))
    unready = [i for i, o in enumerate(outcomes) if o.not_ready]
    if unready:
        retry = _tags_init_if_idle({items[i].tag for i in unready}, policy, admitted_jobs)
        again = [i for i in unready if items[i].tag in retry]
        if again:
            for i, o in zip(again, engine().admit_many([items[i] for i in again]), strict=True):
                outcomes[i] = o
    if running:
        return
    now = timezone.now()
    waiting_ids = [j.id for j, o in zip(admitted_jobs, outcomes, strict=True) if o.not_ready]
    parked_ids = [j.id for j, o in zip(admitted_jobs, outcomes, strict=True) if not o.admitted and not o.not_ready]
    go_ids = [j.id for j, o in zip(admitted_jobs, outcomes, strict=True) if o.admitted]
    if waiting_ids:
        # Not admitted: recovery's pending sweep (or the state rebuild) admits them later.
        log.warning("scheduling state not rebuilt yet: %d job(s) wait for recovery", len(waiting_ids))
        Job.objects.filter(id__in=waiting_ids, status__in=[JobStatus.QUEUED, JobStatus.PARKED]).update(
            status=JobStatus.QUEUED, admitted_at=None
        )
    if parked_ids:
        Job.objects.filter(id__in=parked_ids, status=JobStatus.QUEUED).update(status=JobStatus.PARKED)
    if go_ids:
        Job.objects.filter(id__in=go_ids, status__in=[JobStatus.QUEUED, JobStatus.PARKED]).update(
            status=JobStatus.QUEUED, admitted_at=Coalesce("admitted_at", Value(now))
        )
    if not dispatch:
        return
    for job, outcome in zip(admitted_jobs, outcomes, strict=True):
        if outcome.admitted:
            if job.admitted_at is None:
                job.admitted_at = now
            job.status = JobStatus.QUEUED
            _send(job.engine_id, queue_name(job.latency_class, batch=job.in_batch_lane))
        elif outcome.not_ready:
            job.status = JobStatus.QUEUED
            job.admitted_at = None
        elif job.status == JobStatus.QUEUED:
            job.status = JobStatus.PARKED
    outcomes_handle(woken=[w for o in outcomes for w in o.woken], reclaimed=[r for o in outcomes for r in o.reclaimed])


# --- dispatch ----------------------------------------------------------------------------------


def _split_engine_id(engine_id: str) -> tuple[str, int]:
    job_id, _, gen = engine_id.rpartition(".")
    return job_id, int(gen)


_producers = threading.local()


def _producer() -> Any:
    """A long-lived producer per thread.

    Without it every dispatch from a worker thread set up a new broker connection and
    channel (and redis-py resolves its own version from package metadata per connection),
    which cost more than the whole rest of a handoff.
    """
    from fairqueue.celery import app

    producer = getattr(_producers, "producer", None)
    if producer is None:
        producer = app.amqp.Producer(app.connection_for_write(), auto_declare=False)
        _producers.producer = producer
    return producer


def _send(engine_id: str, queue: str) -> None:
    from fairqueue.celery import app

    job_id, gen = _split_engine_id(engine_id)
    try:
        app.send_task(RUN_TASK_NAME, args=[job_id, gen], queue=queue, producer=_producer())
    except Exception:
        # A broken cached connection: drop it and publish once more on a fresh one.
        _producers.producer = None
        app.send_task(RUN_TASK_NAME, args=[job_id, gen], queue=queue, producer=_producer())


def outcomes_handle(*, woken: Iterable[Woken], reclaimed: Iterable[Woken]) -> None:
    """Dispatch jobs the engine just handed slots to; re-deliver jobs whose lease ran out."""
    woken = list(woken)
    if woken:
        # Publish first: the slot is already theirs, and every millisecond here is a worker
        # slot held but idle. The claim accepts `parked` as well, so the order is safe.
        now = timezone.now()
        for w in woken:
            _send(w.job_id, w.data)
        ids = [_split_engine_id(w.job_id)[0] for w in woken]
        Job.objects.filter(id__in=ids, status=JobStatus.PARKED).update(status=JobStatus.QUEUED, admitted_at=now)
    reclaimed = list(reclaimed)
    if reclaimed:
        jobs_redeliver([r.job_id for r in reclaimed])


def jobs_redeliver(engine_ids: Iterable[str]) -> None:
    """A hold expired: its worker died (or the broker lost the message). Run it again, once."""
    poison_limit = int(settings.FAIRQUEUE["POISON_PILL_LIMIT"])
    again: list[Job] = []
    for engine_id in engine_ids:
        job_id, gen = _split_engine_id(engine_id)
        with transaction.atomic():
            job = Job.objects.select_for_update().select_related("tenant").filter(id=job_id, generation=gen).first()
            if job is None or job.status in TERMINAL_STATUSES:
                continue
            if job.status == JobStatus.RUNNING:
                job.worker_losses += 1
            job.generation += 1
            job.admitted_at = None
            if job.worker_losses >= poison_limit:
                job.status = JobStatus.FAILED
                job.error_reason = "worker_lost"
                job.error = f"Workers died {job.worker_losses} times running this job; not re-delivered again."
                job.finished_at = timezone.now()
                stats.count("finished:failed")
            else:
                job.status = JobStatus.QUEUED
                again.append(job)
            job.save(
                update_fields=[
                    "worker_losses",
                    "generation",
                    "admitted_at",
                    "status",
                    "error",
                    "error_reason",
                    "finished_at",
                ]
            )
        log.warning("re-delivering job %s (lease expired, generation %s)", job_id, gen)
    jobs_admit(again)


# --- cancel ----------------------------------------------------------------------------------


def job_cancel(*, job: Job) -> Job:
    """Cancel a job that has not started. A parked job gives up its place at once."""
    if job.status in TERMINAL_STATUSES:
        raise JobError(409, "not_cancellable", f"Job is already {job.status}.", None)
    if job.status == JobStatus.RUNNING:
        raise JobError(409, "not_cancellable", "Job is already running.", None)
    updated = Job.objects.filter(
        id=job.id, generation=job.generation, status__in=[JobStatus.QUEUED, JobStatus.PARKED]
    ).update(status=JobStatus.CANCELLED, finished_at=timezone.now())
    job.refresh_from_db()
    if not updated:
        raise JobError(409, "not_cancellable", f"Job is already {job.status}.", None)
    stats.count("finished:cancelled")
    tag = _tag_of(job)
    result = engine().release(tag=tag, job_id=job.engine_id)
    outcomes_handle(woken=result.woken, reclaimed=result.reclaimed)
    return job


def _tag_of(job: Job) -> str:
    from fairqueue.jobs.admission import shard_tag

    return shard_tag(job.tenant.shard.name)


# --- execute (worker side) ------------------------------------------------------------------------


class ActiveLeases:
    """Renews the holds of every job running in this process from one thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, str] = {}
        self._batch: set[str] = set()
        self._lost: set[str] = set()
        self._thread: threading.Thread | None = None

    def add(self, engine_id: str, tag: str, *, batch: bool = False) -> None:
        with self._lock:
            self._active[engine_id] = tag
            if batch:
                self._batch.add(engine_id)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fairqueue-lease-renewer", daemon=True)
                self._thread.start()

    def remove(self, engine_id: str) -> bool:
        """Stop renewing; True if the hold was lost to a reclaim while running."""
        with self._lock:
            self._active.pop(engine_id, None)
            self._batch.discard(engine_id)
            lost = engine_id in self._lost
            self._lost.discard(engine_id)
            return lost

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self._active)

    def count(self) -> tuple[int, int]:
        """(running jobs, of which batch-lane jobs) in this process."""
        with self._lock:
            return len(self._active), len(self._batch)

    def _run(self) -> None:
        lease = float(settings.FAIRQUEUE["LEASE_SECONDS"])
        while True:
            time.sleep(max(lease / 3, 0.2))
            with self._lock:
                items = list(self._active.items())
            for engine_id, tag in items:
                try:
                    if not engine().renew(tag=tag, job_id=engine_id, lease_seconds=lease):
                        with self._lock:
                            self._lost.add(engine_id)
                except Exception:  # keep renewing the others; a Redis blip must not kill this thread
                    log.exception("lease renew failed for %s", engine_id)


active_leases = ActiveLeases()


def job_execute(*, job_id: str, generation: int, worker: str) -> str:
    """Run one delivery of a job; returns what happened (for logs and tests)."""
    waiting = [JobStatus.QUEUED, JobStatus.PARKED]
    job = (
        Job.objects.select_related("tenant__shard").filter(id=job_id, generation=generation, status__in=waiting).first()
    )
    if job is None:
        return "skipped"  # stale generation, cancelled, or already run: the guard that makes it once
    tag = _tag_of(job)
    # Shorten the hold from the dispatch lease to the running one *before* claiming the job:
    # a worker killed between the two then leaves a queued job whose hold runs out within
    # one running lease (and is re-delivered without counting a loss). Claiming first left a
    # `running` job holding its slots for the whole dispatch lease (a CI run hit that window).
    lease = float(settings.FAIRQUEUE["LEASE_SECONDS"])
    if not engine().renew(tag=tag, job_id=job.engine_id, lease_seconds=lease):
        # The hold was reclaimed before we started (the dispatch lease ran out): the job has
        # been or will be re-delivered under a new generation.
        return "lost"
    now = timezone.now()
    claimed = Job.objects.filter(id=job_id, generation=generation, status__in=waiting).update(
        status=JobStatus.RUNNING,
        started_at=now,
        admitted_at=Coalesce("admitted_at", Value(now)),
        attempts=F("attempts") + 1,
        worker=worker,
    )
    if not claimed:
        return "skipped"  # claimed by another delivery in between: it renews the hold itself
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
        ctx = JobContext(job_id=str(job.id), attempt=job.attempts, worker=worker)
        value = registered.func(ctx, args)
        encoded = payloads.payload_encode(value)
        if len(encoded) > payloads.payload_threshold():
            fields.update(result=None, result_ref=payloads.payload_put(data=encoded, kind="results"))
        else:
            fields.update(result=json.loads(encoded))
        fields["status"] = JobStatus.SUCCEEDED
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
    hint = key_names(tenant_slug=job.tenant.slug, sub_tenant=job.sub_tenant, batch=job.in_batch_lane)
    job_release(tag=tag, engine_id=job.engine_id, keys=hint)
    live.record_finish(tenant_slug=job.tenant.slug, seconds=(finished - now).total_seconds(), batch=job.batch)
    return outcome


def batch_promote_due(*, now: float | None = None, limit: int = 200) -> int:
    """Move batch jobs out of the idle-capacity lane before their objective would be missed.

    A job is promoted once it has waited PROMOTE_AT of the batch objective; from then on it
    is admitted like any job of its latency class. Safe to run from many processes: the
    engine's cancel is atomic, so exactly one of them re-admits each job.
    """
    from datetime import timedelta

    policy = policy_snapshot()
    objective = policy.pool.batch_objective_seconds
    cutoff = timezone.now() - timedelta(seconds=objective * BATCH_PROMOTE_AT)
    due = list(
        Job.objects.select_related("tenant__shard")
        .filter(batch=True, promoted_at__isnull=True, status=JobStatus.PARKED, submitted_at__lte=cutoff)
        .order_by("submitted_at")[:limit]
    )
    promoted: list[Job] = []
    for job in due:
        result = engine().cancel(tag=_tag_of(job), job_id=job.engine_id)
        if not result.cancelled:
            continue  # woken meanwhile, or another process promoted it
        outcomes_handle(woken=result.woken, reclaimed=result.reclaimed)
        job.promoted_at = timezone.now()
        job.generation += 1
        job.status = JobStatus.QUEUED
        Job.objects.filter(id=job.id).update(promoted_at=job.promoted_at, generation=job.generation, status=job.status)
        promoted.append(job)
    jobs_admit(promoted, policy=policy)
    return len(promoted)


def limits_refresh() -> int:
    """Push every tenant's current limit (and each shard's batch room) to the engine.

    Limits travel with each admit, but a tenant whose jobs are all parked submits nothing;
    this tick is what lets a raised limit (idle pool, admin edit) wake its waiters within a
    second. It also shares the pool's unheld slots among tenants at their limit (see
    tenants.limits.idle_shares), which is what keeps the pool full under one big backlog.
    One round trip per shard to read holders, one per shard to set limits.
    """
    from fairqueue.jobs.admission import BATCH_KEY, SHARD_KEY, shard_tag, tenant_key, tenant_limit_for

    policy = policy_snapshot()
    fleet = live.fleet_state(max_age=0.05)  # the idle share must see the pool as it is now
    formulas: dict[str, int] = {}
    held: dict[str, int] = {}
    for shard_name in policy.shards:
        members = [tp for tp in policy.tenants.values() if tp.shard == shard_name]
        counts = engine().counts(tag=shard_tag(shard_name), keys=[tenant_key(tp.slug) for tp in members])
        for tp in members:
            signals = dataclasses.replace(live.live_signals(tenant_slug=tp.slug), idle_share=0)
            formulas[tp.slug] = tenant_limit_for(policy, tp, signals).limit
            held[tp.slug] = counts.get(tenant_key(tp.slug), 0)
    capped = {
        slug
        for slug, tp in policy.tenants.items()
        if tp.max_concurrency is not None and formulas.get(slug, 0) >= tp.max_concurrency + tp.dedicated
    }
    at_limit = {
        slug: (held[slug], formulas[slug]) for slug in formulas if held[slug] >= formulas[slug] and slug not in capped
    }
    shares = idle_shares(
        slots=fleet.slots, in_flight=fleet.in_flight + fleet.batch_in_flight, overcommit=OVERCOMMIT, demand=at_limit
    )
    live.idle_shares_publish(shares)
    woken = 0
    for shard_name, shard in policy.shards.items():
        limits = {SHARD_KEY: shard.capacity, BATCH_KEY: fleet.batch_limit(shard_name)}
        for tp in policy.tenants.values():
            if tp.shard == shard_name:
                limits[tenant_key(tp.slug)] = tenant_limit_for(policy, tp, live.live_signals(tenant_slug=tp.slug)).limit
        # An unready tag (state lost, rebuild pending) is left alone: the rebuild's admits
        # bring the limits, and waking waiters there could pass jobs the engine forgot.
        result = engine().set_limits(tag=shard_tag(shard_name), limits=limits, require_ready=True)
        if result:
            outcomes_handle(woken=result, reclaimed=[])
            woken += len(result)
    return woken


def job_requeue_graceful(*, engine_id: str, tag: str) -> bool:
    """Hand a running job back because its worker is shutting down on purpose.

    Unlike a reclaim after a crash, this is not the job's fault: worker_losses is not
    incremented, so scaling in never turns a job into a poison pill.
    """
    job_id, gen = _split_engine_id(engine_id)
    moved = Job.objects.filter(id=job_id, generation=gen, status=JobStatus.RUNNING).update(
        status=JobStatus.QUEUED, generation=gen + 1, admitted_at=None, worker=""
    )
    job_release(tag=tag, engine_id=engine_id)
    if moved:
        jobs_admit(list(Job.objects.select_related("tenant__shard").filter(id=job_id)))
    return bool(moved)


def job_release(*, tag: str, engine_id: str, keys: list[str] | None = None) -> None:
    started = time.perf_counter()
    result = engine().release(tag=tag, job_id=engine_id, keys=keys)
    stats.observe("release", time.perf_counter() - started)
    outcomes_handle(woken=result.woken, reclaimed=result.reclaimed)
