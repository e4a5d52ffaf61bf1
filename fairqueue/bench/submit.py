"""`manage.py bench submit`: jobs accepted per second on the submit path.

In one run, on a fresh stack (new SQLite file, the bench's own flushed Redis database,
daphne serving the real ASGI app), the same number of jobs goes through:

- ``http_single``: one `POST /api/v1/jobs` per job, sequentially over one keep-alive
  connection (authentication, JSON parsing, validation, the row, admission, dispatch);
- ``http_bulk``: `POST /api/v1/jobs/bulk` in batches of ``--batch`` jobs;
- ``service_single`` / ``service_bulk``: `job_submit` / `job_submit_bulk` called in
  process (the same path minus HTTP), for reference;
- ``send_task``: plain `celery_app.send_task(...)` calls, the floor any Celery-based
  system pays per job.

No worker runs, so admitted jobs wait in the broker and the rest are parked: the cost
measured is accepting a job, not running it. Each path uses its own tenant so that
parked queues do not grow across paths.

Tracing's cost is measured in the same run: each repetition is a pair of runs, one with
tracing off and one with it on (`OTEL_TRACES_EXPORTER=in_memory` in the bench's process
and its web server: spans are made and kept, not shipped), in alternating order so that
the host's drift weighs on both alike. The figures per path (`paths`) are the median of
the tracing-off runs; `tracing` holds each run, the medians and `on / off` ratios, both
of the medians and per pair (the pair's two runs are minutes apart, not hours).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from fairqueue.bench import stack

SIZES = {"default": 2000, "quick": 500, "smoke": 40}
PATHS = ("http_single", "http_bulk", "service_single", "service_bulk", "send_task")
DEFAULT_PAIRS = 2  # tracing off/on pairs; --smoke runs one
TRACING_EXPORTER = "in_memory"  # spans made and kept in the process: the cost of making them

Log = Any


def add_arguments(parser: Any) -> None:
    parser.add_argument("--jobs", type=int, default=None, help="jobs per path (default 2000; --quick 500)")
    parser.add_argument("--batch", type=int, default=500, help="jobs per bulk request (max 1000)")
    parser.add_argument("--quick", action="store_true", help="fewer jobs")
    parser.add_argument("--smoke", action="store_true", help="a tiny run for tests: shape, not figures")
    parser.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
    parser.add_argument(
        "--pairs",
        type=int,
        default=None,
        help=f"tracing off/on pairs of runs, alternating (default {DEFAULT_PAIRS}; --smoke 1)",
    )
    parser.add_argument("--no-tracing", action="store_true", help="one run, tracing off: no on/off comparison")
    stack.add_redis_arguments(parser)


def run_command(options: dict[str, Any], *, log: Log) -> dict[str, Any]:
    size = "smoke" if options["smoke"] else "quick" if options["quick"] else "default"
    jobs = options["jobs"] or SIZES[size]
    batch = min(max(options["batch"], 1), 1000)
    pairs = max(options["pairs"] or (1 if options["smoke"] else DEFAULT_PAIRS), 1)
    return run(
        redis_url=options["redis_url"],
        jobs=jobs,
        batch=batch,
        pairs=pairs,
        tracing=not options["no_tracing"],
        force=options["force"],
        log=log,
    )


def run(
    *,
    redis_url: str,
    jobs: int,
    batch: int,
    pairs: int = DEFAULT_PAIRS,
    tracing: bool = True,
    force: bool = False,
    log: Log = print,
) -> dict[str, Any]:
    stack.redis_db_prepare(redis_url, force=force)
    db_path = stack.BENCH_DIR / "submit.sqlite3"
    order = [mode for i in range(pairs) for mode in (("off", "on") if i % 2 == 0 else ("on", "off"))]
    modes = order if tracing else ["off"]
    log(f"bench submit: {jobs} jobs per path, bulk batches of {batch}; runs (tracing): {', '.join(modes)}")
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"off": [], "on": []}
    for n, mode in enumerate(modes, start=1):
        paths = _run_once(redis_url=redis_url, db_path=db_path, jobs=jobs, batch=batch, tracing=mode == "on")
        runs[mode].append(paths)
        log(
            f"run {n}/{len(modes)} tracing {mode}: " + ", ".join(f"{p} {v['jobs_per_s']:.1f}" for p, v in paths.items())
        )
    doc: dict[str, Any] = {"jobs": jobs, "batch": batch, "paths": _median_run(runs["off"])}
    send = doc["paths"]["send_task"]["jobs_per_s"]
    doc["ratios_vs_send_task"] = {
        p: round(v["jobs_per_s"] / send, 3) for p, v in doc["paths"].items() if p != "send_task" and send
    }
    log(f"{'path':<16} {'seconds':>9} {'jobs/s':>10} {'vs send_task':>13}")
    for p, v in doc["paths"].items():
        ratio = doc["ratios_vs_send_task"].get(p, 1.0)
        log(f"{p:<16} {v['seconds']:>9.3f} {v['jobs_per_s']:>10.1f} {ratio:>12.3f}x")
    if tracing:
        doc["tracing"] = tracing_figures(runs)
        _log_tracing(doc["tracing"], log)
    return doc


def _run_once(*, redis_url: str, db_path: Path, jobs: int, batch: int, tracing: bool) -> dict[str, dict[str, float]]:
    """One child on a fresh database and an empty Redis database: each path's figures."""
    exporter = TRACING_EXPORTER if tracing else "none"
    env = stack.stack_env(redis_url=redis_url, db_path=db_path, OTEL_TRACES_EXPORTER=exporter)
    try:
        stack.fresh_database(db_path, env)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            stack.run_child(
                "fairqueue.bench.submit", ["--child", str(jobs), str(batch), str(out)], env=env, timeout=900
            )
            doc: dict[str, Any] = json.loads(out.read_text())
    finally:
        stack.redis_db_flush(redis_url)
    if doc["tracing"] != tracing:
        raise stack.StackError(f"the bench's child ran with tracing {'on' if doc['tracing'] else 'off'}, not as asked")
    paths: dict[str, dict[str, float]] = doc["paths"]
    return paths


