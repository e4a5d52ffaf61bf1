"""`manage.py chaos`: run real load through the REST API while workers die and Redis loses
everything, then check that nothing was lost, run twice, over-admitted or leaked.

The run owns its whole stack: a fresh SQLite file under var/chaos/, a dedicated Redis
database (refused if it holds data, flushed at start and end), one daphne web server and
several `manage.py worker` processes, all started as subprocesses with the same
DATABASE_URL/REDIS_URL. This process never touches its own Django database: it reads the
run's SQLite file with the sqlite3 module and the run's Redis with a plain client.

Faults injected:
- SIGKILL of a random (preferably busy) worker, replaced at once by a fresh one;
- one "Redis restart" mid-run: FLUSHDB of the run's database. The local Redis keeps
  nothing on disk for it, so an empty database is exactly what a restart leaves (scheduling
  state, policies, broker queues, worker registry: all gone).

With `cluster=True` (`--cluster`) the engine's state lives on a Redis Cluster the run
starts (3 primaries + 3 replicas, fairqueue.bench.cluster) while broker, channel layer and
cache stay on the run's Redis database, and the Redis faults are the cluster's:
- a failover mid-run: the replica of the primary holding the run's shard is cut off from it
  (`replication_cut_ms` before the kill, so the writes the primary acknowledges meanwhile
  are lost for sure, as asynchronous replication can lose them), then the primary is
  SIGKILLed and its replica promoted; the killed node restarts and rejoins as a replica;
- later, that shard's primary loses all its data (FLUSHALL and FUNCTION FLUSH, which its
  replica follows): what a primary restarting empty leaves.
The run watches the shard's engine tag throughout and reports the failover's timeline (kill,
promotion, the tag found foreign, rebuilt), the writes the promoted replica had lost
(counted by the rebuild against the database) and the over-limit events inside and outside
the failover window, where lost admissions can let a slot be given twice.

Checks once the system is quiet (every accepted job terminal, or a timeout):
- accepted == succeeded, lost == 0 (accepted but not terminal, or missing);
- duplicated == 0: no demo ledger row reached more often than the job's runs allow (once,
  plus once per attempt lost with its worker: such a run may have written its side effect
  before the kill, and the re-run meets the ledger's guard; `rerun_after_worker_loss`
  counts those), and every succeeded job wrote one;
- over_limit_events == 0: sweeping the started/finished times the demo task records for the
  final run of each succeeded job, no tenant (hard max), registered sub-tenant or shard ran
  above its limit at any moment. A run killed with its worker leaves no times, so only
  runs that finished count; they are a subset of the hold intervals the engine granted.
  With a cluster, only outside the failover window (from the replication cut until the tag
  is rebuilt and every job admitted before then has finished); inside it they are reported;
- leaked_holds == 0: no holder, waiter or job spec left in any engine tag, and the engine's
  own invariant check is clean.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import redis
from psycopg.rows import dict_row

from fairqueue.bench.cluster import LocalCluster, Node, free_cluster_ports
from fairqueue.bench.outages import DashboardWatch, RestartedServers, restarts_report, staff_session
from fairqueue.bench.stack import (
    ROOT,
    StackError,
    WebServer,
    engine_url_of,
    fresh_database,
    migrate,
    redis_db_prepare,
    stack_env,
    worker_argv,
)
from fairqueue.engine import Engine, TagHealth
from fairqueue.engine.cluster import connect
from fairqueue.engine.keys import LAYOUT

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/6"
CHAOS_DIR = ROOT / "var" / "chaos"
ENGINE_PREFIX = "fq"
SEEN_KEY = "fq:workers:seen"  # fairqueue.jobs.worker.SEEN_KEY
BUSY_KEY = "fq:workers:busy"  # fairqueue.jobs.worker.BUSY_KEY
STATS_KEY = "fq:stats"  # fairqueue.jobs.stats.STATS_KEY
TERMINAL = ("succeeded", "failed", "cancelled")
SHARD = "chaos"
TAG = f"s:{SHARD}"  # fairqueue.jobs.admission.shard_tag(SHARD)
# With the engine on a cluster, a failover (node timeout plus election, about 3.5 s here)
# must fit in a running lease: workers cannot renew while the shard has no primary, and a
# lease that runs out meanwhile is reclaimed and its job run again. The default lease (30 s)
# does; the quick run's 2 s would not.
CLUSTER_LEASE_SECONDS = 10.0
HEALTH_POLL_SECONDS = 0.05
RESTARTS = ("database", "broker", "channels")

Log = Callable[[str], None]


class ChaosError(RuntimeError):
    pass


@dataclass(frozen=True)
class TenantSpec:
    slug: str
    floor: int
    max_concurrency: int | None
    weight: float  # share of the submitted requests
    sub_tenants: dict[str, int] = field(default_factory=dict)  # registered sub-tenant -> its cap
    extra_sub_tenants: tuple[str, ...] = ()  # unregistered: capped by the tenant's default share


TENANTS = (
    TenantSpec("tiny", floor=1, max_concurrency=1, weight=0.15),
    TenantSpec("small", floor=2, max_concurrency=2, weight=0.25),
    TenantSpec(
        "subs",
        floor=2,
        max_concurrency=4,
        weight=0.30,
        sub_tenants={"alpha": 1, "beta": 2},
        extra_sub_tenants=("gamma",),
    ),
    TenantSpec("big", floor=2, max_concurrency=None, weight=0.30),
)
SHARD_CAPACITY = 10


@dataclass
class ChaosConfig:
    quick: bool = False
    redis_url: str = DEFAULT_REDIS_URL
    force: bool = False
    seed: int | None = None
    load_seconds: float = 150.0
    kills: int = 10
    workers: int = 3
    slots: int = 4
    requests_per_second: float = 8.0
    lease_seconds: float = 2.0
    dispatch_lease_seconds: float = 15.0
    quiet_timeout: float = 180.0
    min_seconds: float = 0.05
    max_seconds: float = 0.5
    cluster: bool = False
    cluster_ports: list[int] | None = None  # free ports when not given
    replication_cut_ms: float = 500.0
    # Dependencies restarted under load, each on a server of the run's own: "database" (a
    # private PostgreSQL, stopped `immediate`), "broker" (Redis on a server of its own,
    # restarted empty), "channels" (the channel layer's Redis, restarted empty).
    restarts: tuple[str, ...] = ()
    restart_outage_seconds: float = 8.0

    @classmethod
    def make(cls, *, quick: bool, **overrides: Any) -> ChaosConfig:
        base = cls(quick=True, load_seconds=14.0, kills=2, quiet_timeout=60.0) if quick else cls()
        if overrides.get("cluster"):
            base.lease_seconds = CLUSTER_LEASE_SECONDS
            if quick:
                base.load_seconds = 20.0  # room for a failover and a data loss
        if overrides.get("restarts") and quick:
            base.load_seconds = 12.0 + 8.0 * len(overrides["restarts"])  # room for each outage apart
            base.restart_outage_seconds = 5.0
        unknown = set(overrides.get("restarts") or ()) - set(RESTARTS)
        if unknown:
            raise ChaosError(f"unknown restart {sorted(unknown)}: choose from {', '.join(RESTARTS)}")
        for name, value in overrides.items():
            if value is not None:
                setattr(base, name, value)
        return base

    @property
    def poison_limit(self) -> int:
        # Above the number of kills: even a job under every killed worker is re-delivered.
        return self.kills + 2


# --- processes ----------------------------------------------------------------------------------


class WorkerPool:
    """The run's `manage.py worker` processes; kill one with SIGKILL, start replacements.
    Beside them one quarantine worker (`--quarantine`), never killed: it runs the jobs the
    kills moved to the quarantine lane (fairqueue.jobs.quarantine)."""

    def __init__(self, *, slots: int, env: dict[str, str], log_dir: Path) -> None:
        self.slots = slots
        self.env = env
        self.log_dir = log_dir
        self.client = connect(engine_url_of(env), decode_responses=True)  # the worker registry
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.quarantine: dict[str, subprocess.Popen[bytes]] = {}  # not among the victims
        self._n = 0
        self._lock = threading.Lock()

    def spawn(self, *, quarantine: bool = False) -> str:
        with self._lock:
            self._n += 1
            hostname = f"chaos{'q' if quarantine else ''}{self._n}-{uuid.uuid4().hex[:4]}@localhost"
        log = (self.log_dir / f"{hostname.split('@')[0]}.log").open("wb")
        proc = subprocess.Popen(
            [*worker_argv(hostname=hostname, slots=self.slots), *(["--quarantine"] if quarantine else [])],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        with self._lock:
            (self.quarantine if quarantine else self.procs)[hostname] = proc
        return hostname

    def wait_registered(self, hostnames: Iterable[str], timeout: float = 60.0) -> None:
        names = list(hostnames)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.client.zscore(SEEN_KEY, h) is not None for h in names):
                return
            for h in names:
                if {**self.procs, **self.quarantine}[h].poll() is not None:
                    raise ChaosError(f"worker {h} exited early; see {self.log_dir}")
            time.sleep(0.1)
        raise ChaosError(f"workers did not register within {timeout}s; see {self.log_dir}")

    def alive(self) -> list[str]:
        with self._lock:
            return [h for h, p in self.procs.items() if p.poll() is None]

    def kill_one(self, rng: random.Random) -> tuple[str, int] | None:
        """SIGKILL a live worker, preferring one that is running jobs; (hostname, busy slots)."""
        alive = self.alive()
        if not alive:
            return None
        try:
            busy = {h: int(v) for h, v in self.client.hgetall(BUSY_KEY).items()}
        except redis.RedisError:
            busy = {}
        busiest = [h for h in alive if busy.get(h, 0) > 0]
        victim = rng.choice(busiest or alive)
        proc = self.procs[victim]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        return victim, busy.get(victim, 0)

    def stop_all(self) -> None:
        with self._lock:
            procs = [*self.procs.values(), *self.quarantine.values()]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL cannot be ignored
                proc.wait(10)


def manage(args: list[str], *, env: dict[str, str], timeout: float = 120.0) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode:
        raise ChaosError(f"manage.py {args[0]} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


_SETUP_CODE = """
import json
from django.db import transaction
from tenants.models import Shard, SubTenant, Tenant
specs = json.loads({specs!r})
keys = {{}}
with transaction.atomic():
    shard, _ = Shard.objects.get_or_create(name={shard!r}, defaults={{"capacity": {capacity}}})
    for s in specs:
        t = Tenant(slug=s["slug"], name=s["slug"], shard=shard, floor=s["floor"],
                   max_concurrency=s["max_concurrency"], dedicated=0)
        keys[s["slug"]] = t.rotate_api_key()
        t.full_clean()
        t.save()
        for ext, cap in s["sub_tenants"].items():
            SubTenant.objects.create(tenant=t, external_id=ext, max_concurrency=cap)
