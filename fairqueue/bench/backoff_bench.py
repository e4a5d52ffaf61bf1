"""`manage.py bench backoff`: how close AIMD on a resource key comes to the ideal
throughput of an upstream that takes `max_concurrent` calls at once (docs/resources.md).

One worker with 8 slots runs `jobs` demo.call jobs against a fake upstream on a local port
(fairqueue.bench.upstream) that answers 429 above 3 concurrent calls; the resource is
configured at 8, so the effective limit must find 3 by itself. The figure is the ratio
of the ideal time (every call back to back, 3 at a time) to the measured one, with the
refusals after the warm-up. A second run with the resource configured at exactly 3 (the
limit known, nothing to learn) separates what AIMD costs from what each job costs the
scheduler on this machine: `aimd_vs_known` is the ratio of the two runs' times. The runs
happen in a child process on the bench's own stack: a fresh SQLite file (or a PostgreSQL
database) and a dedicated Redis database.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from fairqueue.bench import stack

Log = Callable[[str], None]
DATABASE_NAME = "fairqueue_bench_backoff"
WORKER_SLOTS = 8
QUICK_JOBS = 40


def add_arguments(parser: Any) -> None:
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_JOBS} jobs (smoke test): shape, not figures")
    parser.add_argument("--jobs", type=int, default=None, help="jobs in the run (default 200)")
    parser.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
    parser.add_argument("--database-url", default=None, help="a PostgreSQL server URL; without it a SQLite file")
    stack.add_redis_arguments(parser)


def run_command(options: dict[str, Any], *, log: Log) -> dict[str, Any]:
    jobs = options.get("jobs") or (QUICK_JOBS if options["quick"] else 200)
    if not 1 <= jobs <= 100_000:
        raise RuntimeError(f"--jobs must be 1-100000, not {jobs}")
    stack.redis_db_prepare(options["redis_url"], force=options["force"])
    db_path = stack.BENCH_DIR / "backoff.sqlite3"
    database_url = options.get("database_url")
    if database_url:
        url = stack.fresh_postgres(database_url, DATABASE_NAME)
        env = stack.stack_env(redis_url=options["redis_url"], db_path=db_path, database_url=url)
        stack.migrate(env)
    else:
        env = stack.stack_env(redis_url=options["redis_url"], db_path=db_path)
        stack.fresh_database(db_path, env)
    log(f"bench backoff: {jobs} jobs, 1 worker x {WORKER_SLOTS} slots, upstream taking 3 calls at once")
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"jobs": jobs}))
        try:
            stack.run_child("fairqueue.bench.backoff_bench", ["--child", str(spec), str(out)], env=env, timeout=1800)
            result: dict[str, Any] = json.loads(out.read_text())
        finally:
            stack.redis_db_flush(options["redis_url"])
    log("")
    for key, value in result.items():
        log(f"{key:<32} {value}")
    return result


def child_main(spec_path: str, out_path: str) -> None:
    # The child configures Django itself: the run's module imports models, which exist
    # only after django.setup().
    import django

    django.setup()
    from fairqueue.bench.backoff_run import Workload, backoff_run, policy_setup
    from fairqueue.jobs.recovery import state_ensure

    spec = json.loads(Path(spec_path).read_text())
    workload = replace(Workload(), jobs=int(spec["jobs"]))
    tenant = policy_setup(workload)
    state_ensure()
    log_dir = stack.BENCH_DIR / "logs" / "backoff"
    known = replace(workload, configured_limit=workload.max_concurrent)
    with stack.Workers(count=1, slots=WORKER_SLOTS, env=dict(os.environ), log_dir=log_dir, name="bench-backoff-"):
        result = backoff_run(workload, tenant)
        policy_setup(known)
        baseline = backoff_run(known, tenant)
    result["known_limit_elapsed_s"] = baseline["elapsed_s"]
    result["known_limit_throughput_ratio"] = baseline["throughput_ratio"]
    result["known_limit_refusals"] = baseline["refusals"]
    result["aimd_vs_known"] = round(baseline["elapsed_s"] / result["elapsed_s"], 3)
    result["workload"] = asdict(workload)
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--child":
        raise SystemExit("usage: python -m fairqueue.bench.backoff_bench --child SPEC.json OUT.json (bench backoff)")
    child_main(sys.argv[2], sys.argv[3])
