"""`manage.py bench fleet`: what the fleet's periodic duties, the dashboard snapshot, a
/metrics scrape and an admit cost at (workers, tenants, waiting jobs).

Per case, on the configured database and Redis (both emptied first): S shards, T tenants,
each with one job running (a long lease, so nothing expires during the run) and its share
of the waiting jobs parked behind it (max concurrency 1: they stay parked, so the backlog
is steady); W simulated-but-real workers, each a registration kept alive by real
heartbeats (fairqueue.jobs.fleet.worker_heartbeat) and a ticker thread that does what a
worker's does (fairqueue.jobs.worker._ticker): try the duty lease every tick, run
`scheduler_tick` when it holds it. Measured over the run: wall time per duty tick, Redis
commands per second spent on duties (INFO commandstats, less the heartbeats' own commands,
which the bench counts), database statements per second spent by the ticks (an execute
wrapper on the ticking thread's connection); then the median dashboard snapshot build, a
/metrics scrape (the collector without its cache, rendered as Prometheus text) and the
median engine admit of a fresh job (its mean too, as `admit_us_mean`); last, the size of
the dashboard's websocket frames as one page gets them (dashboard.frames, compact JSON as
sent): the first picture, every cell's history full (`frame_first_bytes`), then the
largest and the median of the frames of FRAME_TICKS ticks a second apart
(`frame_update_bytes_max`, `_median`), each from a tick's build (`picture_build(record=True)`,
as the ticker makes it).

INFO commandstats counts the whole Redis server: give the bench a server no one else uses
while it runs (another database of the same server counts too).

With --database-url the run happens in a child process on that PostgreSQL database
(created afresh and migrated).
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection
from django.utils import timezone
from prometheus_client import CollectorRegistry

from dashboard.frames import PageView, frame_encode
from dashboard.metrics import FairQueueCollector, metrics_render
from dashboard.picture import picture_build
from dashboard.snapshot import HISTORY_LEN, snapshot_build
from dashboard.ticker import TICK_SECONDS as DASHBOARD_TICK_SECONDS
from fairqueue.bench import stack
from fairqueue.engine import AdmitRequest
from fairqueue.jobs import cells, live
from fairqueue.jobs.admission import SHARD_KEY, shard_tag, tenant_key
from fairqueue.jobs.duties import limits_pushed_forget, scheduler_tick
from fairqueue.jobs.fleet import worker_heartbeat
from fairqueue.jobs.leadership import DutyLease
from fairqueue.jobs.models import KEY_SEPARATOR, Job, JobStatus
from fairqueue.jobs.runtime import engine, redis_client
from tenants.models import LatencyClass, Shard, Tenant
from tenants.policy import policy_invalidate
from tenants.sync import policy_sync_all

CASES = {
    "full": [(1, 100, 1_000), (50, 100, 1_000), (50, 10_000, 100_000)],
    "quick": [(1, 10, 40), (5, 10, 40), (5, 60, 300)],
}
SHARDS = {"full": 20, "quick": 4}
RUN_SECONDS = {"full": 12.0, "quick": 3.0}
TICK_SECONDS = 0.5
HEARTBEAT_SECONDS = 2.0
HEARTBEAT_COMMANDS = 7  # zrangebyscore + the pipeline's six (fairqueue.jobs.fleet.worker_heartbeat)
SLOTS_PER_WORKER = 4
SHARD_CAPACITY = 1000
ADMIT_SAMPLES = {"full": 300, "quick": 30}
FRAME_TICKS = {"full": 5, "quick": 2}
REPEATS = 5
WARM_TICKS = 2
MIN_TICKS = 4
MAX_WAIT_SECONDS = 120.0
RUNNING_LEASE_SECONDS = 3600.0


def _redis_commands() -> int:
    return sum(int(v["calls"]) for v in redis_client().info("commandstats").values())


def _reset() -> None:
    redis_client().flushdb()
    with connection.cursor() as cursor:
        for model in (Job, Tenant, Shard):
            cursor.execute(f"DELETE FROM {model._meta.db_table}")
    policy_invalidate()
    live.live_invalidate()
    limits_pushed_forget()


def fleet_seed(tenants: int, waiting: int, shards: int, log: Callable[[str], None], *, busy: int | None = None) -> None:
    """T tenants `t<i>` on S shards `bench<i>`, written in bulk; the first `busy` of them (all
    by default) with one running job each and the waiting jobs spread over them, parked
    behind it. The dashboard's browser test at ten thousand tenants seeds with it too."""
    busy = tenants if busy is None else busy
    default_class = LatencyClass.objects.filter(name="default").first()
    rows = Shard.objects.bulk_create([Shard(name=f"bench{i}", capacity=SHARD_CAPACITY) for i in range(shards)])
    Tenant.objects.bulk_create(
        [
            Tenant(
                slug=f"t{i}",
                name=f"t{i}",
                shard=rows[i % shards],
                floor=1,
                max_concurrency=1,
                default_latency_class=default_class,
            )
            for i in range(tenants)
        ],
        batch_size=2000,
    )
    policy_sync_all()
    policy_invalidate()
    for shard in rows:
        engine().init_tag(tag=shard_tag(shard.name))
    cells.cells_rebuild()
    objs = list(Tenant.objects.select_related("shard").order_by("id"))[:busy]
    now = timezone.now()
    running = [
        Job(
            id=uuid.uuid4(),
            tenant=t,
            task="demo.noop",
            latency_class="default",
            status=JobStatus.RUNNING,
            started_at=now,
            admitted_at=now,
            engine_tag=shard_tag(t.shard.name),
            engine_keys="",
            worker="bench-w0",
        )
        for t in objs
    ]
    Job.objects.bulk_create(running, batch_size=5000)
    engine().admit_many(
        [
            AdmitRequest(
                tag=shard_tag(t.shard.name),
                job_id=j.engine_id,
                keys={tenant_key(t.slug): 1, SHARD_KEY: SHARD_CAPACITY},
                lease_seconds=RUNNING_LEASE_SECONDS,
            )
            for t, j in zip(objs, running, strict=True)
        ]
    )
    log(f"  seeded {tenants} tenants on {shards} shards, one running job each for {busy} of them")
    # The waiting jobs: rows as the admission leaves them (parked behind the running job,
    # the tenant's limit being 1), the engine's admits, the cells; written in bulk, since
    # the submit path is not what this bench measures.
    chunk = 5000
    for start in range(0, waiting, chunk):
        jobs = [
            Job(
                id=uuid.uuid4(),
                tenant=objs[i % busy],
                task="demo.noop",
                latency_class="default",
                status=JobStatus.PARKED,
                engine_tag=shard_tag(objs[i % busy].shard.name),
                engine_keys=KEY_SEPARATOR.join([tenant_key(objs[i % busy].slug), SHARD_KEY]),
            )
            for i in range(start, min(waiting, start + chunk))
        ]
        Job.objects.bulk_create(jobs)
        outcomes = engine().admit_many(
            [
                AdmitRequest(
                    tag=job.engine_tag,
                    job_id=job.engine_id,
                    keys={tenant_key(job.tenant.slug): 1, SHARD_KEY: SHARD_CAPACITY},
                    lease_seconds=RUNNING_LEASE_SECONDS,
                )
                for job in jobs
            ]
        )
        if any(o.admitted for o in outcomes):
            raise RuntimeError("a waiting job was admitted: the seed's running jobs should hold every tenant's slot")
        cells.jobs_place(jobs, parked=True)
    parked = Job.objects.filter(status=JobStatus.PARKED).count()
    log(f"  {waiting} waiting jobs submitted, {parked} parked")
    # The planner's statistics, as autovacuum gathers them within a minute of a bulk load.
    # Measured a few seconds after the load without them, PostgreSQL took the job table
    # for a near-empty one and chose, for the reconcile's cursor query, a bitmap scan and a
    # sort of every row after the cursor: a tick cost of a freshly loaded table, not of a
    # running system.
    with connection.cursor() as cursor:
        for model in (Shard, Tenant, Job):
            cursor.execute(f"ANALYZE {model._meta.db_table}")


