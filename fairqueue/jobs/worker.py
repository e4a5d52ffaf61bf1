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

from celery.signals import worker_ready, worker_shutdown, worker_shutting_down

from fairqueue.jobs import stats
from fairqueue.jobs.runtime import redis_client

log = logging.getLogger("fairqueue.worker")

WORKERS_KEY = "fq:workers:slots"  # HASH hostname -> slots
SEEN_KEY = "fq:workers:seen"  # ZSET hostname -> last heartbeat (unix s)
BUSY_KEY = "fq:workers:busy"  # HASH hostname -> running jobs
BUSY_BATCH_KEY = "fq:workers:busy_batch"  # HASH hostname -> running batch-lane jobs
TICK_SECONDS = 0.5  # jittered 0.25-0.75 s: admin edits reach workers within a second
HEARTBEAT_SECONDS = 1.0
WORKER_TTL_SECONDS = 6.0

_stop = threading.Event()
_hostname: str | None = None


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
    from fairqueue.jobs.recovery import jobs_admit_pending, state_ensure
    from fairqueue.jobs.services import batch_promote_due, limits_refresh

    state_ensure()
    sweep_once()
    limits_refresh()
    batch_promote_due()
    jobs_admit_pending()


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

    global _hostname
    hostname = getattr(sender, "hostname", None) or "worker"
    _hostname = hostname
    slots = int(getattr(sender.controller, "concurrency", 0) or sender.app.conf.worker_concurrency or 1)
    _stop.clear()
    threading.Thread(target=_heartbeat, args=(hostname, slots), name="fairqueue-heartbeat", daemon=True).start()
    interval = min(max(float(settings.FAIRQUEUE["LEASE_SECONDS"]) / 2, 0.5), TICK_SECONDS)
    threading.Thread(target=_ticker, args=(interval,), name="fairqueue-ticker", daemon=True).start()
    log.info("worker %s registered with %s slots", hostname, slots)


@worker_shutting_down.connect
def _on_worker_shutting_down(sig: str | None = None, how: str | None = None, **kwargs: Any) -> None:
    """SIGTERM (an autoscaler scaling in): finish what we can within the grace period."""
    from django.conf import settings

    grace = float(settings.FAIRQUEUE["SHUTDOWN_GRACE_SECONDS"])
    threading.Thread(target=_drain, args=(grace,), name="fairqueue-drain", daemon=True).start()


def _drain(grace: float) -> None:
    """Celery stops taking work and waits for running jobs; past the grace period we hand
    the rest back (re-delivered elsewhere, not counted as a worker loss) and exit."""
    import os

    from fairqueue.jobs.services import active_leases, job_requeue_graceful

    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and active_leases.count()[0]:
        time.sleep(0.05)
    leftover = active_leases.snapshot()
    if not leftover:
        return
    for engine_id, tag in leftover.items():
        try:
            job_requeue_graceful(engine_id=engine_id, tag=tag)
        except Exception:
            log.exception("could not hand back job %s; its lease will expire instead", engine_id)
    log.warning("grace period over: handed %d running job(s) back for re-delivery", len(leftover))
    _stop.set()
    _deregister(_hostname)
    os._exit(0)  # the abandoned jobs' threads cannot be stopped any other way


@worker_shutdown.connect
def _on_worker_shutdown(sender: Any = None, **kwargs: Any) -> None:
    _stop.set()
    _deregister(getattr(sender, "hostname", None))


def _deregister(hostname: str | None) -> None:
    if not hostname:
        return
    try:
        pipe = redis_client().pipeline(transaction=False)
        for key in (WORKERS_KEY, BUSY_KEY, BUSY_BATCH_KEY):
            pipe.hdel(key, hostname)
        pipe.zrem(SEEN_KEY, hostname)
        pipe.execute()
    except Exception:
        log.exception("could not deregister worker %s", hostname)
