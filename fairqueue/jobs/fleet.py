"""The fleet registry in Redis: which workers are alive, how many slots each offers and uses.

Each worker writes its own entry every HEARTBEAT_SECONDS (`worker_heartbeat`); anyone
reads the fleet's totals in one round trip (`fleet_read`). A worker that stops
heartbeating drops out of the totals after WORKER_TTL_SECONDS.
"""

from __future__ import annotations

import time
from typing import Any

from fairqueue.jobs.runtime import redis_client

WORKERS_KEY = "fq:workers:slots"  # HASH hostname -> slots
SEEN_KEY = "fq:workers:seen"  # ZSET hostname -> last heartbeat (unix s)
BUSY_KEY = "fq:workers:busy"  # HASH hostname -> running jobs
BUSY_BATCH_KEY = "fq:workers:busy_batch"  # HASH hostname -> running batch-lane jobs
# Backpressure (fairqueue.jobs.backpressure): WORKERS_KEY holds the slots a worker *offers*;
# these hold the slots it was started with and why it offers fewer (empty when it does not).
CAPACITY_KEY = "fq:workers:capacity"  # HASH hostname -> configured slots
REASON_KEY = "fq:workers:reason"  # HASH hostname -> "signal\tsentence", empty when none
# The lane a worker serves: QUARANTINE_LANE for a quarantine worker (fairqueue.jobs.quarantine),
# empty for the pool's. A quarantine worker's slots are the lane's, not the pool's: counted
# in the pool, they would let normal jobs be admitted for slots only the lane's jobs reach.
LANE_KEY = "fq:workers:lane"  # HASH hostname -> lane
QUARANTINE_LANE = "quarantine"
PER_WORKER_KEYS = (WORKERS_KEY, BUSY_KEY, BUSY_BATCH_KEY, CAPACITY_KEY, REASON_KEY, LANE_KEY)
HEARTBEAT_SECONDS = 1.0
WORKER_TTL_SECONDS = 6.0
FORGET_AFTER_SECONDS = 10 * WORKER_TTL_SECONDS  # a silent worker's entry is then dropped


def fleet_read() -> dict[str, int]:
    """Live slots (as offered: backpressure shrinks them) and busy slots of the pool's
    workers, and apart from them the quarantine lane's: one pipelined round trip."""
    client = redis_client()
    now = time.time()
    pipe = client.pipeline(transaction=False)
    pipe.zrangebyscore(SEEN_KEY, now - WORKER_TTL_SECONDS, "+inf")
    pipe.hgetall(WORKERS_KEY)
    pipe.hgetall(BUSY_KEY)
    pipe.hgetall(BUSY_BATCH_KEY)
    pipe.hgetall(LANE_KEY)
    live, slots, busy, busy_batch, lanes = pipe.execute()
    lane = [h for h in live if lanes.get(h) == QUARANTINE_LANE]
    pool = [h for h in live if lanes.get(h) != QUARANTINE_LANE]
    return {
        "workers": len(pool),
        "slots": sum(int(slots.get(h, 0)) for h in pool),
        "busy": sum(int(busy.get(h, 0)) for h in pool),
        "busy_batch": sum(int(busy_batch.get(h, 0)) for h in pool),
        "quarantine_workers": len(lane),
        "quarantine_slots": sum(int(slots.get(h, 0)) for h in lane),
        "quarantine_busy": sum(int(busy.get(h, 0)) for h in lane),
    }


def fleet_workers() -> list[dict[str, Any]]:
    """Each live worker's entry, by hostname: offered and configured slots, busy, and
    why it offers fewer than configured (`signal` a bounded name, `reason` a sentence)."""
    client = redis_client()
    pipe = client.pipeline(transaction=False)
    pipe.zrangebyscore(SEEN_KEY, time.time() - WORKER_TTL_SECONDS, "+inf")
    for key in PER_WORKER_KEYS:
        pipe.hgetall(key)
    live, slots, busy, busy_batch, capacity, reasons, lanes = pipe.execute()
    rows = []
    for hostname in sorted(live):
        signal, _, reason = reasons.get(hostname, "").partition("\t")
        offered = int(slots.get(hostname, 0))
        rows.append(
            {
                "hostname": hostname,
                "slots": offered,
                "capacity": int(capacity.get(hostname, offered)),
                "busy": int(busy.get(hostname, 0)),
                "busy_batch": int(busy_batch.get(hostname, 0)),
                "signal": signal,
                "reason": reason,
                "lane": lanes.get(hostname, ""),
            }
        )
    return rows


def worker_heartbeat(
    *,
    hostname: str,
    slots: int,
    running: int,
    running_batch: int,
    capacity: int | None = None,
    signal: str = "",
    reason: str = "",
    lane: str = "",
) -> None:
    """Publish one worker's entry and forget workers silent for FORGET_AFTER_SECONDS.

    `slots` is what the worker offers now; `capacity` what it was started with; `lane`
    QUARANTINE_LANE for a quarantine worker."""
    client = redis_client()
    now = time.time()
    stale = client.zrangebyscore(SEEN_KEY, "-inf", now - FORGET_AFTER_SECONDS)
    pipe = client.pipeline(transaction=False)
    pipe.hset(WORKERS_KEY, hostname, slots)
    pipe.hset(BUSY_KEY, hostname, running)
    pipe.hset(BUSY_BATCH_KEY, hostname, running_batch)
    pipe.hset(CAPACITY_KEY, hostname, slots if capacity is None else capacity)
    pipe.hset(REASON_KEY, hostname, f"{signal}\t{reason}" if signal else "")
    pipe.hset(LANE_KEY, hostname, lane)
    pipe.zadd(SEEN_KEY, {hostname: now})
    if stale:
        for key in PER_WORKER_KEYS:
            pipe.hdel(key, *stale)
        pipe.zrem(SEEN_KEY, *stale)
    pipe.execute()


def worker_deregister(hostname: str) -> None:
    """Remove a worker's entry at once (a clean shutdown)."""
    pipe = redis_client().pipeline(transaction=False)
    for key in PER_WORKER_KEYS:
        pipe.hdel(key, hostname)
    pipe.zrem(SEEN_KEY, hostname)
    pipe.execute()