class _Fleet:
    """W registrations with real heartbeats and W ticker threads contending for the lease."""

    def __init__(self, workers: int) -> None:
        self.names = [f"bench-w{i}" for i in range(workers)]
        self.stop = threading.Event()
        self.heartbeats = 0
        self.tick_walls: list[float] = []
        self.tick_queries = 0
        self._lock = threading.Lock()

    def _heartbeat(self) -> None:
        while not self.stop.is_set():
            for name in self.names:
                worker_heartbeat(hostname=name, slots=SLOTS_PER_WORKER, running=0, running_batch=0)
                with self._lock:
                    self.heartbeats += 1
            self.stop.wait(HEARTBEAT_SECONDS)

    def _count(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        with self._lock:
            self.tick_queries += 1
        return execute(sql, params, many, context)

    def _ticker(self, name: str) -> None:
        lease = DutyLease(name)
        try:
            with connection.execute_wrapper(self._count):
                while not self.stop.is_set():
                    self.stop.wait(TICK_SECONDS * random.uniform(0.5, 1.5))
                    if self.stop.is_set() or not lease.hold():
                        continue
                    started = time.perf_counter()
                    scheduler_tick()
                    with self._lock:
                        self.tick_walls.append(time.perf_counter() - started)
        finally:
            lease.release()
            connection.close()

    def _wait_ticks(self, count: int, deadline: float) -> None:
        while len(self.tick_walls) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    def run(self, seconds: float) -> dict[str, float]:
        for name in self.names:  # registered before the clock starts
            worker_heartbeat(hostname=name, slots=SLOTS_PER_WORKER, running=0, running_batch=0)
        threads = [threading.Thread(target=self._heartbeat, daemon=True)]
        threads += [threading.Thread(target=self._ticker, args=(n,), daemon=True) for n in self.names]
        for t in threads:
            t.start()
        # Every ticker has started and the leader's first ticks (cold caches: every ring
        # read, every limit sent) are behind us.
        self._wait_ticks(WARM_TICKS, time.monotonic() + MAX_WAIT_SECONDS)
        commands_before, heartbeats_before = _redis_commands(), self.heartbeats
        with self._lock:
            self.tick_walls.clear()
            self.tick_queries = 0
        started = time.monotonic()
        time.sleep(seconds)
        self._wait_ticks(MIN_TICKS, started + MAX_WAIT_SECONDS)  # a slow tick: a few all the same
        elapsed = time.monotonic() - started
        commands = _redis_commands() - commands_before - 1  # the INFO that read the count
        with self._lock:
            walls, queries, beats = list(self.tick_walls), self.tick_queries, self.heartbeats - heartbeats_before
        self.stop.set()
        for t in threads:
            t.join(timeout=30)
        duty_commands = max(0, commands - beats * HEARTBEAT_COMMANDS)
        return {
            "duty_wall_s_per_tick": round(statistics.mean(walls), 4) if walls else 0.0,
            "duty_redis_cmds_per_s": round(duty_commands / elapsed, 1),
            "duty_db_queries_per_s": round(queries / elapsed, 1),
            "ticks": len(walls),
        }


def _median_ms(action: Callable[[], object]) -> float:
    samples = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(samples), 2)


