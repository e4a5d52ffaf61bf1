"""The rows deliveries read on a worker (a waiting job with its tenant and shard), read by
SQL built once per process and connection rather than by a QuerySet compiled per read.

Why: a worker reads one row per job it runs, and the ORM compiled the same
`select_related("tenant__shard")` query anew for each (its SQL compiler was the largest
part of that read's CPU). This builds the same SELECT, applies the same converters and
builds the same instances, with the related caches select_related fills;
tests/test_jobrows.py checks it against the QuerySet.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections, models, router

from fairqueue.jobs.models import WAITING_STATUSES, Job
from fairqueue.jobs.prepared import hot_cursor
from tenants.models import Shard, Tenant

WAITING = sorted(WAITING_STATUSES)
Converter = Callable[[Any, Any, Any], Any]


@dataclass(frozen=True)
class _Part:
    """One model's columns in the SELECT: where they sit in a row, and their converters."""

    model: type[models.Model]
    attnames: list[str]
    start: int
    end: int
    converters: list[tuple[int, list[Converter], Any]]  # (position in the row, converters, the column)


@dataclass(frozen=True)
class _Plan:
    select: str  # SELECT ... FROM ... JOIN ... WHERE <id IN> AND <status IN>, the id list left as {ids}
    parts: tuple[_Part, _Part, _Part]  # job, tenant, shard


_plans: dict[str, _Plan] = {}
_plans_lock = threading.Lock()


def _plan(alias: str) -> _Plan:
    plan = _plans.get(alias)
    if plan is None:
        with _plans_lock:
            plan = _plans.get(alias) or _plan_build(alias)
            _plans[alias] = plan
    return plan


def _plan_build(alias: str) -> _Plan:
    connection = connections[alias]
    qn = connection.ops.quote_name
    parts: list[_Part] = []
    columns: list[str] = []
    for model in (Job, Tenant, Shard):
        table = model._meta.db_table
        fields = list(model._meta.concrete_fields)
        start = len(columns)
        converters = []
        for i, f in enumerate(fields):
            col = f.get_col(table)
            # What SQLCompiler.get_converters takes for each selected column.
            convs = connection.ops.get_db_converters(col) + col.get_db_converters(connection)
            if convs:
                converters.append((start + i, convs, col))
            columns.append(f"{qn(table)}.{qn(f.column)}")
        parts.append(_Part(model, [f.attname for f in fields], start, len(columns), converters))
    job, tenant, shard = (qn(m._meta.db_table) for m in (Job, Tenant, Shard))
    tenant_fk, shard_fk = Job._meta.get_field("tenant"), Tenant._meta.get_field("shard")
    statuses = ", ".join(["%s"] * len(WAITING))
    select = (
        f"SELECT {', '.join(columns)} FROM {job} "
        f"INNER JOIN {tenant} ON ({job}.{qn(tenant_fk.column)} = {tenant}.{qn(tenant_fk.target_field.column)}) "
        f"INNER JOIN {shard} ON ({tenant}.{qn(shard_fk.column)} = {shard}.{qn(shard_fk.target_field.column)}) "
        f"WHERE {job}.{qn(Job._meta.get_field('id').column)} IN ({{ids}}) AND {job}.{qn('status')} IN ({statuses})"
    )
    return _Plan(select=select, parts=(parts[0], parts[1], parts[2]))


def job_uuid(value: Any) -> uuid.UUID:
    """A job id (a UUID or its text) as a UUID, the rows' keys."""
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def jobs_waiting(job_ids: Collection[Any]) -> dict[uuid.UUID, Job]:
    """The rows of these jobs that wait (queued or parked), each with its tenant and shard
    cached as `select_related("tenant__shard")` leaves them; by id."""
    ids = {job_uuid(job_id) for job_id in job_ids}
    if not ids:
        return {}
    db = router.db_for_read(Job)
    connection = connections[db]
    plan = _plan(db)
    pk = Job._meta.get_field("id")
    params: list[Any] = [pk.get_db_prep_value(i, connection) for i in ids]
    params += [str(s) for s in WAITING]
    with hot_cursor(connection) as cursor:  # prepared on PostgreSQL: the join is planned once
        cursor.execute(plan.select.format(ids=", ".join(["%s"] * len(ids))), params)
        rows = cursor.fetchall()
    found: dict[uuid.UUID, Job] = {}
    for row in rows:
        job = _build(plan, db, connection, row)
        found[job.pk] = job
    return found


def _build(plan: _Plan, db: str, connection: Any, row: Sequence[Any]) -> Job:
    values = list(row)
    instances = []
    for part in plan.parts:
        for pos, convs, col in part.converters:
            value = values[pos]
            for convert in convs:
                value = convert(value, col, connection)
            values[pos] = value
        instances.append(part.model.from_db(db, part.attnames, values[part.start : part.end]))
    job, tenant, shard = instances
    # What select_related's populators set: the forward relations' caches.
    Job._meta.get_field("tenant").set_cached_value(job, tenant)
    Tenant._meta.get_field("shard").set_cached_value(tenant, shard)
    return job  # type: ignore[return-value]
