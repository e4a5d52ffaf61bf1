"""`manage.py bench noisy`: the noisy-neighbour benchmark on the real stack.

One workload (seeded), four modes, each on a fresh stack (a new SQLite file, the bench's
own flushed Redis database, new `manage.py worker` processes with a fixed number of
thread slots):

- ``fifo``: plain Celery. Every job is one `send_task` of `fairqueue.bench.plain_sleep`
  to the single queue ``fq.jobs``; no FairQueue code on the path at all.
- ``isolation``: FairQueue with fixed shares: every tenant's floor and hard max are
  ``slots // tenants`` and f_min = f_max = 1, so nobody ever flexes.
- ``fair``: FairQueue with its dynamic limits, default tenant and pool settings.
- ``fair_no_burst``: ``fair`` with the noisy tenant silent: the steady tenants' reference.
- ``fair_shared_shard``: ``fair`` with the tenants' one shard capped at half the slots, so
  the shard key (shared by every tenant) binds, not the pool: fairness where a busy
  database shard is the limit.
- ``fair_headroom``: ``fair`` with the pool's floor headroom set to the workload's
  ``headroom`` slots, kept for tenants below their floor.

``--mixed`` runs the long-jobs workload (issue 41): steady tenants with 0.2 s jobs, a noisy
tenant flooding with 20 s jobs, 16 slots; its modes are ``fifo``, ``fair`` (no headroom)
and ``fair_headroom``, and its targets are about a floor the steady tenants can count on.

FairQueue modes submit through `job_submit` / `job_submit_bulk`, the functions behind
`POST /api/v1/jobs` and `/jobs/bulk`, as task `demo.sleep`. With ``--submit http`` they go
through the REST API instead, as a customer sending documents one by one would: a
production web server (gunicorn + uvicorn) in front, every job its own `POST /api/v1/jobs`
(each steady tenant on one keep-alive connection, the burst's chunks over
``BURST_HTTP_CLIENTS`` connections at once), and a job's wait counts from just before its
request was sent, so time spent in the web server is part of it.

Each mode runs in a child process (``python -m fairqueue.bench.noisy --child ...``)
whose environment points Django at that mode's database and Redis; the child seeds the
policy, starts the workers, drives the workload from threads, waits for every job to
end and writes the raw per-job records. This process computes the figures from them.

Definitions (all times are wall-clock unix seconds on one host):

- wait = started - submitted. FairQueue: `Job.started_at - Job.submitted_at` (started is
  the worker's claim, before the task body). fifo: the task's own start minus the time
  just before `send_task`.
- makespan (noisy) = last noisy finish - first noisy submit.
- utilisation while a backlog exists: a job is *backlogged* from ``submitted + 0.1 s``
  until it starts (the 0.1 s grace keeps a message merely in transit from counting as a
  backlog). B is the union of all backlogged intervals; utilisation = busy slot-seconds
  inside B / (slots * |B|), where a slot is busy while a task *body* runs (the sleep:
  FairQueue's own per-job overhead counts as idle, as it is for plain Celery).
- jobs_per_s = jobs / (last finish - first submit).
- mean_job_s = mean drawn duration of the mode's jobs (the workload's, not measured).
"""

from __future__ import annotations

import bisect
import contextlib
import http.client
import json
import math
import os
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from fairqueue.bench import stack
from fairqueue.bench.extras import extras_require
from fairqueue.queues import JOBS_QUEUE

MODES = ("fifo", "isolation", "fair", "fair_no_burst", "fair_shared_shard", "fair_headroom")
SHORT_JOB_MODES = MODES[:5]
MIXED_MODES = ("fifo", "fair", "fair_headroom")
REDIS_BROKER = "redis"  # the bench's own Redis database (--redis-url) as the Celery broker
# Figures compared between brokers (another broker's over Redis's, same mode, same run).
BROKER_COMPARED = ("quiet_p50_wait_s", "quiet_p99_wait_s", "noisy_p99_wait_s", "noisy_makespan_s", "utilization")
BACKLOG_GRACE_S = 0.1
QUIET_PREFIX = "quiet-"
NOISY_SLUG = "noisy"
SHARD_NAME = "bench"
SHARD_CAPACITY = 10_000  # the shard key must not be what throttles anyone here (but in fair_shared_shard)
FIFO_QUEUE = JOBS_QUEUE
TRACE_INTERVAL_S = 0.25
SUBMIT_WAYS = ("direct", "http")
BURST_HTTP_CLIENTS = 8  # connections the noisy customer's burst is sent over with --submit http
HTTP_TIMEOUT_S = 60.0
REQUIRED_EXTRAS = ("numpy",)  # the workload and the percentiles
PLOT_EXTRAS = ("matplotlib",)  # --plot

Log = Callable[[str], None]


@dataclass(frozen=True)
class Workload:
    seed: int = 7
    # 16 slots as 4 processes x 4 threads: a Celery consumer shares its process's GIL with
    # its task threads, and fewer threads per consumer keep message intake from lagging.
    workers: int = 4
    slots_per_worker: int = 4
    quiet_tenants: int = 4
    quiet_rate_per_s: float = 3.0  # per steady tenant, Poisson
    mean_job_s: float = 0.3  # lognormal mean
    sigma: float = 1.0  # lognormal shape (p99 is about 6x the mean)
    max_job_s: float = 5.0
    warmup_s: float = 5.0  # steady traffic before the burst
    burst_jobs: int = 960
    burst_seconds: float = 3.0
    burst_chunks: int = 12
    steady_s: float = 30.0  # how long the steady tenants keep submitting
    # Long jobs (--mixed): every noisy job lasts this long (None: drawn like the steady ones).
    noisy_job_s: float | None = None
    headroom: int = 2  # fair_headroom: the pool's floor headroom, in slots
    # The steady tenants' floor in the FairQueue modes (None: a tenant's default). A floor is
    # the concurrency a tenant is guaranteed, so the long-jobs workload sizes it to a steady
    # tenant's peaks: jobs past it are served in fair order, not from the kept slots.
    quiet_floor: int | None = None

    @property
    def slots(self) -> int:
        return self.workers * self.slots_per_worker

    @property
    def tenants(self) -> int:
        return self.quiet_tenants + 1


