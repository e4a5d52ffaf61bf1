"""Reads on the jobs side. Every read is scoped to one tenant: another's job is a 404."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import models
from django.db.models import QuerySet

from fairqueue.jobs import cells, live, payloads
from fairqueue.jobs.admission import (
    QUARANTINE_KEY,
    document_key,
    flood_utilisation,
    shard_tag,
    tenant_key,
    tenant_limit_for,
)
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.eta import job_eta
from fairqueue.jobs.explain import limit_sentences, load_sentence, seconds_text
from fairqueue.jobs.list_cursor import cursor_decode, cursor_encode, jobs_after
from fairqueue.jobs.models import DEFERRED_STATUSES, SUB_TENANT_SET, Job, JobStatus
from fairqueue.jobs.quarantine import LANE as QUARANTINE_LANE
from fairqueue.jobs.registry import task_get
from fairqueue.jobs.runtime import engine
from fairqueue.jobs.task_limits import effective_timeout
from tenants.models import Tenant
from tenants.policy import PolicySnapshot, TenantPolicy, policy_snapshot
from tenants.resource_limits import resource_limits_read


def job_get(*, tenant: Tenant, job_id: str) -> Job:
    try:
        parsed = uuid.UUID(job_id)
    except ValueError:
        raise JobError(404, "not_found", "No such job.") from None
    job = Job.objects.select_related("tenant__shard").filter(id=parsed, tenant=tenant).first()
    if job is None:
        raise JobError(404, "not_found", "No such job.")
    return job


# The list's total is counted only when asked, and only up to this many rows: past it the
# answer says "at least" (a count of a tenant's whole history costs what the history does).
LIST_TOTAL_MAX = 10_000
# The deprecated offset walks past that many rows on every page; the cursor does not.
LIST_OFFSET_MAX = 10_000


@dataclass(frozen=True)
class JobListFilters:
    """What the list keeps: each set filter must hold (any combination)."""

    status: str | None = None
    sub_tenant: str | None = None
    task: str | None = None
    parent_id: uuid.UUID | None = None  # a parent's children (fan-out)
    submitted_since: datetime | None = None  # inclusive
    submitted_before: datetime | None = None  # exclusive


def job_list_rows(*, tenant: Tenant, filters: JobListFilters) -> QuerySet[Job]:
    """The tenant's jobs that pass `filters`, newest first (the list's order and its
    cursor's). An index serves each filter alone with this order: (tenant, submitted_at,
    id) the time range, (tenant, status, submitted_at) the status, job_tenant_task and
    job_tenant_sub_tenant the task and the sub-tenant, job_parent a parent's children
    (Job.Meta.indexes)."""
    qs = Job.objects.filter(tenant=tenant)
    if filters.parent_id:
        qs = qs.filter(parent_id=filters.parent_id)
    if filters.status:
        qs = qs.filter(status=filters.status)
    if filters.task:
        qs = qs.filter(task=filters.task)
    if filters.sub_tenant:
        # The partial index's condition, stated as is: SQLite uses a partial index only then.
        qs = qs.filter(SUB_TENANT_SET, sub_tenant=filters.sub_tenant)
    if filters.submitted_since:
        qs = qs.filter(submitted_at__gte=filters.submitted_since)
    if filters.submitted_before:
        qs = qs.filter(submitted_at__lt=filters.submitted_before)
    return qs.order_by("-submitted_at", "-id")


def job_list(
    *,
    tenant: Tenant,
    filters: JobListFilters,
    limit: int,
    cursor: str | None = None,
    offset: int = 0,
    with_total: bool = False,
) -> dict[str, Any]:
    """One page of the list: `limit` jobs after `cursor` (a `next` of an earlier page; from
    the newest without one), `offset` more skipped (deprecated). `next` is the cursor of
    the page after it, when there is one (`has_more`). No count unless `with_total`, and
    that one bounded (LIST_TOTAL_MAX)."""
    rows = job_list_rows(tenant=tenant, filters=filters)
    page = jobs_after(rows, cursor_decode(cursor)) if cursor else rows
    # Not in the answer, and the largest columns a row has (arguments up to the payload threshold).
    page = page.defer("args", "timeline")
    found = list(page[offset : offset + limit + 1])  # one more: is there a next page?
    has_more = len(found) > limit
    found = found[:limit]
    total = None
    if with_total:
        # In the order the filter's index has (its last column), which PostgreSQL then walks
        # and stops at the cap; with no order at all it may scan the table up to the cap.
        counted = rows.order_by("-submitted_at")[: LIST_TOTAL_MAX + 1].count()
        total = {"value": min(counted, LIST_TOTAL_MAX), "relation": "eq" if counted <= LIST_TOTAL_MAX else "gte"}
    return {
        "items": [job_to_dict(j) for j in found],
        "limit": limit,
        "has_more": has_more,
        "next": cursor_encode(found[-1]) if has_more else None,
        "total": total,
        "offset": offset,
        # Only for a client still paging by offset alone; the cursor is the way on.
        "next_offset": offset + limit if has_more and not cursor and offset + limit <= LIST_OFFSET_MAX else None,
    }


def job_timeout(job: Job) -> float | None:
    """The limit the job's attempts run under: its task's, or the lower one asked at submit."""
    registered = task_get(job.task)
    return effective_timeout(registered.timeout_seconds if registered else None, job.timeout_seconds)


def job_waiting_on(job: Job) -> dict[str, Any] | None:
    """Why a parked job waits: the key, its limit and holders, and the job's place in line."""
    if job.status != JobStatus.PARKED:
        return None
    tag = shard_tag(job.tenant.shard.name)
    state = engine().inspect_job(tag=tag, job_id=job.engine_id)
    if state.status != "parked" or not state.parked_on:
        return None
    key_state = engine().inspect_key(tag=tag, key=state.parked_on, holders=False)
    return {
        "key": state.parked_on,
        "lane": QUARANTINE_LANE if state.parked_on == QUARANTINE_KEY else None,
        "limit": key_state.limit,
        "holders": key_state.held,
        "position": state.position,
        "document": job.parent_id if job.document and state.parked_on == document_key(job.document) else None,
    }


