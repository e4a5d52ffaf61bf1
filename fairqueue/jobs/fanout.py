"""Fan-out: a running job submits child jobs under its document key, then joins them
without holding a slot.

- `children_submit` (bound to the running job's JobContext by the worker): the children
  are one bulk submit of the parent's tenant and sub-tenant, each with an idempotency key
  made of the parent's id and its index (and a unique (parent, child_index)), so a
  re-delivered parent gets the same children back and writes nothing. Each child holds
  its document key (fairqueue.jobs.admission.document_key) capped at the fan-out.
- The parent's run then ends `awaiting` (fairqueue.jobs.execution): it holds no slot, so
  no cap can deadlock on parents waiting for their children.
- `parent_join`, after every child's end and after the parent's own run: once the parent
  is `awaiting` and none of its children is unfinished, its continuation is submitted,
  exactly once (its idempotency key, and the unique index JOIN_INDEX); without one the
  parent finishes there. The continuation's end is the parent's (`child_finished`), by a
  compare-and-set on `awaiting`.

A crash between a child's end and its join check leaves a parent awaiting with every child
finished; the duty tick's `joins_sweep` finds it and joins it. Both orders of a last
child's end and its parent's own end are covered: each writes its status, then reads the
other's, so at least one of them sees both.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from django.db.models import Count, F, Q
from django.utils import timezone

from fairqueue.jobs import documents, stats
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.models import (
    JOIN_INDEX,
    TERMINAL_STATUSES,
    Job,
    JobStatus,
)
from fairqueue.jobs.registry import ChildOutcome, JoinArgs, task_get
from fairqueue.jobs.submission import JobRequest, job_submit_bulk
from tenants.policy import policy_snapshot
from webhooks.outbox import job_finish

log = logging.getLogger("fairqueue.jobs.fanout")

# One parent's children are one bulk submit: one statement, one pipelined admission.
MAX_CHILDREN = 10_000
CHILD_KEY_PREFIX = "fq:child:"
JOIN_KEY_PREFIX = "fq:join:"
# Parents the duty's sweep joins per tick at most (a backlog is worked off over ticks).
JOIN_SWEEP_BATCH = 100
NOT_FINISHED = sorted(set(JobStatus) - TERMINAL_STATUSES)


class FanOutError(ValueError):
    """A submit_children call the parent's task got wrong (its run fails with it)."""


def child_idempotency_key(parent_id: str, index: int) -> str:
    return f"{CHILD_KEY_PREFIX}{parent_id}:{index}"


def join_idempotency_key(parent_id: str) -> str:
    return f"{JOIN_KEY_PREFIX}{parent_id}"


def fan_out_cap(*, tenant_max: int, asked: int | None) -> int:
    """The document key's limit: the tenant's max fan-out per job, or lower if the call asks."""
    if asked is None:
        return tenant_max
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise FanOutError(f"max_fan_out must be a positive whole number, not {asked!r}")
    return min(asked, tenant_max)


