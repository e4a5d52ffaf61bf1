"""The Celery signal wiring of a FairQueue worker: what runs beside its tasks.

On `worker_ready` it starts three daemon threads: the fleet heartbeat, which publishes the
slots this worker offers; the backpressure sampler (fairqueue.jobs.backpressure), which
shrinks them under resource pressure; and the ticker that runs the periodic duties while
this worker holds the fleet's duty lease (fairqueue.jobs.leadership). It lets released
slots go straight to the jobs they wake, or to the broker's next delivery
(fairqueue.jobs.handoff). On SIGTERM it stops
those handoffs and drains; on shutdown it deregisters and hands the lease on. A worker
killed with SIGKILL simply stops heartbeating and drops out of the fleet count.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Any

from celery.signals import worker_ready, worker_shutdown, worker_shutting_down

from fairqueue.conf import fq_settings
from fairqueue.jobs import stats, task_events
from fairqueue.jobs.backpressure import Backpressure
from fairqueue.jobs.celery_host import consumes_fairqueue
from fairqueue.jobs.duties import scheduler_tick
from fairqueue.jobs.execution import job_requeue_graceful
from fairqueue.jobs.fleet import HEARTBEAT_SECONDS, QUARANTINE_LANE, worker_deregister, worker_heartbeat
from fairqueue.jobs.handoff import handoff_enable, handoff_stop
from fairqueue.jobs.isolation import isolated_pool_stop
from fairqueue.jobs.leadership import DutyLease
from fairqueue.jobs.leases import active_leases
from fairqueue.queues import QUARANTINE_QUEUE

log = logging.getLogger("fairqueue.worker")

# Jittered 0.125-0.375 s. Besides admin edits reaching workers well within a second: a slot a
# steady tenant's job frees while a burst waits stays idle until the next tick shares it out
# (tenants.limits.idle_shares), so the tick's period is idle slot-time under a backlog
# (docs/fairness.md, "The duty tick's period").
TICK_SECONDS = 0.25
DRAIN_POLL_SECONDS = 0.05

_stop = threading.Event()
_hostname: str | None = None
_lease: DutyLease | None = None
_backpressure: Backpressure | None = None


def _heartbeat(hostname: str, slots: int, backpressure: Backpressure, lane: str) -> None:
    while not _stop.is_set():
        try:
            running, batch = active_leases.count()
            worker_heartbeat(
                hostname=hostname,
                slots=backpressure.offered,
                running=running,
                running_batch=batch,
                capacity=slots,
                signal=backpressure.signal,
                reason=backpressure.reason,
                lane=lane,
            )
            stats.flush()
        except Exception:
            log.exception("worker heartbeat failed")
        _stop.wait(HEARTBEAT_SECONDS)


def _ticker(interval: float, lease: DutyLease) -> None:
    """Every worker tries for the duty lease each tick; the one that holds it runs them."""
    while not _stop.is_set():
        # Jitter keeps a large fleet from trying in lock-step.
        _stop.wait(interval * random.uniform(0.5, 1.5))
        if _stop.is_set() or not lease.hold():
            continue
        try:
            scheduler_tick()
            stats.count("duty_ticks")
        except Exception:
            log.exception("scheduler tick failed")
    lease.release()


@worker_ready.connect
def _on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
    global _hostname, _lease, _backpressure
    hostname = getattr(sender, "hostname", None) or "worker"
    consumed = sender.app.amqp.queues.consume_from or sender.app.amqp.queues
    if not consumes_fairqueue(consumed):
        # The project's own worker (its default queue): no FairQueue job reaches it, so it
        # offers no slots (they would inflate the pool the limits share) and runs no duties.
        log.info("worker %s consumes none of FairQueue's queues: not a FairQueue worker", hostname)
        return
    _hostname = hostname
    slots = int(getattr(sender.controller, "concurrency", 0) or sender.app.conf.worker_concurrency or 1)
    pool = str(getattr(sender.controller, "pool_cls", "") or sender.app.conf.worker_pool or "")
    if "prefork" in pool:
        log.error(
            "worker %s runs the prefork pool: leases are renewed and counted in the process that runs a job, "
            "so run FairQueue workers with the threads pool (the default; -P threads)",
            hostname,
        )
    _stop.clear()
    backpressure = _backpressure = Backpressure(
        consumer=sender, capacity=slots, running=lambda: active_leases.count()[0]
    )
    backpressure.start()
    # A worker of the quarantine lane alone offers the lane its slots, not the pool.
    lane = QUARANTINE_LANE if set(consumed) == {QUARANTINE_QUEUE} else ""
    threading.Thread(
        target=_heartbeat, args=(hostname, slots, backpressure, lane), name="fairqueue-heartbeat", daemon=True
    ).start()
    interval = min(max(float(fq_settings().LEASE_SECONDS) / 2, 0.5), TICK_SECONDS)
    _lease = DutyLease(hostname)
    threading.Thread(target=_ticker, args=(interval, _lease), name="fairqueue-ticker", daemon=True).start()
    # A slot pulls its next delivery only while the worker runs fewer jobs than it offers.
    handoff_enable(
        lambda: _consumed_queues(sender),
        may_start=lambda: active_leases.count()[0] < backpressure.offered,
        pull=bool(fq_settings().PULL_DELIVERIES),
    )
    # Each job run in Celery's events and `inspect active` under its own task name.
    task_events.task_events_enable(sender)
    log.info("worker %s registered with %s slots%s", hostname, slots, f" for the {lane} lane" if lane else "")


def _consumed_queues(consumer: Any) -> list[str]:
    """The queues the worker's task consumer reads now, in its order (none while it is
    not running, e.g. reconnecting to the broker)."""
    task_consumer = getattr(consumer, "task_consumer", None)
    return [q.name for q in task_consumer.queues] if task_consumer is not None else []


@worker_shutting_down.connect
def _on_worker_shutting_down(sig: str | None = None, how: str | None = None, **kwargs: Any) -> None:
    """SIGTERM (an autoscaler scaling in): finish what we can within the grace period,
    starting nothing new: jobs woken from now on are published for other workers."""
    handoff_stop()
    grace = float(fq_settings().SHUTDOWN_GRACE_SECONDS)
    threading.Thread(target=_drain, args=(grace,), name="fairqueue-drain", daemon=True).start()


def _drain(grace: float) -> None:
    """Celery stops taking work and waits for running jobs; past the grace period we hand
    the rest back (re-delivered elsewhere, not counted as a worker loss) and exit."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and active_leases.count()[0]:
        time.sleep(DRAIN_POLL_SECONDS)
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
    handoff_stop()
    _stop.set()
    if _backpressure is not None:
        _backpressure.stop()
    isolated_pool_stop()
    _deregister(getattr(sender, "hostname", None))


def _deregister(hostname: str | None) -> None:
    if _lease is not None:
        _lease.release()
    if not hostname:
        return
    try:
        worker_deregister(hostname)
    except Exception:
        log.exception("could not deregister worker %s", hostname)
