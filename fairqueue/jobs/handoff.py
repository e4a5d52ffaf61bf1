"""What a worker slot runs next when its job ends, without a trip through Celery's consumer.

Slot handoff: the worker whose release freed a slot runs the job the engine handed it.

A release gives the freed slot to the next waiter in the same engine call. Publishing that
job left the worker slot idle for a publish, a broker wait and another worker's fetch;
instead the releasing worker runs it at once in the same slot when it may:

- it consumes the job's queue (every worker reads `fq.jobs`; `fq.batch` unless started
  with `--no-batch` / `-X fq.batch`);
- it is not shutting down (a warm shutdown starts nothing new: it publishes);
- Celery's consumer holds no delivery for this worker that waits for a slot (the freed
  slot is that delivery's);
- the broker holds no delivery this worker would fetch first (a higher latency class, or
  the same class published earlier; for a batch job, anything). The slot would then have
  taken this job, or one just like it, next anyway, so strict class order holds. A
  delivery published between that check and the start waits for one job: the inversion
  is bounded by one job per slot, the same as a delivery that lands just after a worker
  fetched a lower class.

The job is still claimed through the generation guard and leased like any delivery
(fairqueue.jobs.execution); only the broker message is skipped. Anything the pick declines
or fails on is published as before (fairqueue.jobs.dispatch).

Pull: when the release hands the slot nothing, the slot takes the next delivery from the
broker itself (`next_delivery`), the one the worker's own fetch would have taken next.
Celery's consumer is one thread per worker process that fetches, records and
acknowledges every message with its own round trips, in turns with the task threads for
Python's lock; for short jobs it, not the slots, set the worker's pace, and a slot sat
idle between its jobs. A pulled delivery runs as a delivery (claimed through the
generation guard, leased), under the message that started the slot's chain. It is taken
only where a fetch would take it: same queues and order, not while shutting down, and not
while the worker runs as many jobs as it offers (fairqueue.jobs.backpressure).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from celery.worker import state as celery_state

from fairqueue.engine import Woken
from fairqueue.jobs.broker import BATCH_ROUTE, Pulled, deliveries_ahead, delivery_pull, delivery_queue, route_carry

log = logging.getLogger("fairqueue.jobs.handoff")

_lock = threading.Lock()
_consumed: Callable[[], Sequence[str]] | None = None


def _always() -> bool:
    return True


_may_start: Callable[[], bool] = _always
_pull = False
_stopping = threading.Event()


def handoff_enable(
    consumed: Callable[[], Sequence[str]], may_start: Callable[[], bool] | None = None, *, pull: bool = True
) -> None:
    """Let this process run woken jobs inline and, with `pull`, pull deliveries; `consumed`
    names the queues its worker reads right now, in its fetch order (a remote
    `cancel_consumer` changes them); `may_start` says whether the worker takes one more job
    now (it runs fewer than it offers)."""
    global _consumed, _may_start, _pull
    with _lock:
        _consumed = consumed
        _may_start = may_start or _always
        _pull = pull
        _stopping.clear()


def handoff_stop() -> None:
    """The worker is shutting down: from now on woken jobs are published."""
    _stopping.set()


def handoff_disable() -> None:
    global _consumed
    with _lock:
        _consumed = None


def _celery_stopping() -> bool:
    """Celery's own flags: set by any warm or cold shutdown, signal or not (an exit code,
    0 included, or None)."""
    return celery_state.should_stop is not None or celery_state.should_terminate is not None


def _delivery_waiting() -> bool:
    """Whether Celery's consumer holds a delivery for this worker that no slot runs yet (a
    prefetch can land while every slot runs a chain). A freed slot is then that delivery's:
    it was taken off the broker in the broker's order, and a slot that chained a woken job
    or pulled another instead would leave it waiting for a job to end, a whole long job."""
    active = celery_state.active_requests
    return any(request not in active for request in list(celery_state.reserved_requests))


def _fetch_rank(woken: Woken) -> tuple[bool, int]:
    """Classes first, highest (level 0) first; the batch lane last."""
    route = route_carry(woken.data)[0]
    return route == BATCH_ROUTE, int(route) if route.isdigit() else 0


def inline_pick(woken: Sequence[Woken]) -> Woken | None:
    """The woken job this worker runs in the slot it just freed, or None to publish all.

    Costs one broker round trip (the backlog check) when there is a candidate, against
    the publish and the fetch it saves.
    """
    consumed = _consumed
    if consumed is None or not woken or _stopping.is_set() or _celery_stopping() or _delivery_waiting():
        return None
    queues = list(consumed())
    runnable = [w for w in woken if delivery_queue(w.data) in queues]
    if not runnable:
        return None
    first = min(runnable, key=_fetch_rank)
    if deliveries_ahead(first.data, queues):
        return None
    return first


def next_delivery() -> Pulled | None:
    """The delivery a slot whose job ended (and whose release handed it nothing) runs next,
    taken off the broker by this thread; None to leave the slot to Celery's consumer."""
    consumed = _consumed
    if (
        consumed is None
        or not _pull
        or _stopping.is_set()
        or _celery_stopping()
        or not _may_start()
        or _delivery_waiting()
    ):
        return None
    queues = list(consumed())
    if not queues:
        return None
    try:
        return delivery_pull(queues)
    except Exception:  # the broker unreachable, say: the slot waits for the consumer's fetch
        log.warning("could not pull a delivery from the broker", exc_info=True)
        return None