def children_submit(
    *,
    parent_id: str,
    generation: int,
    task: str,
    args: Sequence[Mapping[str, Any]],
    then: str | None,
    max_fan_out: int | None,
) -> list[str]:
    """Submit the running parent's children (see the module docstring); returns their ids.
    Raises FanOutError for a bad call, and JobError if the submit is refused (say, bad
    arguments for `task`): nothing is written then."""
    if not 0 < len(args) <= MAX_CHILDREN:
        raise FanOutError(f"submit_children takes 1-{MAX_CHILDREN} children, not {len(args)}")
    if then is not None:
        joined = task_get(then)
        if joined is None:
            raise FanOutError(f"unknown continuation task {then!r}")
        if not issubclass(joined.args_model, JoinArgs):
            raise FanOutError(f"continuation task {then!r} must take JoinArgs (or a subclass) as its args")
    parent = Job.objects.select_related("tenant").get(id=parent_id)
    if parent.generation != generation or parent.status != JobStatus.RUNNING:
        raise FanOutError(f"job {parent_id} generation {generation} is no longer running here")
    tenant_policy = policy_snapshot().tenants.get(parent.tenant.slug)
    if tenant_policy is None:
        raise FanOutError(f"tenant {parent.tenant.slug}'s policy is not synced yet")
    cap = fan_out_cap(tenant_max=tenant_policy.max_fan_out, asked=max_fan_out)
    # The continuation's task is the parent's own record: written by the running generation;
    # the countdown is set before any child exists (so none ends before it), once: a
    # re-delivered parent finds it set, and its children already counted.
    Job.objects.filter(id=parent.id, generation=generation, status=JobStatus.RUNNING).update(then_task=then or "")
    Job.objects.filter(id=parent.id, generation=generation, children_open__isnull=True).update(children_open=len(args))
    reqs = [
        JobRequest(
            task=task,
            args=dict(item),
            sub_tenant=parent.sub_tenant or None,
            priority=parent.latency_class,
            idempotency_key=child_idempotency_key(parent_id, i),
            parent_id=parent_id,
            child_index=i,
            fan_out_cap=cap,
        )
        for i, item in enumerate(args)
    ]
    results = job_submit_bulk(tenant=parent.tenant, reqs=reqs)
    created = sum(1 for r in results if r.created)
    if created:
        stats.count("fanout:children", created)
    documents.document_record(
        parent_id=parent_id, tenant=tenant_policy.slug, shard=tenant_policy.shard, children=len(reqs), cap=cap
    )
    return [str(r.job.id) for r in results]


def _outcomes(parent_id: Any) -> list[ChildOutcome] | None:
    """Each child's outcome by index; None while one is unfinished."""
    rows = list(
        Job.objects.filter(parent_id=parent_id, child_index__gte=0)
        .order_by("child_index")
        .values_list("child_index", "status", "result", "result_ref", "error_reason")
    )
    if any(status not in TERMINAL_STATUSES for _, status, _, _, _ in rows):
        return None
    return [
        ChildOutcome(
            index=index or 0,
            status=status,
            result=None if ref else result,
            result_ref=ref,
            error_reason=reason,
        )
        for index, status, result, ref, reason in rows
    ]


def parent_join(parent_id: Any) -> bool:
    """Join the parent if it is awaiting and its last child has ended: submit its
    continuation (once), or finish it when it has none. True if this call joined it."""
    parent = Job.objects.select_related("tenant").filter(id=parent_id, status=JobStatus.AWAITING).first()
    if parent is None:
        return False
    if parent.children_open:  # not its last child yet (a lost count-down is the sweep's)
        return False
    outcomes = _outcomes(parent.id)
    if outcomes is None:
        return False
    failed = [o.index for o in outcomes if o.status != JobStatus.SUCCEEDED]
    if not parent.then_task:
        return _parent_finish(
            parent,
            status=JobStatus.FAILED if failed else JobStatus.SUCCEEDED,
            result={"children": len(outcomes), "failed": failed},
            error=f"{len(failed)} of {len(outcomes)} children did not succeed: {failed[:20]}" if failed else "",
            error_reason="children_failed" if failed else "",
        )
    join = Job.objects.filter(parent_id=parent.id, child_index=JOIN_INDEX).first()
    if join is not None:  # submitted already (by another child's end): adopt its end, if any
        if join.status in TERMINAL_STATUSES:
            return child_finished(join)
        return False
    args = JoinArgs(parent_id=str(parent.id), parent_args=parent.args or {}, children=outcomes, failed=failed)
    try:
        result = job_submit_bulk(
            tenant=parent.tenant,
            reqs=[
                JobRequest(
                    task=parent.then_task,
                    args=args.model_dump(mode="json"),
                    sub_tenant=parent.sub_tenant or None,
                    priority=parent.latency_class,
                    idempotency_key=join_idempotency_key(str(parent.id)),
                    parent_id=str(parent.id),
                    child_index=JOIN_INDEX,
                )
            ],
            single=True,
        )[0]
    except JobError as exc:
        # Refused for good (the task was unregistered since, say): the parent fails rather
        # than wait for ever.
        return _parent_finish(
            parent,
            status=JobStatus.FAILED,
            result=None,
            error=f"continuation {parent.then_task} refused: {exc.message}",
            error_reason="join_refused",
        )
    if result.created:
        stats.count("fanout:joins")
        Job.objects.filter(id=parent.id, status=JobStatus.AWAITING).update(
            timeline=tl.appended(tl.line(tl.JOINED, str(result.job.id)))
        )
    return result.created


