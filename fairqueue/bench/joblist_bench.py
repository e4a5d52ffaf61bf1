"""`manage.py bench job-list`: the API's job list (`GET /api/v1/jobs`) over one tenant's
history of a million jobs: the first page, page 1,000 reached by cursor, each filter (its
first page and a page deep into it), the bounded total and the deprecated offset at its cap;
and what the filters' indexes cost the writes of each job.

The seed (`--rows` jobs of the tenant `bench-list`, and `--other-rows` of nine other tenants
mixed in, so one tenant's rows are spread over the table as in a shared database): statuses,
tasks and sub-tenants in the shares of STATUSES, TASKS and the sub-tenant constants, written in bulk (COPY on
PostgreSQL, fairqueue.jobs.copy_insert; bulk_create elsewhere), then VACUUM ANALYZE (what
autovacuum does within a minute of a load). The rows are submitted as they are written, one
after another, so the time range is a slice of that order (TIME_RANGE_SHARE of the rows).

Each case is one request through Django's test client with the tenant's key (the whole API
view: authentication, validation, the selector, the JSON answer; no socket), WARMUP times
unmeasured, then `--requests` times: its P50, P99 and maximum, against TARGET_MS. On
PostgreSQL, EXPLAIN ANALYZE of the case's query gives the indexes it reads and the database's
own time. The walk to page 1,000 (`--walk-pages`) follows `next` from the first page, counting
each page's time too, and checks that no job comes twice. `all_met`: every case of the
target (the first page, page 1,000, each filter alone, first and deep) has a P99 within it;
the combinations of two filters, the bounded total and the offset are measured beside them.

The write cost: `--write-rows` new jobs of the tenant inserted in bulk, then claimed and
finished (two UPDATEs of each row, WRITE_BATCH rows per statement, as a worker's group commit
writes them), with the filters' indexes and with them dropped, in rolled-back transactions,
alternating for `--write-rounds` rounds each way: the medians per 1,000 jobs and their ratio.

With --database-url the run happens in a child process on that PostgreSQL database: created
afresh and migrated, or with --reuse kept (and its seed with it, when it has the same size).
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection, transaction
from django.db.models import QuerySet
from django.test import Client
from django.test.utils import CaptureQueriesContext

from fairqueue.bench import stack
from fairqueue.jobs.copy_insert import rows_copy
from fairqueue.jobs.list_cursor import cursor_encode
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.selectors import JobListFilters, job_list, job_list_rows
from tenants.models import Shard, Tenant

TENANT = "bench-list"
OTHER_TENANTS = 9
SHARD = "bench-list"
LIST_PATH = "/api/v1/jobs"
TARGET_MS = 50.0
WARMUP = 5
SEED = 43
CHUNK = 20_000
SIZES = {
    "full": {
        "rows": 1_000_000,
        "other_rows": 1_000_000,
        "requests": 200,
        "walk_pages": 1000,
        "write_rows": 20_000,
        "write_rounds": 5,
    },
    "quick": {
        "rows": 3_000,
        "other_rows": 1_000,
        "requests": 5,
        "walk_pages": 10,
        "write_rows": 500,
        "write_rounds": 1,
    },
}
LIMIT = 50
# Shares of the seeded rows (each row draws one of each independently).
STATUSES = {
    JobStatus.SUCCEEDED: 0.70,
    JobStatus.PARKED: 0.20,
    JobStatus.FAILED: 0.05,
    JobStatus.QUEUED: 0.02,
    JobStatus.CANCELLED: 0.02,
    JobStatus.RUNNING: 0.005,
    JobStatus.SCHEDULED: 0.003,
    JobStatus.RETRYING: 0.002,
}
TASKS = {"demo.noop": 0.80, "invoices.send": 0.19, "reports.build": 0.01}
BIG_SUB_TENANT = "cust-big"
BIG_SUB_TENANT_SHARE = 0.10
SMALL_SUB_TENANTS = 1000  # cust-0 .. cust-999 share SMALL_SUB_TENANT_SHARE of the rows
SMALL_SUB_TENANT_SHARE = 0.20
TIME_RANGE_SHARE = 0.01
DEEP_ROW = 50_000  # the deep page of a filter starts here (or halfway, for a smaller filter)
OFFSET_CAP = 10_000


def _draw(rng: random.Random, shares: dict[Any, float]) -> Any:
    roll = rng.random()
    for value, share in shares.items():
        roll -= share
        if roll < 0:
            return value
    return next(iter(shares))


def _sub_tenant(rng: random.Random) -> str:
    roll = rng.random()
    if roll < BIG_SUB_TENANT_SHARE:
        return BIG_SUB_TENANT
    if roll < BIG_SUB_TENANT_SHARE + SMALL_SUB_TENANT_SHARE:
        return f"cust-{rng.randrange(SMALL_SUB_TENANTS)}"
    return ""


def _tenants() -> tuple[Tenant, list[Tenant], str]:
    """The bench tenant (with a new key, returned) and the others, made if missing."""
    shard, _ = Shard.objects.get_or_create(name=SHARD, defaults={"capacity": 100})
    others = [
        Tenant.objects.get_or_create(slug=f"{TENANT}-other-{i}", defaults={"name": f"other {i}", "shard": shard})[0]
        for i in range(OTHER_TENANTS)
    ]
    tenant, _ = Tenant.objects.get_or_create(slug=TENANT, defaults={"name": TENANT, "shard": shard})
    key = tenant.rotate_api_key()
    tenant.save()
    return tenant, others, key


def _rows(rng: random.Random, tenant: Tenant, others: list[Tenant], mine: int, theirs: int) -> Iterator[Job]:
    """`mine` + `theirs` new rows, the tenant's at random places among the others'."""
    left_mine, left_theirs = mine, theirs
    tag = f"s:{SHARD}"
    while left_mine + left_theirs:
        is_mine = rng.random() < left_mine / (left_mine + left_theirs)
        if is_mine:
            left_mine -= 1
        else:
            left_theirs -= 1
        status = _draw(rng, STATUSES)
        yield Job(
            id=uuid.UUID(int=rng.getrandbits(128), version=4),
            tenant=tenant if is_mine else others[rng.randrange(len(others))],
            task=_draw(rng, TASKS),
            sub_tenant=_sub_tenant(rng),
            latency_class="default",
            status=status,
            attempts=1 if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.RUNNING) else 0,
            engine_tag=tag,
        )


def _seed(tenant: Tenant, others: list[Tenant], rows: int, other_rows: int, log: Callable[[str], None]) -> None:
    started = time.monotonic()
    rng = random.Random(SEED)
    batch: list[Job] = []
    written = 0

    def flush() -> None:
        nonlocal written
        with transaction.atomic():
            if connection.vendor == "postgresql":
                rows_copy(Job, batch)
            else:
                Job.objects.bulk_create(batch, batch_size=2000)
        written += len(batch)
        batch.clear()
        if written % (CHUNK * 10) == 0:
            log(f"  {written:,} rows ({time.monotonic() - started:.0f} s)")

    for job in _rows(rng, tenant, others, rows, other_rows):
        batch.append(job)
        if len(batch) == CHUNK:
            flush()
    if batch:
        flush()
    log(f"  seeded {written:,} rows in {time.monotonic() - started:.0f} s")


def _vacuum_analyze() -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"VACUUM ANALYZE {Job._meta.db_table}")
        else:
            cursor.execute(f"ANALYZE {Job._meta.db_table}")


def _seed_if_needed(rows: int, other_rows: int, log: Callable[[str], None]) -> tuple[Tenant, str]:
    tenant, others, key = _tenants()
    have = Job.objects.filter(tenant=tenant).count()
    have_others = Job.objects.filter(tenant__in=others).count()
    if (have, have_others) == (rows, other_rows):
        log(f"  {rows:,} + {other_rows:,} rows already seeded: kept")
    else:
        _delete_jobs([tenant, *others])
        _seed(tenant, others, rows, other_rows, log)
    _vacuum_analyze()
    return tenant, key


def _delete_jobs(tenants: list[Tenant]) -> None:
    # In SQL: the ORM would read every row's id first (the job table has reverse relations).
    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {Job._meta.db_table} WHERE tenant_id IN ({', '.join(['%s'] * len(tenants))})",
            [t.pk for t in tenants],
        )


def _percentile(sorted_ms: list[float], q: float) -> float:
    """The nearest-rank percentile (P99 of 200 samples: the second slowest)."""
    return sorted_ms[max(0, math.ceil(q / 100 * len(sorted_ms)) - 1)]


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(_percentile(ordered, 50), 2),
        "p99_ms": round(_percentile(ordered, 99), 2),
        "max_ms": round(ordered[-1], 2),
    }


def _indexes(plan: Any) -> list[str]:
    """The indexes a JSON EXPLAIN plan reads, in plan order."""
    found: list[str] = []
    stack_ = [plan]
    while stack_:
        node = stack_.pop()
        if isinstance(node, dict):
            if "Index Name" in node and node["Index Name"] not in found:
                found.append(node["Index Name"])
            stack_.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            stack_.extend(reversed(node))
    return found


def _plans(tenant: Tenant, params: dict[str, Any]) -> dict[str, Any]:
    """The statements the list runs for `params` (the selector called as the view calls it)
    and, on PostgreSQL, each one's EXPLAIN ANALYZE: the indexes it reads, the database's time."""
    with CaptureQueriesContext(connection) as captured:
        job_list(
            tenant=tenant,
            filters=_filters(params),
            limit=int(params.get("limit", LIMIT)),
            cursor=params.get("cursor"),
            offset=int(params.get("offset", 0)),
            with_total=params.get("total") == "true",
        )
    statements = [q["sql"] for q in captured.captured_queries]
    if connection.vendor != "postgresql":
        return {"statements": len(statements)}
    plans = []
    with connection.cursor() as cursor:
        for sql in statements:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
            plan = cursor.fetchone()[0]
            plan = json.loads(plan) if isinstance(plan, str) else plan
            plans.append({"indexes": _indexes(plan), "db_ms": round(plan[0]["Execution Time"], 3)})
    return {
        "statements": len(statements),
        "indexes": [name for p in plans for name in p["indexes"]],
        "db_ms": round(sum(p["db_ms"] for p in plans), 3),
    }


def _filters(params: dict[str, Any]) -> JobListFilters:
    def moment(name: str) -> datetime | None:
        return datetime.fromisoformat(params[name]) if params.get(name) else None

    return JobListFilters(
        status=params.get("status"),
        task=params.get("task"),
        sub_tenant=params.get("sub_tenant"),
        submitted_since=moment("submitted_since"),
        submitted_before=moment("submitted_before"),
    )


class _Api:
    def __init__(self, key: str) -> None:
        self.client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")

    def get(self, params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        started = time.perf_counter()
        response = self.client.get(LIST_PATH, params)
        took = (time.perf_counter() - started) * 1000
        if response.status_code != 200:
            raise RuntimeError(f"GET {LIST_PATH} {params}: {response.status_code} {response.content[:300]!r}")
        return took, response.json()


def _measure(api: _Api, params: dict[str, Any], requests: int) -> dict[str, Any]:
    for _ in range(WARMUP):
        api.get(params)
    samples = []
    page: dict[str, Any] = {}
    for _ in range(requests):
        took, page = api.get(params)
        samples.append(took)
    return {**_summary(samples), "items": len(page["items"]), "has_more": page["has_more"]}


def _deep_cursor(qs: QuerySet[Job]) -> str | None:
    """The cursor of the page that starts DEEP_ROW rows into `qs` (halfway into a smaller one)."""
    count = qs[: DEEP_ROW + 1].count()
    place = DEEP_ROW if count > DEEP_ROW else count // 2
    if place == 0:
        return None
    row = qs[place - 1 : place].get()
    return cursor_encode(row)


def _cases(tenant: Tenant) -> list[tuple[str, dict[str, Any]]]:
    """(name, query parameters) of each filter, its values read off the seed."""
    mine = job_list_rows(tenant=tenant, filters=JobListFilters())
    count = mine.count()
    start = int(count * 0.4)
    window = max(1, int(count * TIME_RANGE_SHARE))
    times = list(mine[start : start + window + 1].values_list("submitted_at", flat=True))
    before, since = times[0], times[-1]  # newest first: the window's newest row sits at its start
    return [
        ("status=parked", {"status": "parked"}),
        ("status=failed", {"status": "failed"}),
        ("status=running", {"status": "running"}),
        ("task=invoices.send", {"task": "invoices.send"}),
        ("task=reports.build", {"task": "reports.build"}),
        (f"sub_tenant={BIG_SUB_TENANT}", {"sub_tenant": BIG_SUB_TENANT}),
        ("sub_tenant=cust-7", {"sub_tenant": "cust-7"}),
        (
            "time range (1 % of the rows)",
            {"submitted_since": since.isoformat(), "submitted_before": before.isoformat()},
        ),
        ("status=failed&task=reports.build", {"status": "failed", "task": "reports.build"}),
        ("status=parked&sub_tenant=cust-7", {"status": "parked", "sub_tenant": "cust-7"}),
    ]


def _walk(api: _Api, pages: int, limit: int) -> tuple[dict[str, Any], str | None]:
    """Follow `next` from the first page to page `pages`; its times, and the last cursor."""
    samples = []
    seen: set[str] = set()
    listed = 0
    cursor = None
    for _ in range(pages - 1):
        took, page = api.get({"limit": limit, **({"cursor": cursor} if cursor else {})})
        samples.append(took)
        listed += len(page["items"])
        seen.update(item["id"] for item in page["items"])
        cursor = page["next"]
        if cursor is None:
            break
    return {
        "pages": len(samples),
        **_summary(samples),
        "jobs_listed": listed,
        "each_once": len(seen) == listed,
    }, cursor


# The indexes the list's filters added (migration 0013): what they cost each job's writes.
FILTER_INDEXES = ("job_tenant_task", "job_tenant_sub_tenant")
WRITE_BATCH = 100  # rows per UPDATE, as a worker's group commit claims and records them


def _write_round(tenant: Tenant, rows: int, *, indexes: bool, rng: random.Random) -> tuple[float, float]:
    """Insert `rows` jobs in bulk, then claim and finish them (two UPDATEs of each row, in
    batches), with or without FILTER_INDEXES (dropped inside the transaction); all rolled
    back. Milliseconds per 1,000 jobs: (insert, the two updates)."""
    with transaction.atomic():
        if not indexes:
            with connection.cursor() as cursor:
                for name in FILTER_INDEXES:
                    cursor.execute(f"DROP INDEX {name}")
        jobs = list(_rows(rng, tenant, [tenant], rows, 0))
        started = time.perf_counter()
        if connection.vendor == "postgresql":
            rows_copy(Job, jobs)
        else:
            Job.objects.bulk_create(jobs, batch_size=2000)
        inserted = time.perf_counter()
        ids = [j.id for j in jobs]
        for i in range(0, len(ids), WRITE_BATCH):
            batch = Job.objects.filter(id__in=ids[i : i + WRITE_BATCH])
            batch.update(status=JobStatus.RUNNING)
            batch.update(status=JobStatus.SUCCEEDED)
        updated = time.perf_counter()
        transaction.set_rollback(True)
    per_thousand = 1000 / rows
    return (inserted - started) * 1000 * per_thousand, (updated - inserted) * 1000 * per_thousand


def _write_cost(tenant: Tenant, rows: int, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    """_write_round with and without the filters' indexes, alternating, `rounds` times each:
    the medians and their ratios."""
    rng = random.Random(SEED + 1)
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(rounds):
        for indexes in (True, False):
            times[indexes].append(_write_round(tenant, rows, indexes=indexes, rng=rng))
    _vacuum_analyze()  # the rolled-back rows' dead entries

    def median(values: list[float]) -> float:
        return round(sorted(values)[len(values) // 2], 2)

    result = {
        "rows": rows,
        "rounds": rounds,
        "insert_ms_per_1000": median([t[0] for t in times[True]]),
        "insert_ms_per_1000_without": median([t[0] for t in times[False]]),
        "updates_ms_per_1000": median([t[1] for t in times[True]]),
        "updates_ms_per_1000_without": median([t[1] for t in times[False]]),
    }
    result["insert_ratio"] = round(result["insert_ms_per_1000"] / result["insert_ms_per_1000_without"], 3)
    result["updates_ratio"] = round(result["updates_ms_per_1000"] / result["updates_ms_per_1000_without"], 3)
    log(f"  {result}")
    return result


def run(
    *,
    rows: int,
    other_rows: int,
    requests: int,
    walk_pages: int,
    write_rows: int,
    write_rounds: int,
    limit: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    log(f"seed: {rows:,} jobs of {TENANT}, {other_rows:,} of {OTHER_TENANTS} other tenants")
    tenant, key = _seed_if_needed(rows, other_rows, log)
    api = _Api(key)
    results = []

    def case(name: str, params: dict[str, Any], *, in_target: bool = True) -> None:
        asked = {"limit": limit, **params}
        measured = _measure(api, asked, requests)
        result = {"name": name, "params": params, **measured, **_plans(tenant, asked)}
        result["met"] = result["p99_ms"] <= TARGET_MS
        result["in_target"] = in_target
        log(f"  {name}: P99 {result['p99_ms']} ms, {result.get('indexes', '')} {result.get('db_ms', '')}")
        results.append(result)

    case("first page", {})
    log(f"walk: {walk_pages:,} pages of {limit} by cursor")
    walk, cursor = _walk(api, walk_pages, limit)
    log(f"  {walk}")
    if cursor is not None:
        case(f"page {walk_pages:,} by cursor", {"cursor": cursor})
    for name, params in _cases(tenant):
        single = len(params) == 1 or "submitted_since" in params  # one filter (a range is one)
        case(name, params, in_target=single)
        deep = _deep_cursor(job_list_rows(tenant=tenant, filters=_filters(params)))
        if deep is not None:
            case(f"{name}, deep page by cursor", {**params, "cursor": deep}, in_target=single)
    # Beyond the target (first page, page 1,000, each filter), measured all the same.
    case("total=true (past its cap)", {"total": "true"}, in_target=False)
    case("status=running&total=true", {"status": "running", "total": "true"}, in_target=False)
    case(f"offset={OFFSET_CAP:,} (deprecated; its cap)", {"offset": OFFSET_CAP}, in_target=False)
    log(f"write cost of {', '.join(FILTER_INDEXES)}: {write_rows:,} jobs, {write_rounds} rounds with and without")
    write_cost = _write_cost(tenant, write_rows, write_rounds, log)
    log(f"the seed stays for the next run (kept when it has the same size); tenants {TENANT}* hold it")
    return {
        "database": connection.vendor,
        "rows": rows,
        "other_rows": other_rows,
        "limit": limit,
        "requests": requests,
        "target_ms": TARGET_MS,
        "walk": walk,
        "cases": results,
        "write_cost": write_cost,
        # The target's cases: the first page, page `walk_pages` and each filter alone.
        "all_met": all(r["met"] for r in results if r["in_target"]),
        "load_average": os.getloadavg()[0],
    }


def add_arguments(parser: Any) -> None:
    parser.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
    parser.add_argument("--quick", action="store_true", help="a small seed and few requests (smoke test)")
    parser.add_argument("--rows", type=int, help=f"jobs of the tenant (default {SIZES['full']['rows']:,})")
    parser.add_argument("--other-rows", type=int, help="jobs of the other tenants (default as many)")
    parser.add_argument("--requests", type=int, help="measured requests per case (default 200)")
    parser.add_argument("--walk-pages", type=int, help="the page the walk by cursor reaches (default 1,000)")
    parser.add_argument("--write-rows", type=int, help="jobs per round of the write cost (default 20,000)")
    parser.add_argument("--write-rounds", type=int, help="rounds of the write cost, each way (default 5)")
    parser.add_argument("--limit", type=int, default=LIMIT, help=f"jobs per page (default {LIMIT})")
    parser.add_argument("--database-url", help="a PostgreSQL server URL: run on a database of that name")
    parser.add_argument("--reuse", action="store_true", help="with --database-url: keep the database and its seed")
    parser.add_argument(
        "--redis-url", default=stack.DEFAULT_REDIS_URL, help="with --database-url: an EMPTY Redis database"
    )
    parser.add_argument("--force", action="store_true", help="empty the Redis database even if it holds data")


def _sizes(options: dict[str, Any]) -> dict[str, int]:
    sizes = dict(SIZES["quick" if options["quick"] else "full"])
    for name in sizes:
        if options.get(name) is not None:
            sizes[name] = options[name]
    if options.get("rows") is not None and options.get("other_rows") is None:
        sizes["other_rows"] = options["rows"]
    if min(sizes["rows"], sizes["requests"], sizes["write_rows"], sizes["write_rounds"]) < 1:
        raise RuntimeError("--rows, --requests, --write-rows and --write-rounds must be at least 1")
    if sizes["other_rows"] < 0 or sizes["walk_pages"] < 2:
        raise RuntimeError("--other-rows must be at least 0 and --walk-pages at least 2")
    if not 1 <= options["limit"] <= 500:
        raise RuntimeError("--limit must be 1-500 (the API's own bounds)")
    return sizes


def _postgres_database(server_url: str, *, reuse: bool) -> str:
    """The URL of the bench's database on the server: fresh, or kept as it is with `reuse`."""
    base = server_url.rstrip("/")
    name = base.rpartition("/")[2] if base.count("/") > 2 else ""
    name = name or "fq_job_list_bench"
    if not reuse:
        return stack.fresh_postgres(server_url, name)
    server = base.rpartition("/")[0] if base.count("/") > 2 else base
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')
    return f"{server}/{name}"


def run_command(options: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """With --database-url: a child process on that PostgreSQL database; else here."""
    sizes = _sizes(options)
    url = options.get("database_url")
    if not url:
        # The tenant's new key and the policy sync write to Redis: refuse one that holds data unless told.
        stack.redis_db_prepare(settings.REDIS_URL, force=options["force"])
        try:
            return run(**sizes, limit=options["limit"], log=log)
        finally:
            stack.redis_db_flush(settings.REDIS_URL)
    stack.redis_db_prepare(options["redis_url"], force=options["force"])
    env = {
        **os.environ,
        "DATABASE_URL": _postgres_database(url, reuse=options["reuse"]),
        "REDIS_URL": options["redis_url"],
    }
    manage = Path(settings.BASE_DIR) / "manage.py"
    subprocess.run([sys.executable, str(manage), "migrate", "-v0"], env=env, check=True)
    out = Path(options.get("json_path") or "job-list-bench.json").resolve()
    args = [sys.executable, str(manage), "bench", "job-list", "--force", "--json", str(out)]
    args += [f"--{name.replace('_', '-')}={value}" for name, value in sizes.items()]
    args += [f"--limit={options['limit']}"]
    subprocess.run(args, env=env, check=True)
    return dict(json.loads(out.read_text()))
