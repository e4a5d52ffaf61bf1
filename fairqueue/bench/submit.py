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
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from fairqueue.bench import stack

SIZES = {"default": 2000, "quick": 500, "smoke": 40}
PATHS = ("http_single", "http_bulk", "service_single", "service_bulk", "send_task")

Log = Any


def add_arguments(parser: Any) -> None:
    parser.add_argument("--jobs", type=int, default=None, help="jobs per path (default 2000; --quick 500)")
    parser.add_argument("--batch", type=int, default=500, help="jobs per bulk request (max 1000)")
    parser.add_argument("--quick", action="store_true", help="fewer jobs")
    parser.add_argument("--smoke", action="store_true", help="a tiny run for tests: shape, not figures")
    parser.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
    stack.add_redis_arguments(parser)


def run_command(options: dict[str, Any], *, log: Log) -> dict[str, Any]:
    size = "smoke" if options["smoke"] else "quick" if options["quick"] else "default"
    jobs = options["jobs"] or SIZES[size]
    batch = min(max(options["batch"], 1), 1000)
    return run(redis_url=options["redis_url"], jobs=jobs, batch=batch, force=options["force"], log=log)


def run(*, redis_url: str, jobs: int, batch: int, force: bool = False, log: Log = print) -> dict[str, Any]:
    stack.redis_db_prepare(redis_url, force=force)
    db_path = stack.BENCH_DIR / "submit.sqlite3"
    env = stack.stack_env(redis_url=redis_url, db_path=db_path)
    log(f"bench submit: {jobs} jobs per path, bulk batches of {batch}")
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
    send = doc["paths"]["send_task"]["jobs_per_s"]
    doc["ratios_vs_send_task"] = {
        p: round(v["jobs_per_s"] / send, 3) for p, v in doc["paths"].items() if p != "send_task" and send
    }
    log(f"{'path':<16} {'seconds':>9} {'jobs/s':>10} {'vs send_task':>13}")
    for p, v in doc["paths"].items():
        ratio = doc["ratios_vs_send_task"].get(p, 1.0)
        log(f"{p:<16} {v['seconds']:>9.3f} {v['jobs_per_s']:>10.1f} {ratio:>12.3f}x")
    return doc


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
    Path(out_path).write_text(json.dumps({"jobs": jobs, "batch": batch, "paths": results}))


def _env() -> dict[str, str]:
    return dict(os.environ)


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "--child":
        raise SystemExit("usage: python -m fairqueue.bench.submit --child JOBS BATCH OUT.json (used by bench submit)")
    child_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
