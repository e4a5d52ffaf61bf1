"""Paired A/B of tracing's cost on the in-process submit path, for a loaded host.

Batches of `job_submit` (and, for reference, a plain Celery `send_task`) alternate between
tracing off and on (the SDK with an in-memory exporter) in one process, so whatever else
the host runs weighs on both alike; prints the median CPU time per job and jobs per second
of each. No worker runs: admitted jobs wait in the broker. Give it a scratch database and
an empty Redis database (docs/observability.md, Overhead):

    DATABASE_URL=sqlite:////tmp/tracing-ab.sqlite3 REDIS_URL=redis://127.0.0.1:6379/12 \\
        .venv/bin/python scripts/tracing_ab.py 8 60
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fairqueue.settings")
os.environ.pop("OTEL_TRACES_EXPORTER", None)  # off unless this script turns it on

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from fairqueue import tracing  # noqa: E402
from fairqueue.celery import app  # noqa: E402
from fairqueue.jobs.submission import JobRequest, job_submit  # noqa: E402
from tenants.models import Shard, Tenant  # noqa: E402
from tenants.sync import policy_sync_all  # noqa: E402


def main(rounds: int, batch: int) -> None:
    call_command("migrate", verbosity=0)
    shard, _ = Shard.objects.get_or_create(name="ab", defaults={"capacity": 100_000})
    tenant = Tenant.objects.filter(slug="ab").first()
    if tenant is None:
        tenant = Tenant(slug="ab", name="ab", shard=shard)
        tenant.rotate_api_key()
        tenant.save()
    policy_sync_all()
    req = JobRequest(task="demo.sleep", args={"seconds": 0.01})
    paths: dict[str, Callable[[], object]] = {
        "job_submit": lambda: job_submit(tenant=tenant, req=req),
        "send_task": lambda: app.send_task("fairqueue.bench.plain_noop", args=["x"], queue="fq.tracing-ab"),
    }
    for fn in paths.values():
        fn()  # warm up
    got: dict[tuple[str, str], list[tuple[float, float]]] = {(p, m): [] for p in paths for m in ("off", "on")}
    for r in range(rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            if mode == "on":
                tracing.tracing_configure(exporter=InMemorySpanExporter())
            else:
                tracing.tracing_shutdown()
            for path, fn in paths.items():
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(batch):
                    fn()
                got[(path, mode)].append(
                    ((time.process_time() - cpu) / batch * 1e6, batch / (time.perf_counter() - wall))
                )
    tracing.tracing_shutdown()
    for path in paths:
        off_cpu, on_cpu = (statistics.median(c for c, _ in got[(path, m)]) for m in ("off", "on"))
        off_rate, on_rate = (statistics.median(w for _, w in got[(path, m)]) for m in ("off", "on"))
        print(
            f"{path}: CPU per job off {off_cpu:.0f} us, on {on_cpu:.0f} us ({on_cpu / off_cpu - 1:+.1%}); "
            f"jobs/s off {off_rate:.1f}, on {on_rate:.1f} (on/off {on_rate / off_rate:.3f}); {rounds} rounds of {batch}"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8, int(sys.argv[2]) if len(sys.argv) > 2 else 60)
