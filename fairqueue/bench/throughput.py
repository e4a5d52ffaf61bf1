"""`manage.py bench throughput`: what the submit path and FairQueue's whole path cost.

One run, one fresh stack (a new database, PostgreSQL when --database-url names a server,
the bench's own flushed Redis database, the production web server: gunicorn with uvicorn
worker processes, DEBUG off), reports:

- ``single_http_jobs_per_s``: `POST /api/v1/jobs` from CLIENTS concurrent keep-alive
  clients (one HTTP/1.1 connection each, a lean client: _KeepAliveClient), each sending its
  next request when its last one is answered;
- ``single_http_p50_ms_at_200`` / ``single_http_p99_ms_at_200``: the latency of the same
  request sent open-loop at a fixed 200 requests/s (measured from when each request was
  due, so a server that falls behind is not flattered by a client that waits);
- ``bulk_http_jobs_per_s``: `POST /api/v1/jobs/bulk` with 500 jobs per request from
  BULK_CLIENTS concurrent clients (with it, in the context: the web processes' CPU per
  bulk job from /proc, and the Redis commands and FCALLs per bulk request; ``--only bulk``
  runs this part alone);
- ``noop_jobs_per_s_celery`` and ``noop_jobs_per_s_fairqueue``: the same number of no-op
  jobs from submit to finish on the same worker processes (same threads): plain Celery
  (`send_task` of a task that does nothing, one call per job from this process), then
  FairQueue's full path (`demo.noop` submitted through `POST /api/v1/jobs/bulk`, 500 per
  request, admitted, published, claimed, run, recorded and released). jobs/s = jobs /
  (last finish - first submit); Celery's last finish is when its queue and kombu's unacked
  hash are first seen empty (polled every POLL_S), FairQueue's is the latest `finished_at`;
- ``redis_cmds_per_job`` and ``db_queries_per_job``, counted during FairQueue's no-op run
  and divided by its jobs: every command the Redis server executed (`INFO commandstats`,
  commands run inside engine functions included, the bench's own INFO calls excluded;
  heartbeats and periodic duties of the workers included), and every SQL statement the web
  and worker processes sent (counted by an execute wrapper in each process,
  fairqueue.bench.querycount; BEGIN/COMMIT not included);
- ``database``: ``postgresql`` or ``sqlite``.

No jobs are left over between phases: the job table is emptied and Redis flushed before
the no-op runs (the tenants' limits are set so that no job of the bench ever waits on
one: the bench measures the cost of the path, not the throttle).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
from django.db import connection

from fairqueue.bench import querycount, stack
from fairqueue.jobs.broker import JOBS_QUEUE

Log = Callable[[str], None]

RESULT_KEYS = (
    "single_http_jobs_per_s",
    "single_http_p50_ms_at_200",
    "single_http_p99_ms_at_200",
    "bulk_http_jobs_per_s",
    "noop_jobs_per_s_fairqueue",
    "noop_jobs_per_s_celery",
    "redis_cmds_per_job",
    "db_queries_per_job",
    "database",
)
CLIENTS = 16
OPEN_LOOP_RATE = 200.0  # requests per second
BULK_SIZE = 500
BULK_CLIENTS = 4
POLL_S = 0.01
# FairQueue's end is read from the rows (the latest finished_at), not from when the poll saw
# it, so its poll can be rare: each is a count over the phase's rows in the database the
# measured workers are writing to.
ROWS_POLL_S = 0.5
SHARD_NAME = "bench"
UNBOUNDED = 1_000_000  # floor and shard capacity no job of the bench can reach
BROKER_PREFIX = "fq:celery:"  # CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"]
PRIORITY_STEPS = 10  # CELERY_BROKER_TRANSPORT_OPTIONS["priority_steps"]
KOMBU_SEP = "\x06\x16"  # kombu's Redis transport: a priority list is queue + sep + level
DATABASE_NAME = "fq_bench_throughput"
PHASES = ("http", "noop")
#: `--only` choices: a part of PHASES, or `bulk`, the bulk submit of the http part alone.
ONLY = (*PHASES, "bulk")
COUNT_DIR_ENV = "FAIRQUEUE_BENCH_QUERY_COUNT_DIR"  # settings installs fairqueue.bench.querycount


@dataclass(frozen=True)
class Sizes:
    single_requests: int = 6000
    open_loop_seconds: float = 15.0
    bulk_requests: int = 40
    noop_jobs: int = 5000
    workers: int = 2
    slots_per_worker: int = 8
    web_processes: int = 4


PRESETS = {
    "default": Sizes(),
    "quick": Sizes(
        single_requests=200,
        open_loop_seconds=1.5,
        bulk_requests=4,
        noop_jobs=300,
        workers=1,
        slots_per_worker=4,
        web_processes=2,
    ),
}


# --- orchestration (the bench process) -----------------------------------------------------


def add_arguments(parser: Any) -> None:
    parser.add_argument("--quick", action="store_true", help="small counts (smoke test): shape, not figures")
    parser.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
    parser.add_argument(
        "--database-url",
        default=None,
        help=f"a PostgreSQL server URL (e.g. postgres://postgres@127.0.0.1:5432/): the bench creates database "
        f"{DATABASE_NAME} on it (or --database-name); without it a SQLite file",
    )
    parser.add_argument(
        "--database-name",
        default=DATABASE_NAME,
        help="the database the bench drops and creates on the --database-url server (two runs side by side)",
    )
    parser.add_argument(
        "--only",
        choices=ONLY,
        default=None,
        help="run one part: `noop` (the no-op runs, plain Celery and FairQueue), `http` (the submit figures) or "
        "`bulk` (the bulk submit alone); the other parts' figures are null",
    )
    stack.add_redis_arguments(parser)
    parser.add_argument("--workers", type=int, default=None, help="worker processes for the no-op runs")
    parser.add_argument("--slots-per-worker", type=int, default=None, help="thread slots per worker")
    parser.add_argument("--web-processes", type=int, default=None, help="gunicorn worker processes")
    parser.add_argument("--noop-jobs", type=int, default=None, help="jobs per no-op run (default 5000)")
    parser.add_argument(
        "--bulk-requests", type=int, default=None, help=f"bulk requests of {BULK_SIZE} jobs (default 40)"
    )


def run_command(options: dict[str, Any], *, log: Log) -> dict[str, Any]:
    sizes = PRESETS["quick" if options["quick"] else "default"]
    overrides = {
        "workers": options.get("workers"),
        "slots_per_worker": options.get("slots_per_worker"),
        "web_processes": options.get("web_processes"),
        "noop_jobs": options.get("noop_jobs"),
        "bulk_requests": options.get("bulk_requests"),
    }
    sizes = replace(sizes, **{k: v for k, v in overrides.items() if v})
    return run(
        redis_url=options["redis_url"],
        database_url=options.get("database_url"),
        database_name=options.get("database_name") or DATABASE_NAME,
        sizes=sizes,
        phases=(options["only"],) if options.get("only") else PHASES,
        force=options["force"],
        log=log,
    )


def run(
    *,
    redis_url: str,
    database_url: str | None,
    sizes: Sizes,
    database_name: str = DATABASE_NAME,
    phases: tuple[str, ...] = PHASES,
    force: bool = False,
    log: Log = print,
) -> dict[str, Any]:
    stack.redis_db_prepare(redis_url, force=force)
    db_path = stack.BENCH_DIR / "throughput.sqlite3"
    with tempfile.TemporaryDirectory() as tmp:
        extra = {COUNT_DIR_ENV: str(Path(tmp) / "queries")}
        if database_url:
            url = stack.fresh_postgres(database_url, database_name)
            env = stack.stack_env(redis_url=redis_url, db_path=db_path, database_url=url, **extra)
            stack.migrate(env)
        else:
            env = stack.stack_env(redis_url=redis_url, db_path=db_path, **extra)
            stack.fresh_database(db_path, env)
        log(
            f"bench throughput ({'postgresql' if database_url else 'sqlite'}): {sizes.web_processes} web processes, "
            f"{sizes.workers} workers x {sizes.slots_per_worker} slots, {sizes.noop_jobs} no-op jobs per run"
        )
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"sizes": asdict(sizes), "phases": list(phases)}))
        try:
            stack.run_child("fairqueue.bench.throughput", ["--child", str(spec), str(out)], env=env, timeout=1800)
            doc: dict[str, Any] = json.loads(out.read_text())
        finally:
            stack.redis_db_flush(redis_url)
    result = {key: doc["result"].get(key) for key in RESULT_KEYS}
    for line in report_lines(result, doc["context"]):
        log(line)
    return result


def report_lines(result: dict[str, Any], context: dict[str, Any]) -> list[str]:
    lines = [""]
    lines += [f"{key:<28} {value}" for key, value in result.items()]
    lines.append("")
    lines += [f"  {key}: {value}" for key, value in context.items()]
    return lines


# --- the child process (Django configured for the bench's stack) -----------------------------------


def _setup_policy() -> dict[str, str]:
    """One tenant per phase, none ever waiting on a limit; returns slug -> raw API key."""
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from tenants.models import Shard, Tenant
    from tenants.sync import policy_sync_all

    shard, _ = Shard.objects.get_or_create(name=SHARD_NAME, defaults={"capacity": UNBOUNDED})
    keys: dict[str, str] = {}
    for slug in ("single", "latency", "bulk", "noop"):
        tenant = Tenant(slug=slug, name=slug, shard=shard, floor=UNBOUNDED)
        keys[slug] = tenant.rotate_api_key()
        tenant.save()
    policy_sync_all()
    _engine_ready()
    return keys


def _engine_ready() -> None:
    """Mark the shard's engine state complete, as a worker's first tick would (no worker
    runs during the HTTP phases, and admissions wait for a ready state)."""
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from fairqueue.jobs.recovery import state_ensure

    state_ensure()


def _commandstats(client: redis.Redis) -> dict[str, int]:
    return {name: int(stat["calls"]) for name, stat in client.info("commandstats").items()}


def _redis_commands_between(before: dict[str, int], after: dict[str, int]) -> int:
    """Commands the server ran between two INFO reads, not counting the INFO calls."""
    return sum(after.get(name, 0) - before.get(name, 0) for name in after if name != "cmdstat_info")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def _post(session: Any, url: str, key: str, body: Any) -> None:
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        await response.read()
        if response.status != 202:
            raise RuntimeError(f"{url}: HTTP {response.status}")


def _session(connections: int) -> Any:
    import aiohttp  # a dev dependency (requirements-dev.txt): only the bench child needs it

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, force_close=False),
        timeout=aiohttp.ClientTimeout(total=120),
    )


class _KeepAliveClient:
    """One keep-alive HTTP/1.1 connection that POSTs the same JSON body again and again:
    the request's bytes are built once and the answer read by its Content-Length, so the
    load generator (which shares the machine's cores with the server it measures) spends
    little CPU per request. Each request is still a full one: sent, answered, read whole."""

    def __init__(self, base: str, path: str, key: str, body: Any) -> None:
        parts = urlsplit(base)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        self.request = head.encode() + data
        self.url = base + path
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(self.request)
        status = int((await self.reader.readline()).split(b" ", 2)[1])
        length, close = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                close = True
            elif name == b"transfer-encoding":  # never for Django's answers, which carry a length
                raise RuntimeError(f"{self.url}: a chunked answer, which this client does not read")
        await self.reader.readexactly(length)
        if close:
            await self.close()
        if status != 202:
            raise RuntimeError(f"{self.url}: HTTP {status}")

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()
            self.reader = self.writer = None


async def _closed_loop(base: str, key: str, body: Any, *, path: str, requests: int, clients: int) -> float:
    """`clients` keep-alive clients, each sending its next request when answered; seconds taken."""
    connections = [_KeepAliveClient(base, path, key, body) for _ in range(clients)]
    try:
        await asyncio.gather(*[c.post() for c in connections])  # warm up: connected, key cached
        left = requests

        async def client(connection: _KeepAliveClient) -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await connection.post()

        started = time.perf_counter()
        await asyncio.gather(*[client(c) for c in connections])
        return time.perf_counter() - started
    finally:
        await asyncio.gather(*[c.close() for c in connections])


async def _open_loop(base: str, key: str, body: Any, *, rate: float, seconds: float) -> list[float]:
    """Requests due every 1/rate s whatever the answers; latency (ms) from when each was due."""
    url = base + "/api/v1/jobs"
    count = int(rate * seconds)
    latencies: list[float] = []
    async with _session(CLIENTS * 4) as session:
        await asyncio.gather(*[_post(session, url, key, body) for _ in range(CLIENTS)])  # warm up
        start = time.perf_counter() + 0.05

        async def one(i: int) -> None:
            due = start + i / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await _post(session, url, key, body)
            latencies.append((time.perf_counter() - due) * 1000)

        await asyncio.gather(*[one(i) for i in range(count)])
    return latencies


def _reset(client: redis.Redis) -> None:
    """No job of an earlier phase is left: rows gone, Redis (engine, broker, signals) flushed,
    policy written again."""
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from fairqueue.jobs.models import Job
    from tenants.sync import policy_sync_all

    Job.objects.all().delete()
    client.flushdb()
    policy_sync_all()
    _engine_ready()


def _broker_empty(client: redis.Redis) -> bool:
    pipe = client.pipeline(transaction=False)
    for level in range(PRIORITY_STEPS):
        pipe.llen(BROKER_PREFIX + (JOBS_QUEUE if level == 0 else f"{JOBS_QUEUE}{KOMBU_SEP}{level}"))
    pipe.hlen(BROKER_PREFIX + "unacked")
    return not any(pipe.execute())


def _noop_celery(client: redis.Redis, jobs: int) -> float:
    """Plain Celery: send_task of a no-op per job; seconds from the first send until the
    broker holds nothing (queued or unacknowledged) on two reads in a row."""
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from fairqueue.bench.tasks import PLAIN_NOOP_TASK_NAME
    from fairqueue.celery import app

    started = time.perf_counter()
    for _ in range(jobs):
        app.send_task(PLAIN_NOOP_TASK_NAME, queue=JOBS_QUEUE)
    empty_since = None
    while True:
        if _broker_empty(client):
            if empty_since is not None:
                return empty_since - started
            empty_since = time.perf_counter()
        else:
            empty_since = None
        time.sleep(POLL_S)


def _noop_fairqueue(base: str, key: str, jobs: int, timeout: float) -> float:
    """FairQueue: demo.noop through the bulk API; seconds from the first submit to the last
    job's finished_at."""
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from django.db.models import Max

    from fairqueue.jobs.models import TERMINAL_STATUSES, Job, JobStatus

    body = {"task": "demo.noop", "args": {}}

    async def submit() -> None:
        async with _session(1) as session:
            for i in range(0, jobs, BULK_SIZE):
                await _post(session, base + "/api/v1/jobs/bulk", key, {"jobs": [body] * min(BULK_SIZE, jobs - i)})

    started_wall = time.time()
    asyncio.run(submit())
    deadline = time.monotonic() + timeout
    while Job.objects.filter(status__in=TERMINAL_STATUSES).count() < jobs:
        if time.monotonic() > deadline:
            raise RuntimeError(f"FairQueue no-op jobs not all finished within {timeout:.0f}s")
        time.sleep(ROWS_POLL_S)
    failed = Job.objects.exclude(status=JobStatus.SUCCEEDED).count()
    if failed:
        raise RuntimeError(f"{failed} no-op jobs did not succeed")
    last = Job.objects.aggregate(last=Max("finished_at"))["last"]
    return float(last.timestamp() - started_wall)


def child_main(spec_path: str, out_path: str) -> None:
    # The child configures Django itself: models and the app can be imported only after
    # django.setup(), so the functions above import them inside.
    import django

    # This process's own statements (setup, polling) are not the stack's: count only the
    # web and worker processes it starts.
    counts = os.environ.pop(COUNT_DIR_ENV)
    django.setup()
    from django.conf import settings

    spec = json.loads(Path(spec_path).read_text())
    sizes = Sizes(**spec["sizes"])
    phases = spec["phases"]
    client = redis.Redis.from_url(settings.REDIS_URL)
    keys = _setup_policy()
    database = "postgresql" if connection.vendor == "postgresql" else "sqlite"
    result: dict[str, Any] = {"database": database}
    context: dict[str, Any] = {}
    log_dir = stack.BENCH_DIR / "logs" / "throughput"
    env = {**os.environ, COUNT_DIR_ENV: counts}
    with stack.GunicornServer(env=env, log_dir=log_dir, processes=sizes.web_processes) as web:
        base = web.base_url
        if "http" in phases:
            _single_phases(base, keys, sizes, client, counts, result, context)
        if "http" in phases or "bulk" in phases:
            _bulk_phase(base, keys, sizes, client, web.proc.pid if web.proc else None, result, context)
        if "noop" in phases:
            _noop_phases(base, keys, sizes, client, counts, env, log_dir, result, context)
    if "noop" in phases:
        context["no-op ratio fairqueue / celery"] = round(
            result["noop_jobs_per_s_fairqueue"] / result["noop_jobs_per_s_celery"], 3
        )
    context["sizes"] = asdict(sizes)
    Path(out_path).write_text(json.dumps({"result": result, "context": context}))


def _single_phases(
    base: str,
    keys: dict[str, str],
    sizes: Sizes,
    client: redis.Redis,
    counts: str,
    result: dict[str, Any],
    context: dict[str, Any],
) -> None:
    body = {"task": "demo.noop", "args": {}}
    redis_before = _commandstats(client)
    sql_before = querycount.total(counts)
    seconds = asyncio.run(
        _closed_loop(base, keys["single"], body, path="/api/v1/jobs", requests=sizes.single_requests, clients=CLIENTS)
    )
    result["single_http_jobs_per_s"] = round(sizes.single_requests / seconds, 1)
    context["single submit: redis commands per request (incl. warm-up)"] = round(
        _redis_commands_between(redis_before, _commandstats(client)) / (sizes.single_requests + CLIENTS), 2
    )
    context["single submit: SQL statements per request (incl. warm-up)"] = round(
        (querycount.total(counts) - sql_before) / (sizes.single_requests + CLIENTS), 2
    )
    latencies = asyncio.run(
        _open_loop(base, keys["latency"], body, rate=OPEN_LOOP_RATE, seconds=sizes.open_loop_seconds)
    )
    result["single_http_p50_ms_at_200"] = round(statistics.median(latencies), 2)
    result["single_http_p99_ms_at_200"] = round(_percentile(latencies, 99), 2)
    context["open loop: requests, max ms"] = f"{len(latencies)}, {max(latencies):.1f}"


def _pids_cpu(pids: list[str]) -> dict[str, float]:
    """CPU seconds (user + system) each of `pids` has used so far, from /proc (a process
    that is gone, or not on this machine, is left out)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14 and 15 of stat)
    return out


def _processes_cpu(parent: int | None) -> float:
    """CPU seconds the children of `parent` (gunicorn's worker processes) have used so far."""
    if parent is None:
        return 0.0
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return 0.0
    return sum(_pids_cpu(children).values())


def _postgres_cpu() -> dict[str, float] | None:
    """CPU seconds so far of each PostgreSQL backend serving the bench's database (from
    /proc: None unless the server runs on this machine, or on SQLite)."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        pids = [str(pid) for (pid,) in cursor.fetchall()]
    cpu = _pids_cpu(pids)
    return cpu if pids and cpu else None


def _redis_cpu(client: redis.Redis) -> float:
    """CPU seconds (user + system, all its threads) the Redis server has used so far."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def _bulk_phase(
    base: str,
    keys: dict[str, str],
    sizes: Sizes,
    client: redis.Redis,
    web_pid: int | None,
    result: dict[str, Any],
    context: dict[str, Any],
) -> None:
    body = {"task": "demo.noop", "args": {}}
    bulk_body = {"jobs": [body] * BULK_SIZE}
    cpu_before = _processes_cpu(web_pid)
    redis_cpu_before = _redis_cpu(client)
    pg_before = _postgres_cpu()
    own_before = time.process_time()
    redis_before = _commandstats(client)
    seconds = asyncio.run(
        _closed_loop(
            base,
            keys["bulk"],
            bulk_body,
            path="/api/v1/jobs/bulk",
            requests=sizes.bulk_requests,
            clients=BULK_CLIENTS,
        )
    )
    result["bulk_http_jobs_per_s"] = round(sizes.bulk_requests * BULK_SIZE / seconds, 1)
    # Counted over the timed requests and the clients' warm-up request each.
    requests = sizes.bulk_requests + BULK_CLIENTS
    context["bulk: web processes' CPU ms per job (incl. warm-up)"] = round(
        (_processes_cpu(web_pid) - cpu_before) * 1000 / (requests * BULK_SIZE), 3
    )
    redis_after = _commandstats(client)
    own = time.process_time() - own_before
    pg_after = _postgres_cpu()
    if pg_before is not None and pg_after is not None:
        # Backends that started during the phase count from 0; one that ended is missed.
        pg = sum(cpu - pg_before.get(pid, 0.0) for pid, cpu in pg_after.items())
        context["bulk: PostgreSQL backends' CPU ms per job (incl. warm-up)"] = round(
            pg * 1000 / (requests * BULK_SIZE), 3
        )
    context["bulk: the bench client's CPU ms per job (incl. warm-up)"] = round(own * 1000 / (requests * BULK_SIZE), 3)
    context["bulk: Redis server's CPU ms per job (incl. warm-up)"] = round(
        (_redis_cpu(client) - redis_cpu_before) * 1000 / (requests * BULK_SIZE), 3
    )
    context["bulk: redis commands per request (incl. warm-up)"] = round(
        _redis_commands_between(redis_before, redis_after) / requests, 1
    )
    context["bulk: FCALLs per request (incl. warm-up)"] = round(
        (redis_after.get("cmdstat_fcall", 0) - redis_before.get("cmdstat_fcall", 0)) / requests, 1
    )


def _noop_phases(
    base: str,
    keys: dict[str, str],
    sizes: Sizes,
    client: redis.Redis,
    counts: str,
    env: dict[str, str],
    log_dir: Path,
    result: dict[str, Any],
    context: dict[str, Any],
) -> None:
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from fairqueue.jobs.stats import stats_read

    _reset(client)
    workers = stack.Workers(
        count=sizes.workers, slots=sizes.slots_per_worker, env=env, log_dir=log_dir, name="bench-throughput-"
    )
    with workers:
        time.sleep(1.5)  # every worker's first heartbeat and tick landed
        seconds = _noop_celery(client, sizes.noop_jobs)
        result["noop_jobs_per_s_celery"] = round(sizes.noop_jobs / seconds, 1)
        redis_before = _commandstats(client)
        sql_before = querycount.total(counts)
        seconds = _noop_fairqueue(base, keys["noop"], sizes.noop_jobs, timeout=600)
        redis_cmds = _redis_commands_between(redis_before, _commandstats(client))
        sql = querycount.total(counts) - sql_before
        time.sleep(1.5)  # the workers' counters reach Redis with their next heartbeat
        counters = stats_read()
    result["noop_jobs_per_s_fairqueue"] = round(sizes.noop_jobs / seconds, 1)
    result["redis_cmds_per_job"] = round(redis_cmds / sizes.noop_jobs, 2)
    result["db_queries_per_job"] = round(sql / sizes.noop_jobs, 2)
    for kind in ("claims", "outcomes"):
        batches = counters.get(f"groupcommit:{kind}:batches", 0.0)
        rows = counters.get(f"groupcommit:{kind}:rows", 0.0)
        context[f"group commit: {kind} batched (of {sizes.noop_jobs}), batches, failed"] = (
            f"{rows:.0f}, {batches:.0f}, {counters.get(f'groupcommit:{kind}:failed', 0.0):.0f}"
        )


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--child":
        raise SystemExit("usage: python -m fairqueue.bench.throughput --child SPEC.json OUT.json (bench throughput)")
    child_main(sys.argv[2], sys.argv[3])
