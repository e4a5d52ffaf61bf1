"""`manage.py bench submit`: jobs accepted per second on the submit path, with tracing
off and on.

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
measured is accepting a job, not running it. Each path (and tracing mode) uses its own
tenant so that parked queues do not grow across paths.

Tracing's cost is measured in the same run, paired: each path's jobs go in ``--rounds``
rounds, and each round runs a share with tracing off and the same share with tracing on,
in alternating order, so that the host's drift over the run weighs on both alike. Two
web servers serve the HTTP paths, one with tracing off and one with it on; the in-process
paths turn tracing on and off in the bench's own process between shares. "On" is
`OTEL_TRACES_EXPORTER=in_memory`: spans are made and kept in the process, not shipped,
so the figure is the cost of making them. `paths` holds the tracing-off figures;
`tracing` holds both modes, the `on / off` ratio of the totals and of each round, and the
median of those.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fairqueue.bench import stack

SIZES = {"default": 2000, "quick": 1000, "smoke": 40}
PATHS = ("http_single", "http_bulk", "service_single", "service_bulk", "send_task")
MODES = ("off", "on")
DEFAULT_ROUNDS = 4  # tracing off/on pairs per path; --smoke runs two
# A bulk job costs a fraction of a single one: the bulk paths take this many times the
# jobs, so that their rounds last long enough to rise above the host's noise.
BULK_JOBS_FACTOR = 5
BULK_PATHS = ("http_bulk", "service_bulk")
SMOKE_ROUNDS = 2
WARM_UP_BULK = 50  # a first bulk of some size, so the timed ones find every code path loaded
TRACING_EXPORTER = "in_memory"  # spans made and kept in the process: the cost of making them

Log = Any


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"jobs per path and tracing mode (default 2000; --quick 1000; the bulk paths x{BULK_JOBS_FACTOR})",
    )
    parser.add_argument("--batch", type=int, default=500, help="jobs per bulk request (max 1000)")
    parser.add_argument(
        "--rounds", type=int, default=None, help=f"tracing off/on pairs per path (default {DEFAULT_ROUNDS})"
    )
    parser.add_argument("--quick", action="store_true", help="fewer jobs")
    parser.add_argument("--smoke", action="store_true", help="a tiny run for tests: shape, not figures")
    parser.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
    stack.add_redis_arguments(parser)


def run_command(options: dict[str, Any], *, log: Log) -> dict[str, Any]:
    size = "smoke" if options["smoke"] else "quick" if options["quick"] else "default"
    jobs = options["jobs"] or SIZES[size]
    batch = min(max(options["batch"], 1), 1000)
    rounds = max(options["rounds"] or (SMOKE_ROUNDS if options["smoke"] else DEFAULT_ROUNDS), 1)
    return run(redis_url=options["redis_url"], jobs=jobs, batch=batch, rounds=rounds, force=options["force"], log=log)


def run(
    *, redis_url: str, jobs: int, batch: int, rounds: int = DEFAULT_ROUNDS, force: bool = False, log: Log = print
) -> dict[str, Any]:
    stack.redis_db_prepare(redis_url, force=force)
    db_path = stack.BENCH_DIR / "submit.sqlite3"
    env = stack.stack_env(redis_url=redis_url, db_path=db_path, OTEL_TRACES_EXPORTER="none")
    jobs = max(jobs, rounds)
    log(
        f"bench submit: {jobs} jobs per path and tracing mode ({jobs * BULK_JOBS_FACTOR} for the bulk paths, "
        f"in batches of {batch}), in {rounds} off/on rounds"
    )
    try:
        stack.fresh_database(db_path, env)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            args = ["--child", str(jobs), str(batch), str(rounds), str(out)]
            stack.run_child("fairqueue.bench.submit", args, env=env, timeout=1800)
            child: dict[str, Any] = json.loads(out.read_text())
    finally:
        stack.redis_db_flush(redis_url)
    doc: dict[str, Any] = {"jobs": jobs, "batch": batch, "rounds": rounds, "paths": child["paths"]["off"]}
    send = doc["paths"]["send_task"]["jobs_per_s"]
    doc["ratios_vs_send_task"] = {
        p: round(v["jobs_per_s"] / send, 3) for p, v in doc["paths"].items() if p != "send_task" and send
    }
    doc["tracing"] = tracing_figures(child["paths"], child["rounds"])
    log(f"{'path':<16} {'seconds':>9} {'jobs/s':>10} {'vs send_task':>13}   (tracing off)")
    for p, v in doc["paths"].items():
        ratio = doc["ratios_vs_send_task"].get(p, 1.0)
        log(f"{p:<16} {v['seconds']:>9.3f} {v['jobs_per_s']:>10.1f} {ratio:>12.3f}x")
    _log_tracing(doc["tracing"], log)
    return doc


def tracing_figures(paths: dict[str, dict[str, dict[str, float]]], rounds: dict[str, list[float]]) -> dict[str, Any]:
    """`on / off` per path: of the jobs/s over all rounds, and of each round's pair."""
    return {
        "exporter": TRACING_EXPORTER,
        "jobs_per_s": {mode: {p: v["jobs_per_s"] for p, v in paths[mode].items()} for mode in MODES},
        "ratio_on_vs_off": {
            p: round(paths["on"][p]["jobs_per_s"] / paths["off"][p]["jobs_per_s"], 3)
            for p in PATHS
            if paths["off"][p]["jobs_per_s"]
        },
        "round_ratios": rounds,
        "median_round_ratio": {p: round(statistics.median(r), 3) for p, r in rounds.items() if r},
    }