# A steady tenant of the mixed workload runs 0.2 jobs at once on average (one 0.2 s job a
# second); it has three or more at once on about 0.1 % of its arrivals (Poisson, M/G/inf).
MIXED_QUIET_FLOOR = 3

PRESETS: dict[str, Workload] = {
    "default": Workload(),
    "quick": Workload(
        quiet_rate_per_s=2.0,
        mean_job_s=0.2,
        warmup_s=2.0,
        burst_jobs=320,
        burst_seconds=1.0,
        burst_chunks=4,
        steady_s=7.0,
    ),
    # --mixed: the floor under long jobs. Four steady tenants send 0.2 s jobs, one a second
    # each; 3 s in, the noisy tenant floods 64 jobs of 20 s (four rounds of the pool).
    "mixed": Workload(
        quiet_rate_per_s=1.0,
        mean_job_s=0.2,
        sigma=0.5,
        max_job_s=1.0,
        warmup_s=3.0,
        burst_jobs=64,
        burst_seconds=0.0,
        burst_chunks=1,
        steady_s=80.0,
        noisy_job_s=20.0,
        quiet_floor=MIXED_QUIET_FLOOR,
    ),
    "mixed-quick": Workload(
        quiet_rate_per_s=1.0,
        mean_job_s=0.2,
        sigma=0.5,
        max_job_s=1.0,
        warmup_s=3.0,
        burst_jobs=32,
        burst_seconds=0.0,
        burst_chunks=1,
        steady_s=20.0,
        noisy_job_s=8.0,
        quiet_floor=MIXED_QUIET_FLOOR,
    ),
    "mixed-smoke": Workload(
        workers=1,
        slots_per_worker=4,
        quiet_tenants=2,
        quiet_rate_per_s=1.0,
        mean_job_s=0.1,
        sigma=0.5,
        max_job_s=0.5,
        warmup_s=1.0,
        burst_jobs=8,
        burst_seconds=0.0,
        burst_chunks=1,
        steady_s=5.0,
        noisy_job_s=2.0,
        headroom=1,
        quiet_floor=MIXED_QUIET_FLOOR,
    ),
    "smoke": Workload(
        workers=1,
        slots_per_worker=4,
        quiet_tenants=2,
        quiet_rate_per_s=2.0,
        mean_job_s=0.05,
        max_job_s=0.5,
        warmup_s=0.5,
        burst_jobs=24,
        burst_seconds=0.3,
        burst_chunks=2,
        steady_s=2.0,
    ),
}


# --- workload -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    at: float  # seconds after the start
    tenant: str
    seconds: float
    chunk: int  # -1 for a steady job; the burst's chunk number otherwise


def workload_plan(w: Workload) -> list[Planned]:
    """The deterministic schedule: steady Poisson arrivals plus the noisy burst in chunks."""
    import numpy as np  # heavy, and only the bench needs it: imported when used

    rng = np.random.default_rng(w.seed)
    mu = math.log(w.mean_job_s) - w.sigma**2 / 2

    def duration() -> float:
        return round(float(min(rng.lognormal(mu, w.sigma), w.max_job_s)), 4)

    plan: list[Planned] = []
    for i in range(w.quiet_tenants):
        t = float(rng.exponential(1 / w.quiet_rate_per_s))
        while t < w.steady_s:
            plan.append(Planned(at=round(t, 4), tenant=f"{QUIET_PREFIX}{i + 1}", seconds=duration(), chunk=-1))
            t += float(rng.exponential(1 / w.quiet_rate_per_s))
    per_chunk = math.ceil(w.burst_jobs / w.burst_chunks)
    for n in range(w.burst_jobs):
        chunk = n // per_chunk
        at = w.warmup_s + (w.burst_seconds * chunk / max(w.burst_chunks - 1, 1) if w.burst_chunks > 1 else 0.0)
        seconds = w.noisy_job_s if w.noisy_job_s is not None else duration()
        plan.append(Planned(at=round(at, 4), tenant=NOISY_SLUG, seconds=seconds, chunk=chunk))
    return sorted(plan, key=lambda p: (p.at, p.tenant))


# --- metrics (pure) ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np  # heavy, and only the bench needs it: imported when used

    return float(np.percentile(np.asarray(values, dtype=float), q))


def intervals_union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def overlap(a: float, b: float, union: list[tuple[float, float]], starts: list[float]) -> float:
    """Length of [a, b] inside a sorted, disjoint union of intervals."""
    total = 0.0
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    while i < len(union) and union[i][0] < b:
        lo, hi = max(a, union[i][0]), min(b, union[i][1])
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def backlog_utilisation(records: Sequence[dict[str, Any]], slots: int) -> tuple[float | None, float]:
    """(busy slot-seconds / (slots * backlog seconds), backlog seconds); None without a backlog."""
    union = intervals_union([(r["submitted"] + BACKLOG_GRACE_S, r["started"]) for r in records])
    length = sum(b - a for a, b in union)
    if length <= 0:
        return None, 0.0
    starts = [a for a, _ in union]
    busy = sum(overlap(r["run_started"], r["run_finished"], union, starts) for r in records)
    return busy / (slots * length), length


def quiet_work_displacing(quiet: Sequence[dict[str, Any]], noisy: Sequence[dict[str, Any]], *, slots: int) -> float:
    """The steady tenants' work that ran while a noisy job waited for a slot, in seconds of
    the whole pool (slot-seconds / slots): the work that delays the noisy tenant. Steady
    work in a slot no noisy job was waiting for (fifo runs the steady jobs it deferred in
    the burst's last seconds, when fewer noisy jobs are left than slots) delays nothing."""
    union = intervals_union([(r["submitted"], r["started"]) for r in noisy])
    starts = [a for a, _ in union]
    return sum(overlap(r["run_started"], r["run_finished"], union, starts) for r in quiet) / slots