def children_summary(parent_id: uuid.UUID) -> dict[str, int] | None:
    """A parent's children by state (its continuation not counted): total, waiting (not
    started, or waiting for a retry), running, succeeded and failed (cancelled included);
    None for a job with no children. One grouped count over the job_parent index."""
    counts = dict(
        Job.objects.filter(parent_id=parent_id, child_index__gte=0)
        .order_by()
        .values_list("status")
        .annotate(n=models.Count("id"))
        .values_list("status", "n")
    )
    if not counts:
        return None
    return {
        "total": sum(counts.values()),
        "waiting": sum(counts.get(s, 0) for s in CHILD_WAITING),
        "running": counts.get(JobStatus.RUNNING, 0) + counts.get(JobStatus.AWAITING, 0),
        "succeeded": counts.get(JobStatus.SUCCEEDED, 0),
        "failed": counts.get(JobStatus.FAILED, 0) + counts.get(JobStatus.CANCELLED, 0),
    }


CHILD_WAITING = (JobStatus.QUEUED, JobStatus.PARKED, JobStatus.SCHEDULED, JobStatus.RETRYING)


def job_to_dict(job: Job, *, explain: bool = False) -> dict[str, Any]:
    result = job.result
    if job.result_ref:
        result = payloads.payload_get(job.result_ref)
    return {
        "id": job.id,
        "status": job.status,
        "task": job.task,
        "priority": job.latency_class,
        "batch": job.batch,
        "sub_tenant": job.sub_tenant or None,
        "idempotency_key": job.idempotency_key,
        "callback_url": job.callback_url or None,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "attempt_history": job.attempt_history or [],
        "run_at": job.run_at,
        "next_attempt_at": job.due_at if job.status in DEFERRED_STATUSES else None,
        "submitted_at": job.submitted_at,
        "admitted_at": job.admitted_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "result": result,
        "error": job.error or None,
        "error_reason": job.error_reason or None,
        "timeout_seconds": job_timeout(job),
        "resources": job.resource_names,
        "parent_id": job.parent_id,
        "children": children_summary(job.id) if explain else None,
        "waiting_on": job_waiting_on(job) if explain else None,
        "quarantined": job.quarantined,
        "quarantined_at": job.quarantined_at,
        "quarantine_reason": job.quarantine_reason or None,
    }


