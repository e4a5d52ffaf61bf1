"""Publishing job deliveries to the broker, over long-lived pooled producers.

Every worker consumes the same two queues, so no admin edit can leave work in a queue
nobody reads: `fq.jobs`, where a latency class is a message priority (strict: kombu's
priority lists are read highest first), and `fq.batch`, the idle-capacity lane, read
after it. A delivery's route travels through the engine as its opaque data string: the
priority level, or BATCH_ROUTE.
"""

from __future__ import annotations

from collections.abc import Sequence

from fairqueue.celery import app

RUN_TASK_NAME = "fairqueue.run_job"
JOBS_QUEUE = "fq.jobs"
BATCH_QUEUE = "fq.batch"
BATCH_ROUTE = "batch"
DEFAULT_LEVEL = 5  # a route this code does not know (an older version's) still runs


def split_engine_id(engine_id: str) -> tuple[str, int]:
    """`<job id>.<generation>` (Job.engine_id) -> (job id, generation)."""
    job_id, _, gen = engine_id.rpartition(".")
    return job_id, int(gen)


def delivery_route(*, level: int, batch: bool) -> str:
    """The engine data string that says where a delivery of this job is published."""
    return BATCH_ROUTE if batch else str(level)


def _queue_and_priority(route: str) -> tuple[str, int | None]:
    if route == BATCH_ROUTE:
        return BATCH_QUEUE, None
    return JOBS_QUEUE, int(route) if route.isdigit() else DEFAULT_LEVEL


def delivery_publish(engine_id: str, route: str) -> None:
    """Send one delivery (job id and generation) where `route` says."""
    deliveries_publish([(engine_id, route)])


def deliveries_publish(deliveries: Sequence[tuple[str, str]]) -> None:
    """Send deliveries of (engine id, route) in one broker round trip where the transport
    allows it (kombu's publish batch: one Redis pipeline; other transports publish one by
    one). All or none is known to be sent: on an error, some may have been, and the caller
    treats all as unsent (a duplicate delivery is stopped by the claim's generation guard)."""
    if not deliveries:
        return
    try:
        _send(deliveries)
    except Exception:
        # A connection that broke since it was pooled: it reconnects on its next use.
        _send(deliveries)


def _send(deliveries: Sequence[tuple[str, str]]) -> None:
    # Long-lived producers shared by the process's threads (Celery's producer pool): a
    # connection per dispatch cost more than the rest of a handoff, and a producer per
    # thread meant a new connection per request under ASGI, which runs each request in a
    # thread of its own.
    with app.producer_pool.acquire(block=True) as producer, producer.batch(max_size=max(len(deliveries), 1)):
        for engine_id, route in deliveries:
            job_id, gen = split_engine_id(engine_id)
            queue, priority = _queue_and_priority(route)
            # declare=[]: the queue needs no declaring to publish to it (the anonymous
            # exchange pushes to it by name), and declaring cost a third of each publish.
            app.send_task(
                RUN_TASK_NAME, args=[job_id, gen], queue=queue, priority=priority, producer=producer, declare=[]
            )
