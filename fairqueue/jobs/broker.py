"""Publishing a job delivery to its Celery queue, over one long-lived producer per thread."""

from __future__ import annotations

import threading
from typing import Any

from fairqueue.celery import app

RUN_TASK_NAME = "fairqueue.run_job"

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


def delivery_publish(engine_id: str, queue: str) -> None:
    """Send one delivery (job id and generation) to `queue`."""
    job_id, gen = split_engine_id(engine_id)
    try:
        app.send_task(RUN_TASK_NAME, args=[job_id, gen], queue=queue, producer=_producer())
    except Exception:
        # A broken cached connection: drop it and publish once more on a fresh one.
        _producers.producer = None
        app.send_task(RUN_TASK_NAME, args=[job_id, gen], queue=queue, producer=_producer())
