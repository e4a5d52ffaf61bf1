"""Accepting jobs: validate a request completely, write its row, then admit it.

The row is committed first (the database is the truth); the engine then admits or parks
the job in one round trip (fairqueue.jobs.dispatch). Bulk submissions are all valid or
none is written.

A submit costs one Redis round trip before anything is written (its quotas checked and
its jobs entered in their cells in one atomic call: fairqueue.jobs.quotas; a 429 past
them), one statement (a single INSERT, or one multi-row INSERT for a bulk, in one
transaction), one engine round trip and one broker round trip. The rows are written
`queued` with `admitted_at` set, which is what an admission records, so an admitted job
needs no second write: only a parked job is updated (to `parked`). If the admission does
not happen, `admitted_at` is cleared again so the pending sweep admits the job; if this
process dies in between, the reconciler finds a `queued` row marked admitted that the
engine does not know and re-enters it (fairqueue.jobs.recovery).

A job asked to start later (`run_at` / `delay_seconds`, fairqueue.jobs.delays) is written
`scheduled` with no admission; the due promotion admits it when its time comes
(fairqueue.jobs.due).
"""

from __future__ import annotations

import functools
import logging
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import redis
from django.db import IntegrityError, connection, transaction
from django.utils import timezone
from pydantic import ValidationError as PydanticValidationError

from fairqueue import tracing
from fairqueue.jobs import live, payloads, stats
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.admission import job_placement
from fairqueue.jobs.copy_insert import row_insert, rows_copy
from fairqueue.jobs.delays import due_time, is_deferred
from fairqueue.jobs.dispatch import jobs_admit
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.fastinit import builder
from fairqueue.jobs.models import JOIN_INDEX, KEY_SEPARATOR, Job, JobStatus
from fairqueue.jobs.quotas import backlog_enter, backlog_leave
from fairqueue.jobs.registry import is_continuation, task_get
from fairqueue.jobs.task_limits import valid_limit
from tenants.models import Tenant
from tenants.policy import PolicySnapshot, policy_snapshot
from webhooks.targets import TargetRefused, target_resolve

SUB_TENANT_RE = re.compile(r"^[\x21-\x7e]{1,200}$")  # printable ASCII, no spaces or control bytes
IDEMPOTENCY_MAX = 200
# A job's resources are keys of every admission it makes, beside its 2-3 own: a few at most.
MAX_RESOURCES_PER_JOB = 4
IDEMPOTENCY_RACE_RETRIES = 3

log = logging.getLogger("fairqueue.jobs.submission")


@dataclass(frozen=True)
class JobRequest:
    task: str
    args: dict[str, Any] = field(default_factory=dict)
    sub_tenant: str | None = None
    priority: str | None = None
    batch: bool = False
    idempotency_key: str | None = None
    timeout_seconds: float | None = None  # may only lower the task's own limit
    callback_url: str | None = None
    resources: Sequence[str] = ()
    # Delays and retries: an ISO-8601 time or seconds from now (fairqueue.jobs.delays), and
    # a lower attempt budget than the task's retry policy (fairqueue.jobs.retries).
    run_at: str | None = None
    delay_seconds: float | None = None
    max_attempts: int | None = None
    # Fan-out (fairqueue.jobs.fanout), set by a running parent's JobContext, never by the API:
    # its id, this child's index (JOIN_INDEX: its continuation), the document key's cap.
    parent_id: str | None = None
    child_index: int | None = None
    fan_out_cap: int | None = None


@dataclass(frozen=True)
class SubmitResult:
    job: Job
    created: bool


# --- validation ------------------------------------------------------------------------


CallbackCheck = Callable[[str], str | None]


