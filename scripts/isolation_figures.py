"""Figures of the isolated pool (docs/tasks.md): a child's start, an empty task's round
trip, and how long a 1 s timeout takes on a task that ignores its deadline.

Run: python manage.py shell -c "exec(open('scripts/isolation_figures.py').read())"
"""

import statistics
import time

from fairqueue.jobs.isolation import IsolatedPool
from fairqueue.jobs.registry import JobContext
from fairqueue.jobs.task_limits import TaskTimeout

ROUNDS = 3
TRIPS = 50


def _ctx(timeout: float | None = None) -> JobContext:
    return JobContext(job_id="figures", attempt=1, worker="figures", generation=1, timeout_seconds=timeout)


pool = IsolatedPool(1)
starts, trips, overshoot = [], [], []
for _ in range(ROUNDS):
    began = time.monotonic()
    pool.run(task="demo.noop", raw_args={}, ctx=_ctx(), memory_limit_mb=None)
    starts.append(time.monotonic() - began)
    for _ in range(TRIPS):
        began = time.monotonic()
        pool.run(task="demo.noop", raw_args={}, ctx=_ctx(), memory_limit_mb=None)
        trips.append(time.monotonic() - began)
    began = time.monotonic()
    try:  # one page every 10 s: only the kill ends it
        pool.run(task="demo.parse", raw_args={"pages": 2, "io_ms_per_page": 10000}, ctx=_ctx(1.0), memory_limit_mb=None)
    except TaskTimeout:
        overshoot.append(time.monotonic() - began)
    pool.stop()
print(f"child start (spawn, django.setup, first task): {[round(s, 2) for s in starts]} s")
print(
    f"empty isolated task round trip: median {statistics.median(trips) * 1000:.1f} ms, max {max(trips) * 1000:.1f} ms"
)
print(f"1 s timeout on a task that ignores it ended after: {[round(s, 2) for s in overshoot]} s")