def tenant_limits_explain(*, tenant: Tenant) -> dict[str, Any]:
    """Every term of the tenant's current limit plus its live load: why its jobs run or wait."""
    policy = policy_snapshot()
    tp = policy.tenants.get(tenant.slug)
    if tp is None:
        raise JobError(503, "policy_unavailable", "This tenant's policy is not synced yet; retry shortly.")
    signals = live.live_signals(tenant_slug=tp.slug)
    breakdown = tenant_limit_for(policy, tp, signals)
    key = engine().inspect_key(tag=shard_tag(tp.shard), key=tenant_key(tp.slug), holders=False)
    fleet = live.fleet_state()
    return {
        "tenant": tp.slug,
        "shard": tp.shard,
        "floor": breakdown.floor,
        "base": breakdown.base,
        "ceiling": round(breakdown.ceiling, 3),
        "pressure_factor": round(breakdown.pressure, 4),
        "hard_max": breakdown.hard_max,
        "dedicated": breakdown.dedicated,
        "max_fan_out": tp.max_fan_out,
        "idle_share": breakdown.idle_share,
        "fair_share": round(breakdown.fair_share, 3) if breakdown.fair_share is not None else None,
        "shard_cap": breakdown.shard_cap,
        "limit": breakdown.limit,
        "in_flight": key.held,
        "parked": key.waiting,
        "parked_by_priority": {str(p): n for p, n in key.waiters_by_priority.items()},
        "rate_per_min": round(breakdown.rate_per_min, 3),
        "mean_job_seconds": round(breakdown.mean_seconds, 4),
        "pool": {
            "slots": fleet.slots,
            "target": round(breakdown.pool_target, 3),
            "in_flight": fleet.in_flight,
            "batch_in_flight": fleet.batch_in_flight,
            "room": fleet.pool_room(tp.shard),
            "floor_headroom": policy.pool.floor_headroom,
            "quarantine_slots": policy.pool.quarantine_slots,
            "flood_utilisation": round(flood_utilisation(slots=fleet.slots, headroom=policy.pool.floor_headroom), 4),
        },
        "resources": resources_explain(policy),
        "quotas": quotas_explain(policy, tp),
    }


def quotas_explain(policy: PolicySnapshot, tp: TenantPolicy) -> dict[str, Any]:
    """The tenant's backlog quotas and submission rate, and what waits against them now."""
    interactive = cells.tenant_cells(tp.slug, policy.classes)
    batch = cells.tenant_cells(tp.slug, [cells.BATCH_CLASS])
    counts = cells.cells_count([*interactive, *batch])
    return {
        "backlog_quota": policy.pool.backlog_quota_of(tp, batch=False),
        "waiting": sum(counts[c] for c in interactive),
        "batch_backlog_quota": policy.pool.backlog_quota_of(tp, batch=True),
        "batch_waiting": sum(counts[c] for c in batch),
        "submit_rate": policy.pool.submit_rate_of(tp),
        "submit_burst": policy.pool.submit_burst,
    }


def resources_explain(policy: PolicySnapshot) -> list[dict[str, Any]]:
    """Each outside resource's configured and effective limit (tenants.resource_limits), for
    /api/v1/limits and the dashboard."""
    states = resource_limits_read(policy.resources[name] for name in sorted(policy.resources))
    return [
        {
            "name": name,
            "limit": state.configured,
            "effective": state.limit,
            "effective_exact": round(state.effective, 3),
            # ISO 8601 text rather than a datetime: the dashboard sends this list as JSON.
            "paused_until": (
                datetime.fromtimestamp(state.paused_until_ms / 1000, tz=UTC).isoformat() if state.paused else None
            ),
            # The same, as the dashboard counts it down (null unless paused).
            "paused_for_s": round((state.paused_until_ms - state.now_ms) / 1000, 1) if state.paused else None,
            "refusals": state.refusals,
        }
        for name, state in states.items()
    ]


def tenant_admin_live_state(tenant: Tenant) -> dict[str, Any]:
    """For the tenant's admin page: why its jobs run or wait, and how many do, in words."""
    policy = policy_snapshot()
    tp = policy.tenants.get(tenant.slug)
    if tp is None:
        return {"Limit now": "not known: the tenant's policy is not synced yet"}
    signals = live.live_signals(tenant_slug=tp.slug)
    breakdown = tenant_limit_for(policy, tp, signals)
    key = engine().inspect_key(tag=shard_tag(tp.shard), key=tenant_key(tp.slug), holders=False)
    counts = dict(
        Job.objects.filter(tenant=tenant, status__in=[JobStatus.QUEUED, JobStatus.PARKED, JobStatus.RUNNING])
        .values_list("status")
        .annotate(n=models.Count("id"))
    )
    oldest = Job.objects.filter(tenant=tenant, status=JobStatus.PARKED).order_by("submitted_at").first()
    place = None
    if oldest is not None:
        eta = job_eta(oldest)
        if eta.position is not None and eta.key is not None:
            place = (
                f"the oldest parked job ({oldest.submitted_at:%H:%M:%S}) has {eta.position:,} ahead of it on "
                f"{eta.key}, ETA {seconds_text(eta.eta_seconds or 0.0)}"
            )
    limit, ceiling, pressure = limit_sentences(policy, tp, breakdown, slots=signals.pool_slots)
    return {
        "Limit now": limit,
        "Ceiling": ceiling,
        "Pressure": pressure,
        "Load": load_sentence(
            in_flight=key.held, parked=key.waiting, by_priority=key.waiters_by_priority, oldest=place, counts=counts
        ),
    }