def _prepare(
    *,
    tenant: Tenant,
    policy: PolicySnapshot,
    req: JobRequest,
    where: str,
    now: datetime,
    traceparent: str,
    callback_refusal: CallbackCheck,
    new: Callable[..., Job] = Job,
) -> Job:
    """Validate one request completely and build its (unsaved) row; raises JobError.
    `traceparent`: the submit request's span, the job's trace ("" with tracing off);
    `callback_refusal`: why a callback URL is refused (None when it is not); `new` builds
    the instance as `Job(...)` would (a bulk's `fastinit.builder`)."""
    registered = task_get(req.task)
    if registered is None:
        raise JobError(400, "unknown_task", f"Unknown task {req.task!r}.", f"{where}task")
    if is_continuation(registered) and req.child_index != JOIN_INDEX:
        raise JobError(
            400,
            "continuation_task",
            f"{req.task} is a continuation: it runs only as the join of a job's children (submit_children's then).",
            f"{where}task",
        )
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
    if req.timeout_seconds is not None:
        if isinstance(req.timeout_seconds, bool) or not valid_limit(req.timeout_seconds):
            raise JobError(
                400, "invalid_timeout", "timeout_seconds must be a positive number.", f"{where}timeout_seconds"
            )
        task_limit = registered.timeout_seconds
        if task_limit is not None and req.timeout_seconds > task_limit:
            raise JobError(
                400,
                "invalid_timeout",
                f"timeout_seconds may only lower the task's limit: {req.task} allows at most {task_limit:g} s.",
                f"{where}timeout_seconds",
            )
    if req.callback_url is not None:
        _check_callback_url(tenant, req.callback_url, where, callback_refusal)
    resources = _resources(registered.resources, req.resources, policy=policy, where=where)
    allowed = registered.retry.max_attempts
    max_attempts = allowed if req.max_attempts is None else req.max_attempts
    if isinstance(max_attempts, bool) or not 1 <= max_attempts <= allowed:
        raise JobError(
            400,
            "invalid_max_attempts",
            f"max_attempts must be 1-{allowed}: a submit may lower the retry policy of {req.task}, never raise it.",
            f"{where}max_attempts",
        )
    run_at, due_at = due_time(run_at=req.run_at, delay_seconds=req.delay_seconds, now=now, where=where)
    deferred = is_deferred(due_at, now)
    document = req.parent_id if req.parent_id is not None and (req.child_index or 0) >= 0 else ""
    engine_tag, names = (
        job_placement(tenant=tenant_policy, sub_tenant=sub, batch=req.batch, resources=resources, document=document)
        if tenant_policy is not None
        else ("", [])  # not synced yet: the first admission stores where it went
    )
    return new(
        id=uuid.uuid4(),
        engine_tag=engine_tag,
        engine_keys=KEY_SEPARATOR.join(names),
        tenant=tenant,
        sub_tenant=sub,
        task=req.task,
        latency_class=class_name,
        priority=latency_class.rank,
        batch=req.batch,
        idempotency_key=req.idempotency_key,
        args=req.args,
        timeout_seconds=req.timeout_seconds,
        callback_url=req.callback_url or "",
        resources=KEY_SEPARATOR.join(resources),
        run_at=run_at,
        # Only a job due later has a due time; one asked for a past time is due at submit.
        due_at=due_at if deferred else None,
        max_attempts=max_attempts,
        status=JobStatus.SCHEDULED if deferred else JobStatus.QUEUED,
        traceparent=traceparent,
        parent_id=uuid.UUID(req.parent_id) if req.parent_id is not None else None,
        child_index=req.child_index,
        fan_out_cap=req.fan_out_cap,
    )


def callback_refusal(url: str) -> str | None:
    """Why `url` may not be a job's webhook target (None when it may): the SSRF guard's
    check, a DNS lookup. A bulk request memoizes it, so one URL costs one lookup per
    request however many jobs name it; the sender checks again at delivery."""
    try:
        target_resolve(url)
    except TargetRefused as exc:
        return str(exc)
    return None


def _check_callback_url(tenant: Tenant, url: str, where: str, refusal_of: CallbackCheck) -> None:
    """A job's own webhook target: a public http(s) URL, signed with the tenant's secret."""
    refusal = refusal_of(url)
    if refusal is not None:
        raise JobError(400, "invalid_callback_url", f"callback_url: {refusal}", f"{where}callback_url")
    if not tenant.webhook_secret:
        raise JobError(
            400,
            "webhook_secret_missing",
            "This tenant has no webhook signing secret yet; an operator issues one in the admin "
            "(Tenants, “Rotate webhook secret”).",
            f"{where}callback_url",
        )