print(json.dumps(keys))
"""


def tenants_create(env: dict[str, str]) -> dict[str, str]:
    """Create the run's shard, tenants and sub-tenants in a child process; their raw API keys."""
    specs = json.dumps([asdict(t) for t in TENANTS])
    out = manage(["shell", "-c", _SETUP_CODE.format(specs=specs, shard=SHARD, capacity=SHARD_CAPACITY)], env=env)
    return json.loads(out.strip().splitlines()[-1])


# --- load ------------------------------------------------------------------------------------------


class Load:
    """Submits demo.sleep jobs through the REST API at a steady pace: singles and bulk."""

    def __init__(self, *, base_url: str, keys: dict[str, str], config: ChaosConfig, rng: random.Random) -> None:
        self.base_url = base_url
        self.keys = keys
        self.config = config
        self.rng = rng
        self.accepted: dict[str, str] = {}  # job id (hex) -> tenant slug
        self.idempotency: dict[tuple[str, str], str] = {}  # (tenant, key) -> job id
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def _post(self, slug: str, path: str, body: Any) -> tuple[int, Any]:
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.keys[slug]}"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()[:300]

    def _job(self, spec: TenantSpec) -> dict[str, Any]:
        job: dict[str, Any] = {
            "task": "demo.sleep",
            "args": {"seconds": round(self.rng.uniform(self.config.min_seconds, self.config.max_seconds), 3)},
        }
        subs = [*spec.sub_tenants, *spec.extra_sub_tenants]
        if subs and self.rng.random() < 0.8:
            job["sub_tenant"] = self.rng.choice(subs)
        return job

    def _record(self, slug: str, status: int, data: Any, sent: list[dict[str, Any]]) -> None:
        with self._lock:
            self.counts[f"http_{status}"] += 1
            if status not in (200, 202):
                self.errors.append(f"{slug}: HTTP {status}: {data!r}"[:300])
                return
            items = data if isinstance(data, list) else [data]
            for job, item in zip(sent, items, strict=True):
                job_id = uuid.UUID(item["id"]).hex
                self.accepted[job_id] = slug
                key = job.get("idempotency_key")
                if key is not None:
                    known = self.idempotency.setdefault((slug, key), job_id)
                    if known != job_id:
                        self.counts["idempotency_mismatch"] += 1

    def submit_once(self) -> None:
        spec = self.rng.choices(TENANTS, weights=[t.weight for t in TENANTS])[0]
        try:
            if self.rng.random() < 0.3:
                jobs = [self._job(spec) for _ in range(self.rng.randint(2, 6))]
                status, data = self._post(spec.slug, "/api/v1/jobs/bulk", {"jobs": jobs})
                self._record(spec.slug, status, data, jobs)
                return
            job = self._job(spec)
            with self._lock:
                repeats = [k for (slug, k) in self.idempotency if slug == spec.slug]
            if repeats and self.rng.random() < 0.1:
                job["idempotency_key"] = self.rng.choice(repeats)  # a client retry: same job, nothing new
                self.counts["retries"] += 1
            elif self.rng.random() < 0.3:
                job["idempotency_key"] = uuid.uuid4().hex
            status, data = self._post(spec.slug, "/api/v1/jobs", job)
            self._record(spec.slug, status, data, [job])
        except (OSError, ValueError, KeyError) as exc:
            with self._lock:
                self.counts["transport_errors"] += 1
                self.errors.append(f"{spec.slug}: {type(exc).__name__}: {exc}"[:300])

    def run(self, seconds: float, threads: int = 3) -> None:
        interval = threads / self.config.requests_per_second
        end = time.monotonic() + seconds

        def loop() -> None:
            next_at = time.monotonic() + self.rng.uniform(0, interval)
            while not self._stop.is_set() and time.monotonic() < end:
                self._stop.wait(max(0.0, next_at - time.monotonic()))
                self.submit_once()
                next_at += interval

        pool = [threading.Thread(target=loop, name=f"chaos-load-{i}", daemon=True) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()

    def stop(self) -> None:
        self._stop.set()


# --- checks ----------------------------------------------------------------------------------------


class RunDatabase:
    """The run's database, read with its own driver (this process has no Django database):
    the SQLite file, or the private PostgreSQL server of a run that restarts it. Rows come
    back as dicts with ids as hex strings and JSON as text, whichever the database."""

    def __init__(self, *, sqlite_path: Path | None = None, postgres_url: str | None = None) -> None:
        self.sqlite_path = sqlite_path
        self.postgres_url = postgres_url

    def rows(self, sql: str) -> list[dict[str, Any]]:
        if self.postgres_url:
            with psycopg.connect(self.postgres_url, row_factory=dict_row, connect_timeout=10) as pg:
                return [{k: _plain(v) for k, v in row.items()} for row in pg.execute(sql)]  # type: ignore[arg-type]
        conn = sqlite3.connect(f"file:{self.sqlite_path}?mode=ro", uri=True, timeout=30)
        conn.row_factory = sqlite3.Row
        try:
            return [dict(row) for row in conn.execute(sql)]
        finally:
            conn.close()


def _plain(value: Any) -> Any:
    """A PostgreSQL value as SQLite's rows have it: a UUID as 32 hex digits, JSON as text."""
    if isinstance(value, uuid.UUID):
        return value.hex
    if isinstance(value, dict | list):
        return json.dumps(value)
    return value


def job_statuses(db: RunDatabase) -> dict[str, str]:
    return {row["id"]: row["status"] for row in db.rows("SELECT id, status FROM jobs_job")}


def wait_quiet(db: RunDatabase, accepted: Iterable[str], *, timeout: float, log: Log) -> tuple[bool, float]:
    """Until every accepted job is terminal (True) or the timeout (False); and the time it took."""
    ids = set(accepted)
    started = time.monotonic()
    last_report = started
    while True:
        statuses = job_statuses(db)
        pending = [i for i in ids if statuses.get(i) not in TERMINAL]
        if not pending:
            return True, time.monotonic() - started
        now = time.monotonic()
        if now - started > timeout:
            return False, now - started
        if now - last_report > 5:
            log(f"  waiting for quiet: {len(pending)} job(s) not terminal yet")
            last_report = now
        time.sleep(0.25)


def _parse_ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def over_limit(intervals: list[tuple[float, float]], limit: int) -> tuple[int, int]:
    """(moments the concurrency rose above `limit`, peak concurrency) over these intervals.

    A run that finishes at the instant another starts does not overlap it."""
    moments, peak = over_limit_moments(intervals, limit)
    return len(moments), peak


def over_limit_moments(intervals: list[tuple[float, float]], limit: int) -> tuple[list[float], int]:
    """(when the concurrency rose above `limit`, peak concurrency) over these intervals."""
    events = sorted([(s, 1) for s, _ in intervals] + [(f, -1) for _, f in intervals])
    level = peak = 0
    moments = []
    for at, delta in events:
        level += delta
        if delta > 0 and level == limit + 1:
            moments.append(at)
        peak = max(peak, level)
    return moments, peak


def concurrency_report(db: RunDatabase) -> dict[str, Any]:
    """Per tenant (hard max), registered sub-tenant and shard: peak concurrency and over-limit moments."""
    tenants = {
        r["id"]: r
        for r in db.rows(
            "SELECT t.id, t.slug, t.max_concurrency, t.dedicated, s.name AS shard, s.capacity "
            "FROM tenants_tenant t JOIN tenants_shard s ON s.id = t.shard_id"
        )
    }
    subs = {
        (r["tenant_id"], r["external_id"]): r["max_concurrency"]
        for r in db.rows("SELECT tenant_id, external_id, max_concurrency FROM tenants_subtenant")
    }
    rows = db.rows("SELECT tenant_id, sub_tenant, result FROM jobs_job WHERE status = 'succeeded'")
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    limits: dict[tuple[str, str], int | None] = {}
    missing_times = 0
    for row in rows:
        tenant = tenants[row["tenant_id"]]
        try:
            result = json.loads(row["result"])
            interval = (_parse_ts(result["started"]), _parse_ts(result["finished"]))
        except (TypeError, ValueError, KeyError):
            missing_times += 1
            continue
        scopes = [("tenant", tenant["slug"]), ("shard", tenant["shard"])]
        limits[("tenant", tenant["slug"])] = (
            None if tenant["max_concurrency"] is None else tenant["max_concurrency"] + tenant["dedicated"]
        )
        limits[("shard", tenant["shard"])] = tenant["capacity"]
        cap = subs.get((row["tenant_id"], row["sub_tenant"]))
        if cap is not None:
            scope = ("sub_tenant", f"{tenant['slug']}/{row['sub_tenant']}")
            scopes.append(scope)
            limits[scope] = cap
        for scope in scopes:
            groups.setdefault(scope, []).append(interval)
    scopes_out: dict[str, Any] = {}
    moments_at: list[float] = []
    for scope, intervals in sorted(groups.items()):
        limit = limits[scope]
        moments, peak = over_limit_moments(intervals, limit if limit is not None else 10**9)
        moments_at += moments
        scopes_out[f"{scope[0]}:{scope[1]}"] = {"limit": limit, "peak": peak, "over_limit_events": len(moments)}
    return {
        "over_limit_events": len(moments_at),
        "over_limit_at": sorted(moments_at),
        "scopes": scopes_out,
        "succeeded_without_times": missing_times,
    }


def ledger_report(db: RunDatabase, succeeded: set[str]) -> dict[str, Any]:
    """The demo ledger against the runs the jobs were allowed.

    A job runs at least once: a worker killed after the task wrote its side effect and
    before the outcome was recorded leaves the job to run again, and that run reaches the
    ledger again, where the idempotency guard (a unique row) keeps the side effect single
    and counts the attempt. So each attempt lost with its worker may add one count to a
    job's ledger row (`rerun_after_worker_loss`); a count past 1 + the job's worker losses
    is a run the system should not have made (`duplicated`)."""
    writes = {r["job_id"]: r["writes"] for r in db.rows("SELECT job_id, writes FROM jobs_ledgerentry")}
    losses = {
        r["id"]: r["worker_losses"] for r in db.rows("SELECT id, worker_losses FROM jobs_job WHERE worker_losses > 0")
    }
    duplicated = sorted(j for j, w in writes.items() if w > 1 + losses.get(j, 0))
    rerun = sorted(j for j, w in writes.items() if 1 < w <= 1 + losses.get(j, 0))
    missing = sorted(succeeded - set(writes))
    return {"duplicated": duplicated, "rerun_after_worker_loss": rerun, "missing": missing}


def _holders(state: dict[str, str]) -> int:
    """Holders across all keys of a tag: the `state` fields that are key names (limits are
    `\0key` fields, meta fields `\1…`, job specs `\2job`, limits records `\3job`, fair-order
    flow records `\4…` and `\5…`)."""
    return sum(int(v) for k, v in state.items() if k[:1] not in ("\0", "\1", "\2", "\3", "\4", "\5"))


def engine_leftovers(engine_url: str) -> dict[str, Any]:
    """Everything the engine still holds, per tag, plus its own invariant check (a SCAN,
    which a cluster client runs on every primary)."""
    client = connect(engine_url, decode_responses=True)
    eng = Engine(client, prefix=ENGINE_PREFIX)
    out: dict[str, Any] = {}
    # Every tag that has any engine key: a tag without job specs may still hold counts or
    # waiters (a corrupt state), so look at every kind of key.
    tags = set()
    for name in ("state", "waits", "leases"):
        suffix = f"}}:v{LAYOUT}:{name}"
        for key in client.scan_iter(match=f"{ENGINE_PREFIX}:{{*{suffix}", count=1000):
            tags.add(key[len(ENGINE_PREFIX) + 2 : -len(suffix)])
    for tag in sorted(tags):
        base = f"{ENGINE_PREFIX}:{{{tag}}}:v{LAYOUT}"
        state = {str(k): str(v) for k, v in client.hgetall(f"{base}:state").items()}  # already str
        job_ids = sorted(f[1:] for f in state if f.startswith("\2"))
        out[tag] = {
            "job_specs": len(job_ids),
            "holds": _holders(state),
            "waiters": client.zcard(f"{base}:waits"),
            "leases": client.zcard(f"{base}:leases"),
            "problems": eng.check_invariants(tag=tag),
            "job_ids": job_ids[:20],
        }
    return out


def leaked_count(leftovers: dict[str, Any]) -> int:
    return sum(t["job_specs"] + t["holds"] + t["waiters"] + len(t["problems"]) for t in leftovers.values())


def wait_engine_drained(engine_url: str, *, timeout: float) -> tuple[dict[str, Any], float]:
    """Releases land just after the job row turns terminal, and a killed run's hold goes with
    its lease: give the engine up to `timeout` to settle, then report what is left."""
    started = time.monotonic()
    while True:
        leftovers = engine_leftovers(engine_url)
        if not leaked_count(leftovers) or time.monotonic() - started > timeout:
            return leftovers, time.monotonic() - started
        time.sleep(0.25)


# --- cluster faults ------------------------------------------------------------------------------------


class TagWatch:
    """Polls the health of the run's engine tag from this process and keeps its changes
    (`TagHealth` values, or "unreachable"), with wall-clock times."""

    def __init__(self, engine_url: str) -> None:
        self.engine = Engine(connect(engine_url, decode_responses=True), prefix=ENGINE_PREFIX)
        self.changes: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-tag-watch", daemon=True)

    def start(self) -> TagWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                state = str(self.engine.tags_health([TAG]).get(TAG, "unreachable"))
            except redis.RedisError:
                state = "unreachable"
            if not self.changes or self.changes[-1][1] != state:
                self.changes.append((time.time(), state))
            self._stop.wait(HEALTH_POLL_SECONDS)

    def first(self, state: str, *, after: float) -> float | None:
        return next((at for at, s in self.changes if at >= after and s == state), None)


def failover(cluster: LocalCluster, *, cut_ms: float) -> dict[str, Any]:
    """Lose the primary of the run's shard: cut its replica off `cut_ms` before a SIGKILL
    (the writes acknowledged meanwhile are lost), wait for the replica's promotion, then
    start the killed node again (it rejoins as a replica)."""
    primary = cluster.primary_of("{" + TAG + "}")
    replica = cluster.replicas_of(primary)[0]
    cut_at = time.time()
    if cut_ms > 0:
        # The replica authenticates on reconnecting and the primary has no password: it
        # stays cut off until the primary is gone.
        cluster.client(replica.port).config_set("masterauth", "chaos-replication-cut")
        cluster.client(primary.port).client_kill_filter(_type="replica")
        time.sleep(cut_ms / 1000)
    killed_at = time.time()
    cluster.kill(primary.port)
    promoted, waited = cluster.wait_failover(primary)
    cluster.client(promoted.port).config_set("masterauth", "")
    cluster.restart(primary.port)
    return {
        "cut_at": cut_at,
        "killed_at": killed_at,
        "promoted_at": killed_at + waited,
        "promotion_s": round(waited, 2),
        "killed_port": primary.port,
        "promoted_port": promoted.port,
    }


def primary_data_loss(cluster: LocalCluster) -> dict[str, Any]:
    """The primary of the run's shard loses everything (a restart without persistence,
    which its replica then copies): FLUSHALL and FUNCTION FLUSH."""
    primary: Node = cluster.primary_of("{" + TAG + "}")
    client = cluster.client(primary.port)
    size = int(client.dbsize())
    client.flushall()
    client.function_flush()
    return {"at": time.time(), "port": primary.port, "keys_lost": size}


def failover_report(
    watch: TagWatch, faults: dict[str, Any], concurrency: dict[str, Any], stats: dict[str, str], config: ChaosConfig
) -> dict[str, Any]:
    """The failover's timeline and costs, and the over-limit events inside and outside its window."""
    out: dict[str, Any] = {
        "writes_lost": {
            kind: int(float(stats.get(f"writes_lost:{kind}", 0))) for kind in ("admissions", "parks", "releases")
        },
        "foreign_rebuilds": int(float(stats.get("foreign_rebuilds", 0))),
        "tag_changes": [(round(at, 3), state) for at, state in watch.changes],
    }
    fo = faults.get("failover")
    window: tuple[float, float] | None = None
    if fo:
        rebuilt = watch.first(str(TagHealth.READY), after=fo["promoted_at"])
        out["failover"] = {
            "replication_cut_ms": config.replication_cut_ms,
            "promotion_s": fo["promotion_s"],  # SIGKILL -> the replica serves the slots
            "foreign_seen_s": _since(watch.first(str(TagHealth.FOREIGN), after=fo["killed_at"]), fo["killed_at"]),
            "trusted_again_s": _since(rebuilt, fo["killed_at"]),  # SIGKILL -> the tag rebuilt and ready
            "rebuilt_after_promotion_s": _since(rebuilt, fo["promoted_at"]),
        }
        # Lost admissions can let a slot be given twice from the cut until the rebuild, and
        # jobs started then run for up to max_seconds after it.
        end = (rebuilt or time.time()) + config.max_seconds + 1.0
        window = (fo["cut_at"], end)
    loss = faults.get("data_loss")
    if loss:
        out["data_loss"] = {
            "keys_lost": loss["keys_lost"],
            "rebuilt_s": _since(watch.first(str(TagHealth.READY), after=loss["at"]), loss["at"]),
        }
    inside = [at for at in concurrency["over_limit_at"] if window and window[0] <= at <= window[1]]
    out["over_limit_events_in_failover_window"] = len(inside)
    out["over_limit_events_elsewhere"] = concurrency["over_limit_events"] - len(inside)
    if window:
        out["failover_window_s"] = round(window[1] - window[0], 2)
    return out


def _since(at: float | None, start: float) -> float | None:
    return None if at is None else round(at - start, 3)


# --- the run ------------------------------------------------------------------------------------------


def run(config: ChaosConfig, *, log: Log = print) -> dict[str, Any]:
    seed = config.seed if config.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    t0 = time.monotonic()
    redis_db_prepare(config.redis_url, force=config.force)
    run_dir = CHAOS_DIR / (("quick" if config.quick else "full") + ("-cluster" if config.cluster else ""))
    db_path = run_dir / "chaos.sqlite3"
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("*.log"):
        old.unlink()
    servers = RestartedServers(config.restarts, run_dir=run_dir, log_dir=log_dir).start()
    db = RunDatabase(postgres_url=servers.database_url) if servers.database_url else RunDatabase(sqlite_path=db_path)
    env = stack_env(
        redis_url=config.redis_url,
        db_path=db_path,
        database_url=servers.database_url,
        **servers.role_urls,
        FAIRQUEUE_LEASE_SECONDS=str(config.lease_seconds),
        FAIRQUEUE_DISPATCH_LEASE_SECONDS=str(config.dispatch_lease_seconds),
        FAIRQUEUE_POISON_PILL_LIMIT=str(config.poison_limit),
        FAIRQUEUE_PAYLOAD_DIR=str(run_dir / "payloads"),
        FAIRQUEUE_LOG_LEVEL="WARNING",
    )
    redis_faults = "a failover and a primary's data loss on the engine's cluster" if config.cluster else "1 Redis flush"
    log(
        f"chaos ({'quick' if config.quick else 'full'}, seed {seed}): {config.workers} workers x {config.slots} slots, "
        f"{config.load_seconds:.0f}s of load, {config.kills} SIGKILLs, {redis_faults}; lease "
        f"{config.lease_seconds}s, poison-pill limit {config.poison_limit}"
    )
    web: WebServer | None = None
    workers: WorkerPool | None = None
    load: Load | None = None
    cluster: LocalCluster | None = None
    watch: TagWatch | None = None
    kills: list[dict[str, Any]] = []
    flushes: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    dashboard: DashboardWatch | None = None
    faults: dict[str, Any] = {}
    try:
        if config.cluster:
            cluster = LocalCluster(config.cluster_ports or free_cluster_ports(), log_dir=log_dir).start()
            env["FAIRQUEUE_ENGINE_URL"] = cluster.url  # broker, channels and cache stay on the run's Redis
        engine_url = engine_url_of(env)
        log(
            f"  stack: {servers.database_url or db_path} + {config.redis_url}, engine on {engine_url}"
            f"{servers.describe()}; logs in {log_dir}"
        )
        if servers.database_url:
            migrate(env)
        else:
            fresh_database(db_path, env)
        keys = tenants_create(env)
        web = WebServer(env=env, log_dir=log_dir)
        workers = WorkerPool(slots=config.slots, env=env, log_dir=log_dir)
        first = [workers.spawn() for _ in range(config.workers)] + [workers.spawn(quarantine=True)]
        web.start(timeout=60)
        workers.wait_registered(first)
        log(f"  stack up in {time.monotonic() - t0:.1f}s: daphne on {web.base_url}, workers {', '.join(first)}")
        if "channels" in config.restarts:
            dashboard = DashboardWatch(web.base_url, staff_session(env)).start()

        load = Load(base_url=web.base_url, keys=keys, config=config, rng=random.Random(rng.random()))
        load_started = time.monotonic()
        load_thread = threading.Thread(target=load.run, args=(config.load_seconds,), name="chaos-load", daemon=True)
        load_thread.start()

        # The fault plan, in seconds after the load started.
        span = config.load_seconds
        if config.quick:
            kill_at = sorted([span * rng.uniform(0.15, 0.35), span * rng.uniform(0.6, 0.8)][: config.kills])
        else:
            kill_at = sorted(rng.uniform(0.05 * span, 0.9 * span) for _ in range(config.kills))
        flush_at = span * (rng.uniform(0.45, 0.55))
        if cluster is not None:
            watch = TagWatch(engine_url).start()
            redis_plan = [(span * rng.uniform(0.3, 0.4), "failover"), (span * rng.uniform(0.7, 0.8), "data_loss")]
        else:
            redis_plan = [(flush_at, "flush")]
        restart_plan = []
        for i, what in enumerate(config.restarts):  # each outage in a window of its own
            down = span * (i + rng.uniform(0.2, 0.4)) / len(config.restarts)
            restart_plan += [(down, f"down:{what}"), (down + config.restart_outage_seconds, f"up:{what}")]
        plan = sorted([(t, "kill") for t in kill_at] + redis_plan + restart_plan)
        chaos_client = redis.Redis.from_url(config.redis_url)
        for at, what in plan:
            delay = load_started + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            elapsed = time.monotonic() - load_started
            if what == "kill":
                killed = workers.kill_one(rng)
                if killed is None:
                    continue
                replacement = workers.spawn()
                kills.append({"at_s": round(elapsed, 2), "worker": killed[0], "busy": killed[1]})
                log(f"  t+{elapsed:5.1f}s SIGKILL {killed[0]} ({killed[1]} job(s) running); started {replacement}")
            elif what == "failover" and cluster is not None:
                fo = faults["failover"] = failover(cluster, cut_ms=config.replication_cut_ms)
                log(
                    f"  t+{elapsed:5.1f}s failover: replica of {fo['killed_port']} cut off, "
                    f"{config.replication_cut_ms:.0f} ms later SIGKILL; {fo['promoted_port']} promoted after "
                    f"{fo['promotion_s']}s; {fo['killed_port']} restarted as a replica"
                )
            elif what.startswith(("down:", "up:")):
                event, _, dependency = what.partition(":")
                servers.switch(dependency, up=event == "up")
                restarts.append(
                    {"dependency": dependency, "event": event, "at_s": round(elapsed, 2), "_t": time.monotonic()}
                )
                log(f"  t+{elapsed:5.1f}s {dependency} {'back' if event == 'up' else 'stopped'}")
            elif what == "data_loss" and cluster is not None:
                loss = faults["data_loss"] = primary_data_loss(cluster)
                log(f"  t+{elapsed:5.1f}s primary {loss['port']} lost its data ({loss['keys_lost']} keys)")
            else:
                keys_before = chaos_client.dbsize()
                chaos_client.flushdb()
                flushes.append({"at_s": round(elapsed, 2), "keys_lost": keys_before})
                log(f"  t+{elapsed:5.1f}s Redis restart: FLUSHDB of {config.redis_url} ({keys_before} keys lost)")
        load_thread.join()
        log(
            f"  load done at t+{time.monotonic() - load_started:.1f}s: {len(load.accepted)} jobs accepted "
            f"({dict(sorted(load.counts.items()))})"
        )

        quiet, quiet_s = wait_quiet(db, load.accepted, timeout=config.quiet_timeout, log=log)
        log(f"  {'quiet' if quiet else 'NOT quiet (timeout)'} after {quiet_s:.1f}s")
        leftovers, settle_s = wait_engine_drained(engine_url, timeout=config.lease_seconds * 3 + 3)
        if watch is not None:
            watch.stop()

        statuses = job_statuses(db)
        accepted = set(load.accepted)
        by_status = Counter(statuses.get(j, "missing") for j in accepted)
        succeeded_ids = {j for j in accepted if statuses.get(j) == "succeeded"}
        lost_ids = sorted(j for j in accepted if statuses.get(j) not in TERMINAL)
        stray = sorted(j for j, s in statuses.items() if j not in accepted and s not in TERMINAL)
        ledger = ledger_report(db, succeeded_ids)
        concurrency = concurrency_report(db)
        failures = Counter(
            r["error_reason"] or "?" for r in db.rows("SELECT error_reason FROM jobs_job WHERE status = 'failed'")
        )
        redelivered = db.rows("SELECT COUNT(*) AS n FROM jobs_job WHERE worker_losses > 0")[0]["n"]
        report: dict[str, Any] = {
            "accepted": len(accepted),
            "succeeded": by_status.get("succeeded", 0),
            "failed": by_status.get("failed", 0),
            # The run's jobs (demo.sleep) fail only by what the run breaks: every failure is one.
            "failed_by_infrastructure": by_status.get("failed", 0),
            "cancelled": by_status.get("cancelled", 0),
            "lost": by_status.get("missing", 0),
            "stuck": len(lost_ids) - by_status.get("missing", 0),
            "duplicated": len(ledger["duplicated"]),
            "rerun_after_worker_loss": len(ledger["rerun_after_worker_loss"]),
            "missing_side_effects": len(ledger["missing"]),
            "over_limit_events": concurrency["over_limit_events"],
            "leaked_holds": leaked_count(leftovers),
            "workers_killed": len(kills),
            "redis_restarts": len(flushes),
            "dependency_restarts": sum(r["event"] == "down" for r in restarts),
            "redelivered_after_worker_loss": redelivered,
            "duration_s": round(time.monotonic() - t0, 1),
        }
        limits_held = report["over_limit_events"] == 0
        if watch is not None:
            raw_stats = connect(engine_url, decode_responses=True).hgetall(STATS_KEY)
            engine_stats = {str(k): str(v) for k, v in raw_stats.items()}
            report["cluster"] = failover_report(watch, faults, concurrency, engine_stats, config)
            report["failovers"] = int("failover" in faults)
            report["primary_data_losses"] = int("data_loss" in faults)
            limits_held = report["cluster"]["over_limit_events_elsewhere"] == 0 and len(faults) == 2
        if restarts:
            report["restarts"] = restarts_report(restarts, dashboard)
            resumed = [r["dashboard_resumed_s"] for r in report["restarts"] if r["dependency"] == "channels"]
            limits_held = limits_held and None not in resumed
        report["ok"] = bool(
            report["accepted"] > 0
            and report["succeeded"] == report["accepted"]
            and report["lost"] == 0
            and report["stuck"] == 0
            and report["duplicated"] == 0
            and report["missing_side_effects"] == 0
            and limits_held
            and report["leaked_holds"] == 0
            and not stray
            and load.counts["idempotency_mismatch"] == 0
        )
        report["details"] = {
            "seed": seed,
            "config": asdict(config) | {"poison_limit": config.poison_limit},
            "redis_restart_method": (
                "on the engine's cluster: a failover (replica cut off, primary SIGKILLed) and a primary's FLUSHALL"
                if cluster is not None
                else "FLUSHDB of the run's Redis database (it keeps nothing on disk, "
                "so an empty database is what a restart leaves)"
            ),
            "kills": kills,
            "flushes": flushes,
            "http": dict(sorted(load.counts.items())),
            "http_errors": load.errors[:20],
            "statuses": dict(by_status),
            "failure_reasons": dict(failures),
            "lost_ids": lost_ids[:50],
            "lost_statuses": dict(Counter(statuses.get(j, "missing") for j in lost_ids)),
            "stray_nonterminal_ids": stray[:50],
            "duplicated_ids": ledger["duplicated"][:50],
            "missing_side_effect_ids": ledger["missing"][:50],
            "concurrency": concurrency,
            "engine_leftovers": leftovers,
            "quiet": quiet,
            "quiet_wait_s": round(quiet_s, 1),
            "engine_settle_s": round(settle_s, 1),
            "run_dir": str(run_dir),
        }
        return report
    finally:
        if dashboard is not None:
            dashboard.stop()
        if load is not None:
            load.stop()
        if watch is not None:
            watch.stop()
        if workers is not None:
            workers.stop_all()
        if web is not None:
            web.stop()
        if cluster is not None:
            cluster.stop()
        servers.stop()
        with contextlib.suppress(redis.RedisError):
            redis.Redis.from_url(config.redis_url).flushdb()


SUMMARY_KEYS = (
    "accepted",
    "succeeded",
    "failed",
    "failed_by_infrastructure",
    "lost",
    "stuck",
    "duplicated",
    "rerun_after_worker_loss",
    "missing_side_effects",
    "over_limit_events",
    "leaked_holds",
    "workers_killed",
    "redis_restarts",
    "dependency_restarts",
    "redelivered_after_worker_loss",
    "duration_s",
    "ok",
)


def report_lines(report: dict[str, Any]) -> list[str]:
    lines = ["", "chaos result:"]
    lines += [f"  {k:<30} {report[k]}" for k in SUMMARY_KEYS]
    d = report["details"]
    peaks = ", ".join(f"{name} {v['peak']}/{v['limit']}" for name, v in d["concurrency"]["scopes"].items())
    lines.append(f"  peak concurrency (peak/limit): {peaks}")
    lines.append(f"  Redis restart = {d['redis_restart_method']}")
    if d["failure_reasons"]:
        lines.append(f"  failure reasons: {d['failure_reasons']}")
    if report["lost"] or report["stuck"]:
        lines.append(f"  lost or stuck jobs by status: {d['lost_statuses']}; e.g. {d['lost_ids'][:5]}")
    if report["leaked_holds"]:
        lines.append(f"  engine leftovers: {d['engine_leftovers']}")
    if d["http_errors"]:
        lines.append(f"  first HTTP errors: {d['http_errors'][:3]}")
    for restart in report.get("restarts", []):
        line = f"  {restart['dependency']} restarted at t+{restart['down_at_s']}s for {restart['outage_s']}s"
        if "dashboard_resumed_s" in restart:
            line += f"; the dashboard's updates resumed {restart['dashboard_resumed_s']}s after it was back"
        lines.append(line)
    cluster = report.get("cluster")
    if cluster:
        fo = cluster.get("failover", {})
        lines.append(
            f"  failover: promoted {fo.get('promotion_s')}s after the SIGKILL, tag trusted again after "
            f"{fo.get('trusted_again_s')}s ({fo.get('rebuilt_after_promotion_s')}s after the promotion); "
            f"writes lost {cluster['writes_lost']} with a {fo.get('replication_cut_ms')} ms replication cut"
        )
        lines.append(
            f"  over-limit events: {cluster['over_limit_events_in_failover_window']} in the failover window "
            f"({cluster.get('failover_window_s')}s), {cluster['over_limit_events_elsewhere']} elsewhere; "
            f"data loss rebuilt after {cluster.get('data_loss', {}).get('rebuilt_s')}s"
        )
    return lines


__all__ = ["ChaosConfig", "ChaosError", "StackError", "report_lines", "run"]
