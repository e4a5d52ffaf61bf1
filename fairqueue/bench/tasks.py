"""Plain-Celery baseline tasks (no FairQueue at all): a sleep for `bench noisy --mode fifo`,
a no-op for `bench throughput`.

The sleep records its own start and finish (unix seconds) and worker in one Redis hash, so
the benchmark can compute queue waits without touching the database.
"""

from __future__ import annotations

import time

from celery import shared_task

from fairqueue.jobs.runtime import redis_client

RUNS_KEY = "fqbench:runs"  # HASH job id -> "started,finished,worker"
PLAIN_TASK_NAME = "fairqueue.bench.plain_sleep"


@shared_task(name=PLAIN_TASK_NAME, bind=True, acks_late=True, ignore_result=True)
def plain_sleep(self, job_id: str, seconds: float) -> None:  # type: ignore[no-untyped-def]
    started = time.time()
    time.sleep(seconds)
    finished = time.time()
    redis_client().hset(RUNS_KEY, job_id, f"{started:.6f},{finished:.6f},{self.request.hostname or ''}")


PLAIN_NOOP_TASK_NAME = "fairqueue.bench.plain_noop"


@shared_task(name=PLAIN_NOOP_TASK_NAME, acks_late=True, ignore_result=True)
def plain_noop() -> None:
    """The plain-Celery baseline of `bench throughput`: a task that does nothing at all."""