def mode_metrics(records: Sequence[dict[str, Any]], *, slots: int) -> dict[str, Any]:
    quiet = [r for r in records if r["tenant"] != NOISY_SLUG]
    noisy = [r for r in records if r["tenant"] == NOISY_SLUG]

    def waits(rs: Sequence[dict[str, Any]]) -> list[float]:
        return [max(r["started"] - r["submitted"], 0.0) for r in rs]

    util, backlog_s = backlog_utilisation(records, slots)
    first = min((r["submitted"] for r in records), default=0.0)
    last = max((r["finished"] for r in records), default=0.0)
    makespan = (max(r["finished"] for r in noisy) - min(r["submitted"] for r in noisy)) if noisy else None
    # The steady tenants' work that ran inside the noisy tenant's window, in pool-seconds: a
    # fair scheduler runs it during the burst (fifo defers it until after), so it lengthens
    # the noisy makespan by design rather than by waste.
    quiet_in_window = None
    quiet_displacing = None
    if noisy:
        window = [(min(r["submitted"] for r in noisy), max(r["finished"] for r in noisy))]
        starts = [window[0][0]]
        quiet_in_window = sum(overlap(r["run_started"], r["run_finished"], window, starts) for r in quiet) / slots
        quiet_displacing = quiet_work_displacing(quiet, noisy, slots=slots)

    def rnd(x: float | None, n: int = 4) -> float | None:
        return None if x is None else round(x, n)

    return {
        "quiet_p50_wait_s": rnd(percentile(waits(quiet), 50)),
        "quiet_p99_wait_s": rnd(percentile(waits(quiet), 99)),
        "noisy_p50_wait_s": rnd(percentile(waits(noisy), 50)),
        "noisy_p99_wait_s": rnd(percentile(waits(noisy), 99)),
        "noisy_makespan_s": rnd(makespan, 3),
        "quiet_work_in_noisy_window_s": rnd(quiet_in_window, 3),
        "noisy_makespan_excl_quiet_s": rnd(None if makespan is None else makespan - (quiet_in_window or 0.0), 3),
        "quiet_work_displacing_noisy_s": rnd(quiet_displacing, 3),
        "noisy_makespan_excl_displacing_quiet_s": rnd(
            None if makespan is None else makespan - (quiet_displacing or 0.0), 3
        ),
        "utilization": rnd(util, 4),
        "jobs_per_s": rnd(len(records) / (last - first), 2) if last > first else None,
        "jobs": len(records),
        "mean_job_s": rnd(sum(r["seconds"] for r in records) / len(records)) if records else None,
        # Context for reading the figures above.
        "quiet_jobs": len(quiet),
        "noisy_jobs": len(noisy),
        "backlog_s": round(backlog_s, 3),
        "wall_s": round(last - first, 3),
        "failed": sum(1 for r in records if not r.get("ok", True)),
    }


def mixed_targets_check(modes: dict[str, dict[str, Any]], w: Workload) -> dict[str, Any]:
    """The long-jobs targets (issue 41); `met` is None when a mode they need was not run."""
    fair, headroom = modes.get("fair"), modes.get("fair_headroom")
    noisy_s = w.noisy_job_s or 0.0
    kept_share = max(0, w.slots - w.headroom) / w.slots
    out: dict[str, Any] = {}
    q99 = None if headroom is None else headroom.get("quiet_p99_wait_s")
    out["quiet_p99_with_headroom"] = {
        "target": "fair_headroom quiet P99 wait <= 1 s",
        "fair_headroom": q99,
        "met": None if q99 is None else q99 <= 1.0,
    }
    f99 = None if fair is None else fair.get("quiet_p99_wait_s")
    out["quiet_p99_without_headroom"] = {
        "target": "fair quiet P99 wait <= one noisy job's duration (never two rounds)",
        "fair": f99,
        "noisy_job_s": noisy_s,
        "met": None if f99 is None else f99 <= noisy_s,
    }
    util = None if headroom is None else headroom.get("utilization")
    out["utilization_with_headroom"] = {
        "target": "fair_headroom utilisation >= the share of the pool not kept as headroom - 0.03",
        "fair_headroom": util,
        "bound": round(kept_share - 0.03, 4),
        "met": None if util is None else util >= kept_share - 0.03,
    }
    return out