def _scrape() -> bytes:
    registry = CollectorRegistry()
    registry.register(FairQueueCollector(cache_seconds=0))
    return metrics_render(registry)


def _frame_bytes(ticks: int) -> dict[str, int]:
    """One page's first frame, with every cell's history full (as two minutes of ticks
    leave it), and the frames of the next `ticks` ticks, in bytes."""
    for _ in range(HISTORY_LEN - 1):
        snapshot_build(record=True)
    page = PageView()
    first = len(frame_encode(page.first(picture_build(record=True))).encode())
    updates: list[int] = []
    while len(updates) < ticks:
        time.sleep(DASHBOARD_TICK_SECONDS)
        frame = page.next(picture_build(record=True))
        if frame is not None:
            updates.append(len(frame_encode(frame).encode()))
    return {
        "frame_first_bytes": first,
        "frame_update_bytes_max": max(updates),
        "frame_update_bytes_median": round(statistics.median(updates)),
    }


def _admit_us(samples: int) -> tuple[float, float]:
    """Median and mean of an engine admit of a fresh job on a tenant with room (released
    right after). The median is the figure compared across cases: the bench process also
    holds the case's snapshot and tick state, and a garbage collection of that heap landing
    in the loop moves the mean by what the admit itself costs (a web process admitting
    jobs holds none of it); the garbage of the steps before is collected first."""
    tag = shard_tag("bench0")
    took = []
    gc.collect()
    for i in range(samples):
        job_id = f"bench-admit-{i}"
        started = time.perf_counter()
        engine().admit(tag=tag, job_id=job_id, keys={"2:t:bench-probe": 4, SHARD_KEY: SHARD_CAPACITY}, lease_seconds=30)
        took.append(time.perf_counter() - started)
        engine().release(tag=tag, job_id=job_id)
    return round(statistics.median(took) * 1e6, 1), round(statistics.mean(took) * 1e6, 1)


