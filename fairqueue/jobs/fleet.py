"""The fleet registry in Redis: which workers are alive, how many slots each offers and uses.

Each worker writes its own entry every HEARTBEAT_SECONDS (`worker_heartbeat`); anyone
reads the fleet's totals in one round trip (`fleet_read`). A worker that stops
heartbeating drops out of the totals after WORKER_TTL_SECONDS.
"""

from __future__ import annotations

import time

from fairqueue.jobs.runtime import redis_client

WORKERS_KEY = "fq:workers:slots"  # HASH hostname -> slots
SEEN_KEY = "fq:workers:seen"  # ZSET hostname -> last heartbeat (unix s)
BUSY_KEY = "fq:workers:busy"  # HASH hostname -> running jobs
BUSY_BATCH_KEY = "fq:workers:busy_batch"  # HASH hostname -> running batch-lane jobs
HEARTBEAT_SECONDS = 1.0
WORKER_TTL_SECONDS = 6.0
FORGET_AFTER_SECONDS = 10 * WORKER_TTL_SECONDS  # a silent worker's entry is then dropped


def fleet_read() -> dict[str, int]:
    """Live slots and busy slots of the fleet: one pipelined round trip."""
    client = redis_client()
    now = time.time()
    pipe = client.pipeline(transaction=False)
    pipe.zrangebyscore(SEEN_KEY, now - WORKER_TTL_SECONDS, "+inf")
    pipe.hgetall(WORKERS_KEY)
    pipe.hgetall(BUSY_KEY)
    pipe.hgetall(BUSY_BATCH_KEY)
    live, slots, busy, busy_batch = pipe.execute()
    return {
        "workers": len(live),
        "slots": sum(int(slots.get(h, 0)) for h in live),
        "busy": sum(int(busy.get(h, 0)) for h in live),
        "busy_batch": sum(int(busy_batch.get(h, 0)) for h in live),
    }


def worker_heartbeat(*, hostname: str, slots: int, running: int, running_batch: int) -> None:
    """Publish one worker's entry and forget workers silent for FORGET_AFTER_SECONDS."""
    client = redis_client()
    now = time.time()
    stale = client.zrangebyscore(SEEN_KEY, "-inf", now - FORGET_AFTER_SECONDS)
    pipe = client.pipeline(transaction=False)
    pipe.hset(WORKERS_KEY, hostname, slots)
    pipe.hset(BUSY_KEY, hostname, running)
    pipe.hset(BUSY_BATCH_KEY, hostname, running_batch)
    pipe.zadd(SEEN_KEY, {hostname: now})
    if stale:
        for key in (WORKERS_KEY, BUSY_KEY, BUSY_BATCH_KEY):
            pipe.hdel(key, *stale)
        pipe.zrem(SEEN_KEY, *stale)
    pipe.execute()


def worker_deregister(hostname: str) -> None:
    """Remove a worker's entry at once (a clean shutdown)."""
    pipe = redis_client().pipeline(transaction=False)
    for key in (WORKERS_KEY, BUSY_KEY, BUSY_BATCH_KEY):
        pipe.hdel(key, hostname)
    pipe.zrem(SEEN_KEY, hostname)
    pipe.execute()