def _log_tracing(figures: dict[str, Any], log: Log) -> None:
    log(f"tracing on ({figures['exporter']} exporter) vs off, paired rounds, jobs/s:")
    log(f"{'path':<16} {'off':>10} {'on':>10} {'on/off':>8} {'median':>8}  rounds")
    for p in PATHS:
        off, on = figures["jobs_per_s"]["off"][p], figures["jobs_per_s"]["on"][p]
        each = " ".join(f"{r:.3f}" for r in figures["round_ratios"][p])
        ratio, median = figures["ratio_on_vs_off"].get(p, 0.0), figures["median_round_ratio"].get(p, 0.0)
        log(f"{p:<16} {off:>10.1f} {on:>10.1f} {ratio:>8.3f} {median:>8.3f}  {each}")


# --- the child process (Django configured for the bench's stack) ----------------------------------


def _shares(jobs: int, rounds: int) -> list[int]:
    """`jobs` split into `rounds` shares as equal as can be."""
    return [jobs // rounds + (1 if i < jobs % rounds else 0) for i in range(rounds)]


def _paired(
    jobs: int, rounds: int, work: Callable[[str, int], None], switch: Callable[[str], None]
) -> tuple[dict[str, dict[str, float]], list[float]]:
    """Run `work(mode, n)` for each round's share in both modes, alternating which goes
    first; `switch(mode)` (untimed) gets the process ready for a mode. Returns per mode
    the totals, and each round's `on / off` jobs/s ratio."""
    seconds = dict.fromkeys(MODES, 0.0)
    ratios = []
    for i, share in enumerate(_shares(jobs, rounds)):
        took = {}
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            switch(mode)
            started = time.perf_counter()
            work(mode, share)
            took[mode] = time.perf_counter() - started
            seconds[mode] += took[mode]
        ratios.append(round(took["off"] / took["on"], 3))  # the same share: a throughput ratio
    totals = {m: {"jobs": jobs, "seconds": round(s, 4), "jobs_per_s": round(jobs / s, 1)} for m, s in seconds.items()}
    return totals, ratios


def child_main(jobs: int, batch: int, rounds: int, out_path: str) -> None:
    # The child configures Django itself: models and the app can be imported only after
    # django.setup(), so this process's imports live here rather than at the top.
    import django

    django.setup()
    import requests
    from django.db import connections
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from fairqueue import tracing
    from fairqueue.bench.tasks import PLAIN_TASK_NAME
    from fairqueue.celery import app
    from fairqueue.jobs.submission import JobRequest, job_submit, job_submit_bulk
    from tenants.models import Shard, Tenant
    from tenants.sync import policy_sync_all

    if tracing.tracing_enabled():
        raise SystemExit("the bench's child starts with tracing off (it turns it on for its 'on' shares)")
    shard = Shard.objects.create(name="bench", capacity=10_000)
    tenants: dict[tuple[str, str], Tenant] = {}
    keys: dict[tuple[str, str], str] = {}
    for path in PATHS:
        for mode in MODES:
            tenant = Tenant(slug=f"{path.replace('_', '-')}-{mode}", name=f"{path} {mode}", shard=shard)
            keys[(path, mode)] = tenant.rotate_api_key()
            tenant.save()
            tenants[(path, mode)] = tenant
    policy_sync_all()
    connections.close_all()  # the web servers get the SQLite file to themselves while HTTP runs
    body: dict[str, Any] = {"task": "demo.sleep", "args": {"seconds": 0.01}}
    totals: dict[str, dict[str, dict[str, float]]] = {mode: {} for mode in MODES}
    ratios: dict[str, list[float]] = {}

    def record(path: str, result: tuple[dict[str, dict[str, float]], list[float]]) -> None:
        for mode in MODES:
            totals[mode][path] = result[0][mode]
        ratios[path] = result[1]

    log_dir = stack.BENCH_DIR / "logs" / "submit"
    env_of = {"off": _env(OTEL_TRACES_EXPORTER="none"), "on": _env(OTEL_TRACES_EXPORTER=TRACING_EXPORTER)}
    with (
        stack.WebServer(env=env_of["off"], log_dir=log_dir) as web_off,
        stack.WebServer(env=env_of["on"], log_dir=log_dir) as web_on,
    ):
        base_url = {"off": web_off.base_url, "on": web_on.base_url}
        sessions = {mode: requests.Session() for mode in MODES}

        def post(path: str, mode: str, url: str, payload: Any) -> None:
            r = sessions[mode].post(
                base_url[mode] + url,
                json=payload,
                headers={"Authorization": f"Bearer {keys[(path, mode)]}"},
                timeout=60,
            )
            if r.status_code != 202:
                raise RuntimeError(f"{url} (tracing {mode}): HTTP {r.status_code}: {r.text[:300]}")

        for mode in MODES:  # warm up: imports, connection, first policy read
            post("http_single", mode, "/api/v1/jobs", body)
            post("http_bulk", mode, "/api/v1/jobs/bulk", {"jobs": [body] * min(batch, WARM_UP_BULK)})

        def http_single(mode: str, n: int) -> None:
            for _ in range(n):
                post("http_single", mode, "/api/v1/jobs", body)

        def http_bulk(mode: str, n: int) -> None:
            for i in range(0, n, batch):
                post("http_bulk", mode, "/api/v1/jobs/bulk", {"jobs": [body] * min(batch, n - i)})

        def stays(mode: str) -> None:
            pass  # each mode has its own server

        record("http_single", _paired(jobs, rounds, http_single, stays))
        record("http_bulk", _paired(jobs * BULK_JOBS_FACTOR, rounds, http_bulk, stays))

    def tracing_mode(mode: str) -> None:
        """This process's tracing, for the in-process paths (tests turn it on and off the same way)."""
        if mode == "on" and not tracing.tracing_enabled():
            tracing.tracing_configure(exporter=InMemorySpanExporter())
        elif mode == "off" and tracing.tracing_enabled():
            tracing.tracing_shutdown()

    req = JobRequest(task=body["task"], args=body["args"])

    def service_single(mode: str, n: int) -> None:
        for _ in range(n):
            job_submit(tenant=tenants[("service_single", mode)], req=req)

    def service_bulk(mode: str, n: int) -> None:
        for i in range(0, n, batch):
            job_submit_bulk(tenant=tenants[("service_bulk", mode)], reqs=[req] * min(batch, n - i))

    def send_task(mode: str, n: int) -> None:
        for _ in range(n):
            app.send_task(PLAIN_TASK_NAME, args=[uuid.uuid4().hex, 0.01], queue="fq.bench-submit")

    for mode in MODES:  # warm up, in both modes
        tracing_mode(mode)
        job_submit(tenant=tenants[("service_single", mode)], req=req)
        app.send_task(PLAIN_TASK_NAME, args=["warm-up", 0.0], queue="fq.bench-submit")
    record("service_single", _paired(jobs, rounds, service_single, tracing_mode))
    record("service_bulk", _paired(jobs * BULK_JOBS_FACTOR, rounds, service_bulk, tracing_mode))
    record("send_task", _paired(jobs, rounds, send_task, tracing_mode))
    tracing_mode("off")
    doc = {"jobs": jobs, "batch": batch, "paths": totals, "rounds": ratios}
    Path(out_path).write_text(json.dumps(doc))


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "--child":
        raise SystemExit(
            "usage: python -m fairqueue.bench.submit --child JOBS BATCH ROUNDS OUT.json (used by bench submit)"
        )
    child_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