def run(*, quick: bool, log: Callable[[str], None], database_label: str) -> dict[str, Any]:
    size = "quick" if quick else "full"
    results = []
    for workers, tenants, waiting in CASES[size]:
        log(f"case: {workers} workers, {tenants} tenants, {waiting} waiting")
        _reset()
        fleet_seed(tenants, waiting, SHARDS[size], log)
        duty = _Fleet(workers).run(RUN_SECONDS[size])
        snapshot_ms = _median_ms(lambda: snapshot_build(with_history=False))
        scrape_ms = _median_ms(_scrape)
        admit_median, admit_mean = _admit_us(ADMIT_SAMPLES[size])
        frames = _frame_bytes(FRAME_TICKS[size])
        case = {
            "workers": workers,
            "tenants": tenants,
            "waiting": waiting,
            **{k: v for k, v in duty.items() if k != "ticks"},
            "snapshot_ms": snapshot_ms,
            "scrape_ms": scrape_ms,
            "admit_us": admit_median,
            "admit_us_mean": admit_mean,
            **frames,
            "ticks": duty["ticks"],
        }
        log(f"  {case}")
        results.append(case)
    _reset()
    first, last = results[0], results[-1]
    return {
        "database": database_label,
        "cases": results,
        "ratios": {
            "duty_redis_cmds_per_s_w50_over_w1": _ratio(
                results[1]["duty_redis_cmds_per_s"], first["duty_redis_cmds_per_s"]
            ),
            "admit_us_largest_over_smallest": _ratio(last["admit_us"], first["admit_us"]),
        },
        "load_average": os.getloadavg()[0],
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def add_arguments(parser: Any) -> None:
    parser.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
    parser.add_argument("--quick", action="store_true", help="small cases of the same shape (smoke test)")
    parser.add_argument("--database-url", help="a PostgreSQL server URL: run on a fresh database of that name")
    parser.add_argument(
        "--redis-url", default=stack.DEFAULT_REDIS_URL, help="with --database-url: an EMPTY Redis database"
    )
    parser.add_argument("--force", action="store_true", help="empty the Redis database even if it holds data")


def run_command(options: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """With --database-url: a child process on a fresh PostgreSQL database; else here."""
    url = options.get("database_url")
    if not url:
        # The run empties Redis: refuse one that holds data unless told (--force).
        stack.redis_db_prepare(settings.REDIS_URL, force=options["force"])
        return run(quick=options["quick"], log=log, database_label=connection.vendor)
    stack.redis_db_prepare(options["redis_url"], force=options["force"])
    db_url = stack.fresh_postgres(url, url.rstrip("/").rpartition("/")[2] or "fq_fleet_bench")
    env = {**os.environ, "DATABASE_URL": db_url, "REDIS_URL": options["redis_url"]}
    manage = Path(settings.BASE_DIR) / "manage.py"
    subprocess.run([sys.executable, str(manage), "migrate", "-v0"], env=env, check=True)
    out = Path(options.get("json_path") or "fleet-bench.json").resolve()
    args = [sys.executable, str(manage), "bench", "fleet", "--force", "--json", str(out)]
    args += ["--quick"] if options["quick"] else []
    subprocess.run(args, env=env, check=True)
    return dict(json.loads(out.read_text()))
