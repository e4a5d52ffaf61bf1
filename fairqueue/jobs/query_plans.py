"""The job-table queries the duty tick, the cells audit and the API list run, and a check
of their plans: each must use an index (no sequential scan of the job table) and run
within MAX_MS (`manage.py explain_queries`; tests/test_query_plans.py)."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection
from django.db.models import QuerySet
from django.utils import timezone

from fairqueue.jobs.due import DUE_BATCH, due_rows
from fairqueue.jobs.list_cursor import ListCursor, jobs_after
from fairqueue.jobs.models import ADMISSION_PENDING, BATCH_DUE, RECONCILED, WAITING_SINCE, Job, JobStatus
from fairqueue.jobs.recovery import RECONCILE_ROWS_PER_TICK, RELEASES_PER_TICK, reconcile_after
from fairqueue.jobs.retention import prunable_jobs
from fairqueue.jobs.selectors import LIST_TOTAL_MAX, JobListFilters, job_list_rows
from tenants.models import Tenant

MAX_MS = 20.0
DEFERRED_EVERY = 100  # seeded rows: one finished row in this many is delayed or retrying instead
# Seeded rows: one in SEED_TASK_EVERY of the second task, one in SEED_SUB_TENANT_EVERY of a
# sub-tenant (of SEED_SUB_TENANTS), for the API list's filters.
SEED_TASKS = ("demo.noop", "demo.sleep")
SEED_TASK_EVERY = 10
SEED_SUB_TENANT_EVERY = 7
SEED_SUB_TENANTS = 50
LIST_PAGE = 50  # the API list's default page


@dataclass(frozen=True)
class PlanCheck:
    name: str
    plan: str
    ms: float
    uses_index: bool

    @property
    def ok(self) -> bool:
        return self.uses_index and self.ms <= MAX_MS


def queries(tenant: Tenant) -> dict[str, QuerySet[Job]]:
    """Each query as the code runs it (same filters, order and limit)."""
    now = timezone.now()
    waiting = [JobStatus.QUEUED, JobStatus.PARKED]
    some_ids = [uuid.uuid4() for _ in range(100)]
    return {
        "tick: pending admissions": Job.objects.filter(ADMISSION_PENDING, submitted_at__lte=now).order_by(
            "submitted_at", "id"
        )[:1000],
        "tick: due promotion": due_rows(now)[:DUE_BATCH],
        "tick: batch promotion": Job.objects.filter(BATCH_DUE)
        .alias(waiting_since=WAITING_SINCE)
        .filter(waiting_since__lte=now - timedelta(hours=9))
        .order_by("waiting_since")[:200],
        "tick: reconcile": Job.objects.filter(RECONCILED).order_by("submitted_at", "id")[:RECONCILE_ROWS_PER_TICK],
        # Every later tick: from the cursor (the oldest rows are the ones it passed).
        "tick: reconcile from its cursor": reconcile_after(
            Job.objects.filter(RECONCILED).order_by("submitted_at", "id"),
            (now - timedelta(days=1)).isoformat(),
            str(uuid.uuid4()),
        )[:RECONCILE_ROWS_PER_TICK],
        "tick: releases pending": Job.objects.filter(release_pending=True).order_by("finished_at")[:RELEASES_PER_TICK],
        "tick: cells audit": Job.objects.filter(id__in=some_ids, status__in=waiting),
        "retention batch": prunable_jobs(cutoff=now - timedelta(days=30)).order_by("finished_at", "id")[:500],
        **_list_queries(tenant, now),
    }


def _list_queries(tenant: Tenant, now: datetime) -> dict[str, QuerySet[Job]]:
    """The API list's page query (selectors.job_list): each filter alone, from the newest and
    from a cursor a day back, and the bounded total. (Filters together read the index of one
    and test the others: docs/api.md has their cost.)"""
    cursor = ListCursor(submitted_at=now - timedelta(days=1), id=uuid.uuid4())
    page = LIST_PAGE + 1  # the list reads one row more than it answers
    filters = {
        "": JobListFilters(),
        " by status": JobListFilters(status=JobStatus.PARKED),
        " by task": JobListFilters(task=SEED_TASKS[1]),
        " by sub-tenant": JobListFilters(sub_tenant=_seed_sub_tenant(SEED_SUB_TENANT_EVERY)),
        " by time range": JobListFilters(submitted_since=now - timedelta(days=2), submitted_before=now),
    }
    out: dict[str, QuerySet[Job]] = {}
    for name, f in filters.items():
        rows = job_list_rows(tenant=tenant, filters=f)
        out[f"api: list{name}"] = rows[:page]
        out[f"api: list{name} from a cursor"] = jobs_after(rows, cursor)[:page]
    # Its inner query (the count is of at most that many rows).
    for name, f in (("", filters[""]), (" by status", filters[" by status"])):
        rows = job_list_rows(tenant=tenant, filters=f).order_by("-submitted_at").only("id")
        out[f"api: list{name}, total (bounded)"] = rows[: LIST_TOTAL_MAX + 1]
    return out


def _uses_index(plan: str) -> bool:
    table = Job._meta.db_table
    if connection.vendor == "postgresql":
        return f"Seq Scan on {table}" not in plan
    # SQLite's EXPLAIN QUERY PLAN: "SCAN jobs_job" alone is a full scan; "SEARCH ... USING
    # INDEX" or "SCAN ... USING INDEX" (an ordered index walk) are not.
    return not re.search(rf"SCAN {table}(?! USING (COVERING )?INDEX)\b", plan)


def check(qs: QuerySet[Job], name: str) -> PlanCheck:
    """The plan and the database's own time for the query (PostgreSQL: EXPLAIN ANALYZE's
    execution time; elsewhere the SQL run and fetched as plain rows): building model
    objects is the caller's cost, not the query's."""
    if connection.vendor == "postgresql":
        plan = qs.explain(analyze=True)
        found = re.search(r"Execution Time: ([\d.]+) ms", plan)
        ms = float(found.group(1)) if found else float("inf")
    else:
        plan = qs.explain()
        sql, params = qs.query.sql_with_params()
        started = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            cursor.fetchall()
        ms = (time.perf_counter() - started) * 1000
    return PlanCheck(name=name, plan=plan, ms=round(ms, 2), uses_index=_uses_index(plan))


def checks(tenant: Tenant) -> list[PlanCheck]:
    return [check(qs, name) for name, qs in queries(tenant).items()]


def _seed_sub_tenant(i: int) -> str:
    return f"cust-{i // SEED_SUB_TENANT_EVERY % SEED_SUB_TENANTS}"


def seed(*, rows: int, waiting: int, tenant: Tenant, log: Callable[[str], None], chunk: int = 10_000) -> None:
    """Add `rows` job rows to `tenant`: `waiting` of them waiting (parked and queued), of
    the rest one in DEFERRED_EVERY deferred (scheduled or retrying, due within a day either
    side of now) and the others finished over the last 60 days; then refresh the planner's
    statistics."""
    now = timezone.now()
    made = 0
    while made < rows:
        batch = []
        for i in range(made, min(rows, made + chunk)):
            due = None
            if i < waiting:
                status = JobStatus.PARKED if i % 2 else JobStatus.QUEUED
                finished = None
            elif i % DEFERRED_EVERY == 0:
                status = JobStatus.RETRYING if i % 2 else JobStatus.SCHEDULED
                finished = None
                due = now + timedelta(seconds=(i * 7919) % (2 * 86400) - 86400)
            else:
                status = JobStatus.SUCCEEDED
                finished = now - timedelta(seconds=(i * 5183) % (60 * 86400))
            batch.append(
                Job(
                    id=uuid.uuid4(),
                    tenant=tenant,
                    task=SEED_TASKS[1] if i % SEED_TASK_EVERY == 0 else SEED_TASKS[0],
                    sub_tenant=_seed_sub_tenant(i) if i % SEED_SUB_TENANT_EVERY == 0 else "",
                    latency_class="default",
                    status=status,
                    admitted_at=now if status == JobStatus.QUEUED and i % 4 else None,
                    finished_at=finished,
                    due_at=due,
                    engine_tag=f"s:{tenant.shard.name}",
                )
            )
        Job.objects.bulk_create(batch)
        made += len(batch)
        log(f"  {made} rows")
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Job._meta.db_table}")
