"""Publishing a job delivery to the broker, over one long-lived producer per thread.

Every worker consumes the same two queues, so no admin edit can leave work in a queue
nobody reads: `fq.jobs`, where a latency class is a message priority (strict: kombu's
priority lists are read highest first), and `fq.batch`, the idle-capacity lane, read
after it. A delivery's route travels through the engine as its opaque data string: the
priority level, or BATCH_ROUTE.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from fairqueue.celery import app

RUN_TASK_NAME = "fairqueue.run_job"
JOBS_QUEUE = "fq.jobs"
BATCH_QUEUE = "fq.batch"
BATCH_ROUTE = "batch"
DEFAULT_LEVEL = 5  # a route this code does not know (an older version's) still runs
# The last of kombu's priority steps (fairqueue/settings.py; admission.PRIORITY_LEVELS - 1).
# Not imported from admission: this module loads before Django is set up (the benches).
BATCH_LEVEL = 9

_producers = threading.local()


def split_engine_id(engine_id: str) -> tuple[str, int]:
    """`<job id>.<generation>` (Job.engine_id) -> (job id, generation)."""
    job_id, _, gen = engine_id.rpartition(".")
    return job_id, int(gen)


def _producer() -> Any:
    """A long-lived producer per thread.

    Without it every dispatch from a worker thread set up a new broker connection and
    channel (and redis-py resolves its own version from package metadata per connection),
    which cost more than the whole rest of a handoff.
    """
    producer = getattr(_producers, "producer", None)
    if producer is None:
        producer = app.amqp.Producer(app.connection_for_write(), auto_declare=False)
        _producers.producer = producer
    return producer


def delivery_route(*, level: int, batch: bool) -> str:
    """The engine data string that says where a delivery of this job is published."""
    return BATCH_ROUTE if batch else str(level)


def _queue_and_priority(route: str) -> tuple[str, int]:
    if route == BATCH_ROUTE:
        # The lowest level, not none: kombu's Redis transport fetches with one BRPOP over
        # every (queue, level) list, level-major, so a batch delivery at level 0 (the
        # default) would be taken before every class below the highest.
        return BATCH_QUEUE, BATCH_LEVEL
    return JOBS_QUEUE, int(route) if route.isdigit() else DEFAULT_LEVEL


def delivery_queue(route: str) -> str:
    """The queue a delivery on `route` is published to."""
    return _queue_and_priority(route)[0]


def deliveries_ahead(route: str, consumed: Sequence[str]) -> bool:
    """Whether the broker holds a delivery that a worker reading `consumed` (in that
    order) would fetch before one published now on `route`: one of a higher class, or of
    the same class published earlier.

    On the Redis transport a worker's fetch is one BRPOP over a list per (queue, priority
    step), in kombu's order; this reads the lengths of that list's entries up to the
    route's own, in one round trip, so it follows kombu's order whatever it is. Other
    transports tell a queue's length, not its order: any delivery waiting in `consumed`
    counts as ahead.
    """
    queue, priority = _queue_and_priority(route)
    channel = _producer().channel
    list_name = getattr(channel, "_q_for_pri", None)  # kombu's Redis channel: the list of (queue, priority)
    if list_name is None or queue not in consumed:
        return any(channel.queue_declare(queue=q, passive=True).message_count for q in consumed)
    order = [list_name(q, p) for p in channel.priority_steps for q in consumed]
    lists = order[: order.index(list_name(queue, priority)) + 1]
    with channel.conn_or_acquire() as client:
        pipe = client.pipeline(transaction=False)
        for name in lists:
            pipe.llen(name)
        return any(pipe.execute())


def delivery_publish(engine_id: str, route: str) -> None:
    """Send one delivery (job id and generation) where `route` says."""
    job_id, gen = split_engine_id(engine_id)
    queue, priority = _queue_and_priority(route)
    try:
        app.send_task(RUN_TASK_NAME, args=[job_id, gen], queue=queue, priority=priority, producer=_producer())
    except Exception:
        # A broken cached connection: drop it and publish once more on a fresh one.
        _producers.producer = None
        app.send_task(RUN_TASK_NAME, args=[job_id, gen], queue=queue, priority=priority, producer=_producer())