def child_finished(job: Job) -> bool:
    """After a child job (or a continuation) reached a terminal status: a continuation's
    end becomes its parent's; a child's may be its parent's last. Best-effort: the duty's
    sweep joins what a failure here leaves."""
    if job.parent_id is None:
        return False
    if job.child_index != JOIN_INDEX:
        Job.objects.filter(id=job.parent_id, children_open__gt=0).update(children_open=F("children_open") - 1)
        return parent_join(job.parent_id)
    join = Job.objects.filter(id=job.id).first()
    parent = Job.objects.select_related("tenant").filter(id=job.parent_id, status=JobStatus.AWAITING).first()
    if join is None or parent is None or join.status not in TERMINAL_STATUSES:
        return False
    return _parent_finish(
        parent,
        status=join.status,
        result=join.result,
        result_ref=join.result_ref,
        error=join.error,
        error_reason=join.error_reason,
    )


def _parent_finish(
    parent: Job, *, status: str, result: Any, error: str, error_reason: str, result_ref: str = ""
) -> bool:
    now = timezone.now()
    won = job_finish(
        parent,
        where={"id": parent.id, "status": JobStatus.AWAITING},
        fields={
            "status": status,
            "result": result,
            "result_ref": result_ref,
            "error": error,
            "error_reason": error_reason,
            "finished_at": now,
            "timeline": tl.appended(tl.line(tl.FINISHED, status, at=now)),
        },
    )
    if won:
        stats.count(f"finished:{status}")
        documents.documents_forget([str(parent.id)])
    return won


def child_finished_safely(job: Job) -> None:
    """child_finished, logging rather than raising: the child's own end is recorded already."""
    try:
        child_finished(job)
    except Exception:
        log.exception("join check after job %s failed; the duty's sweep joins its parent", job.id)


def documents_prune() -> int:
    """Drop the documents the picture holds whose parent is no longer awaiting or running
    (a finish whose forget was lost); returns how many."""
    held = [d.parent_id for d in documents.documents_read()]
    if not held:
        return 0
    live_ids = {
        str(i)
        for i in Job.objects.filter(id__in=held)
        .exclude(status__in=sorted(TERMINAL_STATUSES))
        .values_list("id", flat=True)
    }
    gone = [i for i in held if i not in live_ids]
    documents.documents_forget(gone)
    return len(gone)


def joins_sweep(*, limit: int = JOIN_SWEEP_BATCH) -> int:
    """Join the awaiting parents whose children have all ended (a join check, or a child's
    count-down, lost to a crash); returns how many it joined or finished."""
    awaiting = Job.objects.filter(status=JobStatus.AWAITING).annotate(
        open=Count("children", filter=Q(children__status__in=NOT_FINISHED))
    )
    done = 0
    for parent_id in awaiting.filter(open=0).values_list("id", flat=True)[:limit]:
        try:
            # The children say none is open: the count is set right before the exact check.
            Job.objects.filter(id=parent_id, status=JobStatus.AWAITING).update(children_open=0)
            if parent_join(parent_id):
                done += 1
        except Exception:
            log.exception("could not join parent %s", parent_id)
    return done
