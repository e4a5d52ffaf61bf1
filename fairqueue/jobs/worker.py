"""What a Celery worker runs beside its tasks: the slot registry and the reclaim sweep.

Both start on `worker_ready` and are daemon threads, so they die with the worker; a
worker killed with SIGKILL simply stops heartbeating and drops out of the fleet count.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

from celery.signals import worker_ready, worker_shutdown

from fairqueue.jobs import stats
from fairqueue.jobs.runtime import redis_client

log = logging.getLogger("fairqueue.worker")

WORKERS_KEY = "fq:workers:slots"  # HASH hostname -> slots
SEEN_KEY = "fq:workers:seen"  # ZSET hostname -> last heartbeat (unix s)
BUSY_KEY = "fq:workers:busy"  # HASH hostname -> running jobs
BUSY_BATCH_KEY = "fq:workers:busy_batch"  # HASH hostname -> running batch-lane jobs
TICK_SECONDS = 1.0
HEARTBEAT_SECONDS = 1.0
WORKER_TTL_SECONDS = 6.0

_stop = threading.Event()


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


def _heartbeat(hostname: str, slots: int) -> None:
    from fairqueue.jobs.services import active_leases

    client = redis_client()
    while not _stop.is_set():
        try:
            pipe = client.pipeline(transaction=False)
            pipe.hset(WORKERS_KEY, hostname, slots)
            running, batch = active_leases.count()
            pipe.hset(BUSY_KEY, hostname, running)
            pipe.hset(BUSY_BATCH_KEY, hostname, batch)
            pipe.zadd(SEEN_KEY, {hostname: time.time()})
            pipe.zremrangebyscore(SEEN_KEY, "-inf", time.time() - 10 * WORKER_TTL_SECONDS)
            pipe.execute()
            stats.flush()
        except Exception:
            log.exception("worker heartbeat failed")
        _stop.wait(HEARTBEAT_SECONDS)


def sweep_once() -> int:
    """Reclaim expired leases on every shard; returns how many jobs were reclaimed."""
    from fairqueue.jobs.admission import shard_tag
    from fairqueue.jobs.runtime import engine
    from fairqueue.jobs.services import outcomes_handle
    from tenants.policy import policy_snapshot

    total = 0
    results = engine().sweep([shard_tag(s) for s in policy_snapshot().shards], max_jobs_per_tag=100)
    for result in results.values():
        if result.reclaimed or result.woken:
            outcomes_handle(woken=result.woken, reclaimed=result.reclaimed)
        total += len(result.reclaimed)
    return total


def scheduler_tick() -> None:
    """The periodic duties any worker may perform; all are atomic and safe to overlap."""
    from fairqueue.jobs.services import batch_promote_due, limits_refresh

    sweep_once()
    limits_refresh()
    batch_promote_due()


def _ticker(interval: float) -> None:
    while not _stop.is_set():
        # Jitter keeps a large fleet from ticking in lock-step.
        _stop.wait(interval * random.uniform(0.5, 1.5))
        try:
            scheduler_tick()
        except Exception:
            log.exception("scheduler tick failed")


@worker_ready.connect
def _on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
    from django.conf import settings

    hostname = getattr(sender, "hostname", None) or "worker"
    slots = int(getattr(sender.controller, "concurrency", 0) or sender.app.conf.worker_concurrency or 1)
    _stop.clear()
    threading.Thread(target=_heartbeat, args=(hostname, slots), name="fairqueue-heartbeat", daemon=True).start()
    interval = min(max(float(settings.FAIRQUEUE["LEASE_SECONDS"]) / 2, 0.5), TICK_SECONDS)
    threading.Thread(target=_ticker, args=(interval,), name="fairqueue-ticker", daemon=True).start()
    log.info("worker %s registered with %s slots", hostname, slots)


@worker_shutdown.connect
def _on_worker_shutdown(sender: Any = None, **kwargs: Any) -> None:
    _stop.set()
    hostname = getattr(sender, "hostname", None)
    if hostname:
        try:
            client = redis_client()
            client.hdel(WORKERS_KEY, hostname)
            client.hdel(BUSY_KEY, hostname)
            client.hdel(BUSY_BATCH_KEY, hostname)
            client.zrem(SEEN_KEY, hostname)
        except Exception:
            log.exception("could not deregister worker %s", hostname)
