"""The plain-Celery baseline task for `bench noisy --mode fifo`: no FairQueue at all.

It sleeps and records its own start and finish (unix seconds) and worker in one Redis
hash, so the benchmark can compute queue waits without touching the database.
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