def _resources(declared: Sequence[str], named: Sequence[str], *, policy: PolicySnapshot, where: str) -> list[str]:
    """The task's declared resources and those the request names, each configured by the
    operator; sorted, without repeats."""
    if not named and not declared and not isinstance(named, str):  # the common case, without the checks' generators
        return []
    if isinstance(named, str) or not all(isinstance(r, str) for r in named):
        raise JobError(400, "invalid_resources", "resources must be a list of resource names.", f"{where}resources")
    unknown = sorted({r for r in named if r not in policy.resources})
    if unknown:
        known = ", ".join(sorted(policy.resources)) or "none is configured"
        raise JobError(
            400,
            "unknown_resource",
            f"Unknown resource {unknown[0]!r}; configured resources: {known}.",
            f"{where}resources",
        )
    # A resource the task declares but the operator has not configured (yet) throttles nothing.
    resources = sorted({*named, *(r for r in declared if r in policy.resources)})
    if len(resources) > MAX_RESOURCES_PER_JOB:
        raise JobError(
            400,
            "too_many_resources",
            f"A job may call at most {MAX_RESOURCES_PER_JOB} resources, not {len(resources)}.",
            f"{where}resources",
        )
    return resources


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
    """Accept many jobs in one go: all valid or none written; Redis work in one pipeline.

    Once the rows are committed the answer is a success, whatever happens to the live
    signals or the engine after that: a job that could not be admitted stays `queued`
    and the pending sweep admits it (fairqueue.jobs.recovery).
    """
    policy = policy_snapshot()
    keys = [r.idempotency_key for r in reqs if r.idempotency_key is not None]
    if len(keys) != len(set(keys)):
        raise JobError(400, "duplicate_idempotency_key", "Two jobs in one request share an idempotency key.", "jobs")
    traceparent = tracing.traceparent()  # one request, one trace: read once for all its jobs
    refusal_of = functools.cache(callback_refusal)
    new = builder(Job) if len(reqs) > 1 else Job  # a builder pays for itself from two jobs on
    for attempt in range(IDEMPOTENCY_RACE_RETRIES + 1):
        existing: dict[str, Job] = {}
        if keys:
            existing = {j.idempotency_key: j for j in Job.objects.filter(tenant=tenant, idempotency_key__in=keys)}  # type: ignore[misc]
        results: list[SubmitResult | None] = []
        fresh: list[Job] = []
        now = timezone.now()
        for i, req in enumerate(reqs):
            if req.idempotency_key is not None and req.idempotency_key in existing:
                results.append(SubmitResult(existing[req.idempotency_key], created=False))
                continue
            where = "" if single else f"jobs[{i}]."
            fresh.append(
                _prepare(
                    tenant=tenant,
                    policy=policy,
                    req=req,
                    where=where,
                    now=now,
                    traceparent=traceparent,
                    callback_refusal=refusal_of,
                    new=new,
                )
            )
            results.append(None)
        if not fresh:
            return [r for r in results if r is not None]
        _offload_large_args(fresh)
        accepted_at = timezone.now()
        steps = tl.line(tl.SUBMITTED, at=accepted_at) + tl.line(tl.ADMITTED, at=accepted_at)
        for n, job in enumerate(fresh):
            # Set here, not by the database: the jobs enter their cells (scored by it) before
            # their rows are written. A bulk's jobs a microsecond apart keep their order in
            # whatever orders by it (a rebuild's re-entry, the pending sweep), as rows
            # stamped one by one did.
            job.submitted_at = accepted_at + timedelta(microseconds=n)
            if job.status == JobStatus.QUEUED:
                job.admitted_at = accepted_at  # see the module docstring
                job.timeline = steps
            else:  # scheduled: admitted when due (fairqueue.jobs.due)
                job.timeline = tl.line(tl.SUBMITTED, at=accepted_at)
        tp = policy.tenants.get(tenant.slug)
        # The quotas are checked and the jobs enter their cells in one atomic call, before
        # anything is written: a refusal (429) writes nothing (fairqueue.jobs.quotas).
        try:
            entered = tp is not None and backlog_enter(tp=tp, policy=policy, jobs=fresh)
        except BaseException:
            _discard_offloaded(fresh)
            raise
        try:
            _insert(fresh)
        except IntegrityError as exc:
            _discard_offloaded(fresh)
            if entered:
                backlog_leave(fresh)
            # A concurrent request won the race on an idempotency key: answer with its jobs.
            # Any other integrity error (or a race that keeps repeating) is not retried.
            if not keys or not _idempotency_taken(tenant, keys, existing) or attempt == IDEMPOTENCY_RACE_RETRIES:
                log.error("submit refused by the database: %s", exc)
                raise JobError(
                    409, "conflict", "The job could not be stored; nothing was written. Check the request and retry."
                ) from None
            continue
        except BaseException:
            _discard_offloaded(fresh)
            if entered:
                backlog_leave(fresh)
            raise
        _after_commit(tenant=tenant, jobs=fresh, policy=policy, entered=entered)
        it = iter(fresh)
        return [r if r is not None else SubmitResult(next(it), created=True) for r in results]
    raise AssertionError("unreachable: the loop returns or raises")