def _median_run(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per path, the run with the median throughput (the lower middle of an even count)."""
    out = {}
    for path in runs[0]:
        ranked = sorted((r[path] for r in runs), key=lambda v: v["jobs_per_s"])
        out[path] = ranked[(len(ranked) - 1) // 2]
    return out


def tracing_figures(runs: dict[str, list[dict[str, dict[str, float]]]]) -> dict[str, Any]:
    """Jobs/s per path and run with tracing off and on, their medians and `on / off`
    ratios: of the medians, and of each pair's runs (run i off against run i on)."""
    per_run = {mode: {p: [r[p]["jobs_per_s"] for r in rs] for p in PATHS} for mode, rs in runs.items()}
    median = {mode: {p: statistics.median(v) for p, v in paths.items()} for mode, paths in per_run.items()}
    pair_ratios = {
        p: [round(on / off, 3) for off, on in zip(per_run["off"][p], per_run["on"][p], strict=True) if off]
        for p in PATHS
    }
    return {
        "exporter": TRACING_EXPORTER,
        "pairs": len(runs["on"]),
        "jobs_per_s": per_run,
        "median_jobs_per_s": median,
        "ratio_on_vs_off": {p: round(median["on"][p] / median["off"][p], 3) for p in PATHS if median["off"][p]},
        "pair_ratios": pair_ratios,
        "median_pair_ratio": {p: round(statistics.median(r), 3) for p, r in pair_ratios.items() if r},
    }


def _log_tracing(figures: dict[str, Any], log: Log) -> None:
    log(f"tracing on ({figures['exporter']} exporter) vs off, {figures['pairs']} pair(s), median jobs/s:")
    log(f"{'path':<16} {'off':>10} {'on':>10} {'on/off':>8} per pair")
    for p in PATHS:
        off, on = figures["median_jobs_per_s"]["off"][p], figures["median_jobs_per_s"]["on"][p]
        pairs = " ".join(f"{r:.3f}" for r in figures["pair_ratios"][p])
        log(f"{p:<16} {off:>10.1f} {on:>10.1f} {figures['ratio_on_vs_off'].get(p, 0.0):>8.3f} {pairs}")


# --- the child process (Django configured for the bench's stack) ----------------------------------


def _timed(jobs: int, fn: Any) -> dict[str, float]:
    started = time.perf_counter()
    fn()
    seconds = time.perf_counter() - started
    return {"jobs": jobs, "seconds": round(seconds, 4), "jobs_per_s": round(jobs / seconds, 1)}


def child_main(jobs: int, batch: int, out_path: str) -> None:
    # The child configures Django itself: models and the app can be imported only after
    # django.setup(), so this process's imports live here rather than at the top.
    import django

    django.setup()
    import requests
    from django.db import connections

    from fairqueue import tracing
    from fairqueue.bench.tasks import PLAIN_TASK_NAME
    from fairqueue.celery import app
    from fairqueue.jobs.submission import JobRequest, job_submit, job_submit_bulk
    from tenants.models import Shard, Tenant
    from tenants.sync import policy_sync_all

    shard = Shard.objects.create(name="bench", capacity=10_000)
    tenants: dict[str, Tenant] = {}
    keys: dict[str, str] = {}
    for path in PATHS:
        tenant = Tenant(slug=path.replace("_", "-"), name=path, shard=shard)
        keys[path] = tenant.rotate_api_key()
        tenant.save()
        tenants[path] = tenant
    policy_sync_all()
    connections.close_all()  # daphne gets the SQLite file to itself while HTTP runs
    body: dict[str, Any] = {"task": "demo.sleep", "args": {"seconds": 0.01}}
    results: dict[str, dict[str, float]] = {}
    with stack.WebServer(env=_env(), log_dir=stack.BENCH_DIR / "logs" / "submit") as web:
        session = requests.Session()

        def post(path: str, url: str, payload: Any) -> None:
            r = session.post(
                web.base_url + url, json=payload, headers={"Authorization": f"Bearer {keys[path]}"}, timeout=60
            )
            if r.status_code != 202:
                raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")

        post("http_single", "/api/v1/jobs", body)  # warm up: imports, connection, first policy read
        post("http_bulk", "/api/v1/jobs/bulk", {"jobs": [body]})

        def http_single() -> None:
            for _ in range(jobs):
                post("http_single", "/api/v1/jobs", body)

        def http_bulk() -> None:
            for i in range(0, jobs, batch):
                post("http_bulk", "/api/v1/jobs/bulk", {"jobs": [body] * min(batch, jobs - i)})

        results["http_single"] = _timed(jobs, http_single)
        results["http_bulk"] = _timed(jobs, http_bulk)
    req = JobRequest(task=body["task"], args=body["args"])
    job_submit(tenant=tenants["service_single"], req=req)  # warm up
    results["service_single"] = _timed(
        jobs, lambda: [job_submit(tenant=tenants["service_single"], req=req) for _ in range(jobs)]
    )
    results["service_bulk"] = _timed(
        jobs,
        lambda: [
            job_submit_bulk(tenant=tenants["service_bulk"], reqs=[req] * min(batch, jobs - i))
            for i in range(0, jobs, batch)
        ],
    )
    app.send_task(PLAIN_TASK_NAME, args=["warm-up", 0.0], queue="fq.bench-submit")
    results["send_task"] = _timed(
        jobs,
        lambda: [
            app.send_task(PLAIN_TASK_NAME, args=[uuid.uuid4().hex, 0.01], queue="fq.bench-submit") for _ in range(jobs)
        ],
    )
    doc = {"jobs": jobs, "batch": batch, "tracing": tracing.tracing_enabled(), "paths": results}
    Path(out_path).write_text(json.dumps(doc))


def _env() -> dict[str, str]:
    return dict(os.environ)


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "--child":
        raise SystemExit("usage: python -m fairqueue.bench.submit --child JOBS BATCH OUT.json (used by bench submit)")
    child_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