def targets_check(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's four targets; `met` is None when a mode they need was not run."""
    fifo, iso, fair, nb, shared = (modes.get(m) for m in SHORT_JOB_MODES)
    out: dict[str, Any] = {}

    def get(m: dict[str, Any] | None, k: str) -> float | None:
        return None if m is None else m.get(k)

    q99, n99 = get(fifo, "quiet_p99_wait_s"), get(nb, "quiet_p99_wait_s")
    for name, m, suffix in (("fair", fair, ""), ("fair_shared_shard", shared, "_shared_shard")):
        f99 = get(m, "quiet_p99_wait_s")
        ratio = (q99 / f99 if f99 else math.inf) if (f99 is not None and q99 is not None) else None
        out[f"quiet_p99_vs_fifo{suffix}"] = {
            "target": f"{name} quiet P99 wait <= fifo quiet P99 wait / 20",
            name: f99,
            "fifo": q99,
            "ratio_fifo_over_fair": None if ratio is None else (round(ratio, 1) if math.isfinite(ratio) else "inf"),
            "met": None if ratio is None else ratio >= 20,
        }
        mean_job = get(m, "mean_job_s")
        bound = None if (n99 is None or mean_job is None) else round(n99 + mean_job, 4)
        out[f"quiet_p99_vs_no_burst{suffix}"] = {
            "target": f"{name} quiet P99 wait <= fair_no_burst quiet P99 wait + one mean job duration",
            name: f99,
            "fair_no_burst": n99,
            "mean_job_s": mean_job,
            "bound": bound,
            "met": None if (bound is None or f99 is None) else f99 <= bound,
        }
    fu, iu = get(fair, "utilization"), get(iso, "utilization")
    out["utilization"] = {
        "target": "fair utilisation while a backlog exists >= 0.9 and above isolation's",
        "fair": fu,
        "isolation": iu,
        "met": None if (fu is None or iu is None) else (fu >= 0.9 and fu > iu),
    }

    def makespan_ratio(figure: str, target: str, bound: float = 1.1) -> dict[str, Any]:
        f, q = get(fair, figure), get(fifo, figure)
        ratio = None if (f is None or not q) else f / q
        return {
            "target": target,
            "fair": f,
            "fifo": q,
            "ratio_fair_over_fifo": None if ratio is None else round(ratio, 3),
            "met": None if ratio is None else ratio <= bound,
        }

    out["noisy_makespan"] = makespan_ratio("noisy_makespan_s", "fair noisy makespan <= 1.1 x fifo's")
    # Informational: the same ratio once each mode's makespan excludes the steady tenants'
    # work done inside the noisy window (pool-seconds), i.e. capacity wasted or not.
    out["noisy_makespan_excl_quiet_work"] = makespan_ratio(
        "noisy_makespan_excl_quiet_s",
        "(informational) same ratio without the steady tenants' work inside the window <= 1.1",
    )
    # The same without only the steady work that ran while a noisy job waited: what the
    # scheduler's own overhead adds to the burst, the rest being the steady tenants' due.
    out["noisy_makespan_excl_displacing_quiet_work"] = makespan_ratio(
        "noisy_makespan_excl_displacing_quiet_s",
        "(informational) same ratio without the steady tenants' work done while a noisy job waited <= 1.05",
        bound=1.05,
    )
    return out


# --- orchestration (the bench process) -------------------------------------------------------------


def add_arguments(parser: Any) -> None:
    parser.add_argument("--quick", action="store_true", help="a short run: all four modes in under two minutes")
    parser.add_argument("--smoke", action="store_true", help="a tiny run for the test suite: shape, not figures")
    parser.add_argument("--json", dest="json_path", help="also write the result document to this JSON file")
    parser.add_argument("--plot", dest="plot_path", help="write the wait distributions to this PNG")
    stack.add_redis_arguments(parser)
    parser.add_argument(
        "--mixed",
        action="store_true",
        help="the long-jobs workload: steady 0.2 s jobs beside a flood of 20 s jobs, in modes "
        f"{', '.join(MIXED_MODES)} (with --quick or --smoke: shorter)",
    )
    parser.add_argument(
        "--documents",
        action="store_true",
        help="the fan-out workload (fairqueue.bench.documents): one tenant sends large documents, the others "
        "one-page documents, in modes fifo, long (one job per document) and fanout (with --quick or --smoke: "
        "shorter)",
    )
    parser.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated subset of {','.join(MODES)} (default: {','.join(SHORT_JOB_MODES)}; with --mixed "
        f"{','.join(MIXED_MODES)})",
    )
    parser.add_argument("--seed", type=int, default=None, help="workload seed (default: the preset's)")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: the preset's)")
    parser.add_argument("--slots-per-worker", type=int, default=None, help="thread slots per worker")
    parser.add_argument(
        "--database-url",
        default=None,
        help="a PostgreSQL server URL (e.g. postgres://postgres@127.0.0.1:5432/): each mode gets a fresh "
        "database fq_bench_<mode> on it instead of a SQLite file",
    )
    parser.add_argument(
        "--submit",
        choices=SUBMIT_WAYS,
        default="direct",
        help="how FairQueue modes submit: 'direct' calls the submit service in process; 'http' sends one "
        "POST /api/v1/jobs per job to a production web server (gunicorn + uvicorn) the run starts",
    )
    parser.add_argument(
        "--broker-url",
        dest="broker_urls",
        action="append",
        default=[],
        metavar="AMQP_URL",
        help="also run every mode with this RabbitMQ broker (amqp://user:password@host:5672/vhost, a virtual "
        "host for the bench alone: its FairQueue queues are deleted); repeatable. Each mode runs on the "
        "Redis broker (--redis-url) first and then on each of these, so the figures compare within one run",
    )


def run_command(options: dict[str, Any], *, log: Log) -> dict[str, Any]:
    extras_require(REQUIRED_EXTRAS + (PLOT_EXTRAS if options["plot_path"] else ()), purpose="bench noisy")
    mixed = bool(options.get("mixed"))
    chosen = options.get("modes") or ",".join(MIXED_MODES if mixed else SHORT_JOB_MODES)
    modes = [m.strip() for m in chosen.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise RuntimeError(f"unknown modes {unknown}; choose from {list(MODES)}")
    preset = "smoke" if options["smoke"] else "quick" if options["quick"] else "default"
    if mixed:
        preset = {"default": "mixed", "quick": "mixed-quick", "smoke": "mixed-smoke"}[preset]
    return run(
        redis_url=options["redis_url"],
        preset=preset,
        modes=modes,
        force=options["force"],
        plot_path=options["plot_path"],
        seed=options["seed"],
        database_url=options.get("database_url"),
        workers=options.get("workers"),
        slots_per_worker=options.get("slots_per_worker"),
        broker_urls=options.get("broker_urls") or (),
        submit=options.get("submit") or "direct",
        log=log,
    )


def broker_names(broker_urls: Sequence[str]) -> list[tuple[str, str | None]]:
    """(name, URL) of every broker a run uses: Redis (its URL is --redis-url) first, then
    "amqp" (or amqp1, amqp2, ... when several are given)."""
    extra = [("amqp" if len(broker_urls) == 1 else f"amqp{i + 1}", url) for i, url in enumerate(broker_urls)]
    return [(REDIS_BROKER, None), *extra]


def broker_comparison(by_broker: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per other broker and mode: each compared figure and its ratio to Redis's."""
    base = by_broker.get(REDIS_BROKER, {})
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, modes in by_broker.items():
        if name == REDIS_BROKER:
            continue
        for mode, figures in modes.items():
            row: dict[str, Any] = {}
            for key in BROKER_COMPARED:
                mine, theirs = figures.get(key), base.get(mode, {}).get(key)
                ratio = round(mine / theirs, 3) if (mine is not None and theirs) else None
                row[key] = {name: mine, REDIS_BROKER: theirs, "ratio": ratio}
            out.setdefault(name, {})[mode] = row
    return out


def run(
    *,
    redis_url: str = stack.DEFAULT_REDIS_URL,
    preset: str = "default",
    modes: Sequence[str] = SHORT_JOB_MODES,
    force: bool = False,
    plot_path: str | None = None,
    seed: int | None = None,
    database_url: str | None = None,
    workers: int | None = None,
    slots_per_worker: int | None = None,
    broker_urls: Sequence[str] = (),
    submit: str = "direct",
    log: Log = print,
) -> dict[str, Any]:
    """Run every mode on a fresh stack (on each broker); return the result document."""
    workload = PRESETS[preset]
    if seed is not None:
        workload = replace(workload, seed=seed)
    if workers:
        workload = replace(workload, workers=workers)
    if slots_per_worker:
        workload = replace(workload, slots_per_worker=slots_per_worker)
    stack.redis_db_prepare(redis_url, force=force)
    brokers = broker_names(broker_urls)
    for _, url in brokers:
        if url is not None:
            stack.amqp_broker_prepare(url, force=force)
    work_dir = stack.BENCH_DIR
    work_dir.mkdir(parents=True, exist_ok=True)
    template = work_dir / "noisy-template.sqlite3"
    started = time.monotonic()
    log(
        f"bench noisy ({preset}): {workload.workers} workers x {workload.slots_per_worker} slots, "
        f"seed {workload.seed}, submit {submit}"
    )
    if database_url is None:
        stack.fresh_database(template, stack.stack_env(redis_url=redis_url, db_path=template))
    by_broker: dict[str, dict[str, dict[str, Any]]] = {name: {} for name, _ in brokers}
    raw_by_broker: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name, _ in brokers}
    traces: dict[str, Any] = {}
    try:
        # Brokers alternate within each mode, so a drift of this machine's speed during
        # the run lands on both alike.
        for mode in modes:
            for broker, broker_url in brokers:
                t0 = time.monotonic()
                stack.redis_db_flush(redis_url)
                if broker_url is not None:
                    stack.amqp_broker_flush(broker_url)
                db_path = work_dir / f"noisy-{mode}.sqlite3"
                # Without its own broker, the stack's Redis database is the broker too.
                broker_env = {"CELERY_BROKER_URL": broker_url} if broker_url else {}
                if database_url is None:
                    for suffix in ("", "-wal", "-shm"):
                        Path(f"{db_path}{suffix}").unlink(missing_ok=True)
                    db_path.write_bytes(template.read_bytes())
                    env = stack.stack_env(redis_url=redis_url, db_path=db_path, **broker_env)
                else:
                    mode_url = stack.fresh_postgres(database_url, f"fq_bench_{mode}")
                    env = stack.stack_env(redis_url=redis_url, db_path=db_path, database_url=mode_url, **broker_env)
                    stack.migrate(env)
                with tempfile.TemporaryDirectory() as tmp:
                    spec = Path(tmp) / "spec.json"
                    out = Path(tmp) / "out.json"
                    spec.write_text(json.dumps({"mode": mode, "workload": asdict(workload), "submit": submit}))
                    stack.run_child(
                        "fairqueue.bench.noisy", ["--child", str(spec), str(out)], env=env, timeout=_timeout(workload)
                    )
                    child = json.loads(out.read_text())
                raw_by_broker[broker][mode] = child["records"]
                figures = mode_metrics(child["records"], slots=workload.slots)
                figures["trace"] = child.get("trace_summary")
                by_broker[broker][mode] = figures
                traces[mode if broker == REDIS_BROKER else f"{mode}@{broker}"] = child.get("trace", [])
                log(f"  {mode:<14} {broker:<6} {len(child['records'])} jobs in {time.monotonic() - t0:.1f}s")
    finally:
        stack.redis_db_flush(redis_url)
        for _, url in brokers:
            if url is not None:
                stack.amqp_broker_flush(url)
    results, raw = by_broker[REDIS_BROKER], raw_by_broker[REDIS_BROKER]
    trace_path = work_dir / "noisy-trace.json"
    trace_path.write_text(json.dumps(traces) + "\n")
    (work_dir / "noisy-records.json").write_text(json.dumps(raw) + "\n")  # per-job timings, to recompute
    for broker, broker_raw in raw_by_broker.items():
        if broker != REDIS_BROKER:
            (work_dir / f"noisy-records-{broker}.json").write_text(json.dumps(broker_raw) + "\n")
    doc: dict[str, Any] = {
        "modes": results,
        "workload": {**asdict(workload), "preset": preset, "slots": workload.slots, "jobs_planned": None},
        "database": "postgresql" if database_url else "sqlite",
        "submit": submit,
        "broker": REDIS_BROKER,  # of "modes" and "targets"; "brokers" has every broker's figures
        "definitions": {
            "wait": "started - submitted (FairQueue: Job.started_at - Job.submitted_at; with --submit http, "
            "submitted is the client's clock just before the request)",
            "utilization": f"busy slot-seconds (task bodies) inside backlog periods / (slots x backlog seconds); "
            f"a job is backlogged from submitted + {BACKLOG_GRACE_S}s until it starts",
            "makespan": "last noisy finish - first noisy submit",
            "quiet_work_displacing_noisy_s": "steady jobs' run time while some noisy job waited for a slot "
            "(submitted until started), in slot-seconds / slots",
            "jobs_per_s": "jobs / (last finish - first submit)",
        },
        "targets": mixed_targets_check(results, workload) if workload.noisy_job_s else targets_check(results),
        "trace_path": str(trace_path),
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    doc["workload"]["jobs_planned"] = len(workload_plan(workload))
    if len(brokers) > 1:
        doc["brokers"] = {
            name: {
                "url": stack.broker_label(url or redis_url),
                "modes": by_broker[name],
                "targets": (
                    mixed_targets_check(by_broker[name], workload)
                    if workload.noisy_job_s
                    else targets_check(by_broker[name])
                ),
            }
            for name, url in brokers
        }
        doc["broker_comparison"] = broker_comparison(by_broker)
    doc["all_targets_met"] = (
        all(t["met"] for name, t in doc["targets"].items() if "informational" not in t["target"]) if results else False
    )
    for line in report_lines(doc):
        log(line)
    if plot_path:
        plot(raw, plot_path, title=f"bench noisy ({preset}, seed {workload.seed})")
        log(f"wrote {plot_path}")
    return doc


def _timeout(w: Workload) -> float:
    # Worst case is isolation: the noisy tenant drains on its fixed share alone.
    share = max(w.slots // w.tenants, 1)
    return 120 + w.steady_s + 3 * w.burst_jobs * (w.noisy_job_s or w.mean_job_s) / share


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3f}"
    return str(x)


REPORT_COLUMNS = (
    ("quiet_p50_wait_s", "quiet p50"),
    ("quiet_p99_wait_s", "quiet p99"),
    ("noisy_p50_wait_s", "noisy p50"),
    ("noisy_p99_wait_s", "noisy p99"),
    ("noisy_makespan_s", "noisy makespan"),
    ("utilization", "util (backlog)"),
    ("jobs_per_s", "jobs/s"),
    ("jobs", "jobs"),
    ("mean_job_s", "mean job"),
)


def _table(modes: dict[str, dict[str, Any]], *, label: str = "mode") -> list[str]:
    widths = [max(len(h), 8) for _, h in REPORT_COLUMNS]
    lines = [f"{label:<14} " + " ".join(f"{h:>{w}}" for (_, h), w in zip(REPORT_COLUMNS, widths, strict=True))]
    for mode, m in modes.items():
        lines.append(
            f"{mode:<14} " + " ".join(f"{_fmt(m[k]):>{w}}" for (k, _), w in zip(REPORT_COLUMNS, widths, strict=True))
        )
    return lines


def report_lines(doc: dict[str, Any]) -> list[str]:
    brokers = doc.get("brokers", {})
    lines = [""]
    if brokers:
        for name, broker in brokers.items():
            lines += [f"broker {name} ({broker['url']})", *_table(broker["modes"]), ""]
    else:
        lines += _table(doc["modes"])
    lines.append("(waits and makespan in seconds)")
    for name, modes in doc.get("broker_comparison", {}).items():
        for mode, row in modes.items():
            detail = ", ".join(f"{k} {_fmt(v['ratio'])}" for k, v in row.items())
            lines.append(f"{name} / {REDIS_BROKER}, {mode}: {detail}")
    lines.append("")
    if brokers:
        lines.append(f"targets on the {REDIS_BROKER} broker:")
    for name, t in doc["targets"].items():
        verdict = {True: "PASS", False: "MISS", None: "n/a "}[t["met"]]
        detail = ", ".join(f"{k}={_fmt(v)}" for k, v in t.items() if k not in ("target", "met"))
        lines.append(f"{verdict} {name}: {t['target']} ({detail})")
    return lines


def plot(raw: dict[str, list[dict[str, Any]]], path: str, *, title: str) -> None:
    """Wait distributions (empirical CDFs, log time axis) per mode, one panel per tenant kind."""
    import matplotlib  # heavy, only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np  # heavy, and only the bench needs it: imported when used

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, kind in zip(axes, ("steady tenants", "noisy tenant"), strict=True):
        for mode, records in raw.items():
            rs = [r for r in records if (r["tenant"] == NOISY_SLUG) == (kind == "noisy tenant")]
            if not rs:
                continue
            w = np.sort(np.maximum([r["started"] - r["submitted"] for r in rs], 1e-3))
            ax.step(w, np.arange(1, len(w) + 1) / len(w), where="post", label=f"{mode} (n={len(w)})")
        ax.set_xscale("log")
        ax.set_xlabel("queue wait, submit to start (s, log)")
        ax.set_title(kind)
        ax.grid(True, which="both", alpha=0.3)
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.legend(loc="lower right", fontsize=8)
    axes[0].set_ylabel("fraction of jobs")
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- one mode (the child process, Django configured for its own stack) -----------------------------


def _policy_setup(mode: str, w: Workload) -> dict[str, str]:
    """The mode's shard and tenants; returns each tenant's raw API key (slug -> key)."""
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from tenants.models import PoolSettings, Shard, Tenant
    from tenants.sync import policy_sync_all

    capacity = max(w.slots // 2, 1) if mode == "fair_shared_shard" else SHARD_CAPACITY
    shard = Shard.objects.create(name=SHARD_NAME, capacity=capacity)
    slugs = [f"{QUIET_PREFIX}{i + 1}" for i in range(w.quiet_tenants)] + [NOISY_SLUG]
    pool = PoolSettings.load()
    keys: dict[str, str] = {}
    for slug in slugs:
        tenant = Tenant(slug=slug, name=slug, shard=shard)
        if mode == "isolation":
            share = max(w.slots // w.tenants, 1)
            tenant.floor = tenant.max_concurrency = share
            tenant.burst_floor, tenant.burst_pct = 0, 0.0
        elif w.quiet_floor is not None and slug.startswith(QUIET_PREFIX):
            tenant.floor = w.quiet_floor
        # fair, fair_no_burst, fair_shared_shard: the defaults (fifo never reads policy)
        keys[slug] = tenant.rotate_api_key()
        tenant.save()
    if mode == "isolation":
        pool.f_min = pool.f_max = 1.0
    if mode == "fair_headroom":
        pool.floor_headroom = w.headroom
    pool.save()
    policy_sync_all()
    return keys


class _Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fifo_submitted: dict[str, tuple[str, float, float]] = {}  # id -> (tenant, submitted, seconds)
        self.http_submitted: dict[str, float] = {}  # --submit http: job id -> client clock before the request
        self.errors: list[str] = []


class _HttpClient:
    """One keep-alive connection to the web server, as one customer's client (one thread)."""

    def __init__(self, base_url: str, api_key: str, rec: _Recorder) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        self.conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=HTTP_TIMEOUT_S)
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.rec = rec

    def submit(self, seconds: float) -> None:
        body = json.dumps({"task": "demo.sleep", "args": {"seconds": seconds}})
        sent = time.time()
        self.conn.request("POST", "/api/v1/jobs", body=body, headers=self.headers)
        response = self.conn.getresponse()
        answer = response.read()
        if response.status != 202:
            raise RuntimeError(f"POST /api/v1/jobs: HTTP {response.status}: {answer[:200]!r}")
        with self.rec.lock:
            self.rec.http_submitted[json.loads(answer)["id"]] = sent

    def close(self) -> None:
        self.conn.close()


def _drive(mode: str, plan: list[Planned], rec: _Recorder, *, base_url: str | None, keys: dict[str, str]) -> None:
    """Submit the plan in real time: a thread per steady tenant, one for the burst.
    `base_url`: FairQueue modes send each job to the REST API there (--submit http)."""
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from django.db import connections

    from fairqueue.bench.tasks import PLAIN_TASK_NAME
    from fairqueue.celery import app
    from fairqueue.jobs.submission import JobRequest, job_submit, job_submit_bulk
    from tenants.models import Tenant

    tenants = {t.slug: t for t in Tenant.objects.select_related("shard")}
    start = time.time() + 0.5

    def wait_until(at: float) -> None:
        delay = start + at - time.time()
        if delay > 0:
            time.sleep(delay)

    def fifo_send(tenant: str, seconds: float) -> None:
        job_id = uuid.uuid4().hex
        submitted = time.time()
        app.send_task(PLAIN_TASK_NAME, args=[job_id, seconds], queue=FIFO_QUEUE)
        with rec.lock:
            rec.fifo_submitted[job_id] = (tenant, submitted, seconds)

    use_http = base_url is not None and mode != "fifo"

    def steady(items: list[Planned]) -> None:
        client = _HttpClient(base_url, keys[items[0].tenant], rec) if use_http and base_url else None
        try:
            for p in items:
                wait_until(p.at)
                if mode == "fifo":
                    fifo_send(p.tenant, p.seconds)
                elif client is not None:
                    client.submit(p.seconds)
                else:
                    job_submit(tenant=tenants[p.tenant], req=JobRequest(task="demo.sleep", args={"seconds": p.seconds}))
        except Exception as exc:  # surfaced by the child's exit status
            rec.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            if client is not None:
                client.close()
            connections.close_all()

    def burst_http(chunk: list[Planned], clients: list[_HttpClient]) -> None:
        """One chunk as single submits, spread over the burst's connections at once."""

        def send(client: _HttpClient, items: list[Planned]) -> None:
            try:
                for p in items:
                    client.submit(p.seconds)
            except Exception as exc:
                rec.errors.append(f"{type(exc).__name__}: {exc}")

        senders = [
            threading.Thread(target=send, args=(client, chunk[i :: len(clients)]), name=f"bench-burst-{i}")
            for i, client in enumerate(clients)
        ]
        for t in senders:
            t.start()
        for t in senders:
            t.join()

    def burst(items: list[Planned]) -> None:
        clients = (
            [_HttpClient(base_url, keys[NOISY_SLUG], rec) for _ in range(BURST_HTTP_CLIENTS)]
            if use_http and base_url
            else []
        )
        try:
            chunks: dict[int, list[Planned]] = {}
            for p in items:
                chunks.setdefault(p.chunk, []).append(p)
            for _, chunk in sorted(chunks.items()):
                wait_until(chunk[0].at)
                if clients:
                    burst_http(chunk, clients)
                elif mode == "fifo":
                    for p in chunk:
                        fifo_send(p.tenant, p.seconds)
                else:
                    job_submit_bulk(
                        tenant=tenants[NOISY_SLUG],
                        reqs=[JobRequest(task="demo.sleep", args={"seconds": p.seconds}) for p in chunk],
                    )
        except Exception as exc:
            rec.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            for client in clients:
                client.close()
            connections.close_all()

    by_tenant: dict[str, list[Planned]] = {}
    for p in plan:
        by_tenant.setdefault(p.tenant, []).append(p)
    threads = [
        threading.Thread(target=burst if slug == NOISY_SLUG else steady, args=(items,), name=f"bench-{slug}")
        for slug, items in by_tenant.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class _Tracer(threading.Thread):
    """Samples each tenant's limit, holders and parked count, and the fleet's in-flight."""

    def __init__(self, slugs: list[str]) -> None:
        super().__init__(name="bench-tracer", daemon=True)
        self.slugs = slugs
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        # Django's models exist only after django.setup() in the child (child_main): imported here.
        from fairqueue.jobs.admission import shard_tag, tenant_key
        from fairqueue.jobs.fleet import fleet_read
        from fairqueue.jobs.runtime import engine

        while not self.stop.wait(TRACE_INTERVAL_S):
            try:
                sample: dict[str, Any] = {"t": round(time.time(), 3), "fleet": fleet_read(), "tenants": {}}
                for slug in self.slugs:
                    k = engine().inspect_key(tag=shard_tag(SHARD_NAME), key=tenant_key(slug))
                    sample["tenants"][slug] = {"limit": k.limit, "held": k.held, "parked": k.waiting}
                self.samples.append(sample)
            except Exception as exc:  # a trace gap is not worth failing the run for
                self.samples.append({"t": time.time(), "error": str(exc)})


def _trace_summary(samples: list[dict[str, Any]], slots: int) -> dict[str, Any] | None:
    """While the noisy tenant has parked jobs: its mean limit and holders, the pool's in-flight."""
    rows = [s for s in samples if "tenants" in s and s["tenants"].get(NOISY_SLUG, {}).get("parked", 0) > 0]
    if not rows:
        return None

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 2)

    return {
        "samples_with_noisy_parked": len(rows),
        "noisy_limit_mean": mean([s["tenants"][NOISY_SLUG]["limit"] or 0 for s in rows]),
        "noisy_held_mean": mean([s["tenants"][NOISY_SLUG]["held"] for s in rows]),
        "noisy_parked_max": max(s["tenants"][NOISY_SLUG]["parked"] for s in rows),
        "pool_held_mean": mean([sum(t["held"] for t in s["tenants"].values()) for s in rows]),
        "pool_busy_mean": mean([s["fleet"]["busy"] for s in rows]),
        "slots": slots,
    }


def _fairqueue_records(client_submitted: dict[str, float]) -> list[dict[str, Any]]:
    """Per-job timings from the rows; `client_submitted` (--submit http): job id -> the
    client's clock before its request, which stands for the job's submit time."""
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from fairqueue.jobs.models import Job, JobStatus

    out = []
    for j in Job.objects.values(
        "id",
        "tenant__slug",
        "submitted_at",
        "admitted_at",
        "started_at",
        "finished_at",
        "status",
        "args",
        "result",
        "worker",
    ):
        result = j["result"] or {}
        run_started = datetime.fromisoformat(result["started"]).timestamp() if "started" in result else None
        run_finished = datetime.fromisoformat(result["finished"]).timestamp() if "finished" in result else None
        started = j["started_at"].timestamp() if j["started_at"] else None
        finished = j["finished_at"].timestamp() if j["finished_at"] else None
        out.append(
            {
                "tenant": j["tenant__slug"],
                "seconds": j["args"].get("seconds", 0.0),
                "submitted": client_submitted.get(str(j["id"]), j["submitted_at"].timestamp()),
                "admitted": j["admitted_at"].timestamp() if j["admitted_at"] else None,
                "started": started,
                "finished": finished,
                "run_started": run_started if run_started is not None else started,
                "run_finished": run_finished if run_finished is not None else finished,
                "ok": j["status"] == JobStatus.SUCCEEDED,
                "worker": j["worker"],
            }
        )
    return out


def _fifo_records(rec: _Recorder) -> list[dict[str, Any]]:
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from fairqueue.bench.tasks import RUNS_KEY
    from fairqueue.jobs.runtime import redis_client

    runs: dict[str, str] = redis_client().hgetall(RUNS_KEY)  # type: ignore[assignment]  # decoded client
    out = []
    for job_id, (tenant, submitted, seconds) in rec.fifo_submitted.items():
        started, finished, _worker = runs[job_id].split(",", 2)
        out.append(
            {
                "tenant": tenant,
                "seconds": seconds,
                "submitted": submitted,
                "started": float(started),
                "finished": float(finished),
                "run_started": float(started),
                "run_finished": float(finished),
                "ok": True,
            }
        )
    return out


def _wait_done(mode: str, expected: int, rec: _Recorder, timeout: float) -> None:
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from fairqueue.bench.tasks import RUNS_KEY
    from fairqueue.jobs.models import TERMINAL_STATUSES, Job
    from fairqueue.jobs.runtime import redis_client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mode == "fifo":
            done = redis_client().hlen(RUNS_KEY)
        else:
            done = Job.objects.filter(status__in=TERMINAL_STATUSES).count()
        if done >= expected:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{mode}: only {done} of {expected} jobs finished within {timeout:.0f}s")


def child_main(spec_path: str, out_path: str) -> None:
    # The child configures Django itself; the functions it calls import models (and what
    # imports them) inside, because that is possible only after django.setup() here.
    import django

    django.setup()
    spec = json.loads(Path(spec_path).read_text())
    mode: str = spec["mode"]
    w = Workload(**spec["workload"])
    plan = workload_plan(w)
    if mode == "fair_no_burst":
        plan = [p for p in plan if p.tenant != NOISY_SLUG]
    keys = _policy_setup(mode, w)
    log_dir = stack.BENCH_DIR / "logs" / mode
    env = dict(os.environ)
    rec = _Recorder()
    tracer = None
    use_http = spec.get("submit") == "http" and mode != "fifo"
    with contextlib.ExitStack() as running:
        web = (
            running.enter_context(
                stack.GunicornServer(env=env, log_dir=log_dir, processes=stack.web_processes_default())
            )
            if use_http
            else None
        )
        running.enter_context(
            stack.Workers(count=w.workers, slots=w.slots_per_worker, env=env, log_dir=log_dir, name=f"bench-{mode}-")
        )
        time.sleep(1.5)  # let every worker's heartbeat and first tick land (fleet size known)
        if mode != "fifo":
            tracer = _Tracer([f"{QUIET_PREFIX}{i + 1}" for i in range(w.quiet_tenants)] + [NOISY_SLUG])
            tracer.start()
        _drive(mode, plan, rec, base_url=web.base_url if web else None, keys=keys)
        if rec.errors:
            raise RuntimeError(f"{mode}: submitting failed: {rec.errors[:3]}")
        _wait_done(mode, len(plan), rec, timeout=_timeout(w))
        if tracer:
            tracer.stop.set()
            tracer.join(2)
    records = _fifo_records(rec) if mode == "fifo" else _fairqueue_records(rec.http_submitted)
    samples = tracer.samples if tracer else []
    Path(out_path).write_text(
        json.dumps(
            {"mode": mode, "records": records, "trace": samples, "trace_summary": _trace_summary(samples, w.slots)}
        )
    )


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--child":
        raise SystemExit("usage: python -m fairqueue.bench.noisy --child SPEC.json OUT.json (used by bench noisy)")
    child_main(sys.argv[2], sys.argv[3])