def _insert(jobs: Sequence[Job]) -> None:
    """Write the rows in one statement: a lone row by a plain INSERT (its own transaction;
    in a caller's transaction, a savepoint keeps a refused INSERT from breaking it), many by
    one COPY, in one transaction; on PostgreSQL both built once per process rather than by
    the ORM per call (fairqueue.jobs.copy_insert), elsewhere `save()` and one multi-row
    INSERT."""
    if len(jobs) == 1:
        if connection.in_atomic_block:
            with transaction.atomic():
                _insert_one(jobs[0])
        else:
            _insert_one(jobs[0])
        return
    with transaction.atomic():
        if connection.vendor == "postgresql":
            rows_copy(Job, jobs)
        else:
            Job.objects.bulk_create(jobs)


def _insert_one(job: Job) -> None:
    if connection.vendor == "postgresql":
        row_insert(Job, job)
    else:
        job.save(force_insert=True)


def _idempotency_taken(tenant: Tenant, keys: list[str], seen: dict[str, Job]) -> bool:
    """True if another request stored one of `keys` since we looked: the race to answer."""
    return Job.objects.filter(tenant=tenant, idempotency_key__in=keys).exclude(idempotency_key__in=list(seen)).exists()


def _after_commit(*, tenant: Tenant, jobs: Sequence[Job], policy: PolicySnapshot, entered: bool = False) -> None:
    """Best-effort work after the rows are committed: signals, counters, admission.
    Nothing here may turn an accepted submit into an error. A scheduled job is neither
    admitted nor counted in the tenant's arrival rate here: it arrives when it is due
    (fairqueue.jobs.due)."""
    due_now = [j for j in jobs if j.status == JobStatus.QUEUED]
    try:
        stats.count("submitted", len(jobs))
        if due_now:
            live.record_submissions(tenant_slug=tenant.slug, count=len(due_now))
    except Exception:
        log.exception("could not count %d submission(s)", len(jobs))
    if not due_now:
        return
    jobs = due_now
    try:
        # Jobs the quota check entered in their cells already are not entered again.
        jobs_admit(jobs, policy=policy, strict=True, fresh=True, enter_cells=not entered)
    except redis.RedisError:
        log.warning("Redis unreachable: %d accepted job(s) wait for the pending sweep", len(jobs))
        _admission_pending(jobs)
    except Exception:
        log.exception("%d accepted job(s) not admitted now; the pending sweep admits them", len(jobs))
        _admission_pending(jobs)


def _admission_pending(jobs: Sequence[Job]) -> None:
    """The admission did not happen: clear the mark the rows were written with, so the
    pending sweep admits them (if even this fails, the reconciler re-enters them)."""
    admitted = {j.admitted_at for j in jobs if j.admitted_at is not None}
    pending = tl.line(tl.PENDING, "not admitted at submit")
    try:
        for at in admitted:  # one per submit: the rows' assumed admission, taken back
            Job.objects.filter(
                id__in=[j.id for j in jobs if j.admitted_at == at], generation=0, status=JobStatus.QUEUED
            ).update(admitted_at=None, timeline=tl.replaced(tl.line(tl.ADMITTED, at=at), pending))
    except Exception:
        log.exception("could not mark %d job(s) for the pending sweep; the reconciler re-enters them", len(jobs))
    for job in jobs:
        if job.status == JobStatus.QUEUED:
            job.admitted_at = None
