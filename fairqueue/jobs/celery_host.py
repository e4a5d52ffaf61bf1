"""FairQueue on the host's Celery app: its queues and transport options, on its own connections.

FairQueue publishes and consumes through the project's Celery app (`celery.current_app`,
the app a Django project creates in its `celery.py`), and changes none of that app's
defaults for the project's own tasks:

- FairQueue's deliveries go out over a producer pool of its own, on connections with
  FairQueue's transport options (strict priority, its visibility timeout and key prefix
  on Redis: fairqueue/queues.py), to its own queues; the app's pool, default queue,
  acknowledgement and prefetch settings are left as the project set them.
- A worker that consumes FairQueue's queues (`celery -A <project> worker -Q fq.jobs,fq.batch
  -P threads`) is a FairQueue worker: before it starts (Celery's `celeryd_init`), it declares
  those queues with their priorities, reads them with FairQueue's transport options and one
  message per slot, on Redis through a transport that survives broker restarts
  (fairqueue/jobs/broker_transport.py). The project's own tasks published from that
  process keep the app's pool, made with the project's options before FairQueue's are set.
- A worker that consumes none of them is the project's own: FairQueue registers no slots
  and runs no duties there (fairqueue.jobs.worker).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

from celery import current_app
from celery.signals import celeryd_after_setup, celeryd_init
from celery.utils.text import str_to_list
from kombu import Connection, Exchange, Queue, pools

from fairqueue.conf import FairQueueSettings, fq_settings
from fairqueue.jobs.broker_transport import transport_for
from fairqueue.queues import BATCH_QUEUE, JOBS_QUEUE, QUARANTINE_QUEUE, broker_transport_options, task_queues

log = logging.getLogger("fairqueue.worker")

#: FairQueue's queues (on RabbitMQ the batch lane is fq.jobs' lowest priority); a worker
#: started for the quarantine lane reads fq.quarantine alone.
FAIRQUEUE_QUEUES = frozenset({JOBS_QUEUE, BATCH_QUEUE, QUARANTINE_QUEUE})


def broker_url() -> str:
    return str(current_app.conf.broker_url)


def transport_options() -> dict[str, Any]:
    """FairQueue's transport options over the project's own (its win where both set one)."""
    own = broker_transport_options(broker_url(), visibility_timeout=fq_settings().VISIBILITY_TIMEOUT_SECONDS)
    return {**current_app.conf.broker_transport_options, **own}


@functools.cache
def _pool_for(url: str, settings: FairQueueSettings) -> Any:
    del settings  # part of the cache key only: changed settings (tests), a new pool
    connection: Connection = current_app.connection_for_write(url, transport_options=transport_options())
    return pools.producers[connection]


def producer_pool() -> Any:
    """The process's pool of FairQueue producers (kombu's, shared by its threads): long-lived,
    since a connection per publish cost more than the rest of a handoff."""
    return _pool_for(broker_url(), fq_settings())


def connection_for_write() -> Connection:
    """A fresh connection with FairQueue's transport options (a broker check)."""
    return current_app.connection_for_write(broker_url(), transport_options=transport_options())


def fairqueue_queue(name: str) -> Any:
    """FairQueue's declaration of queue `name` (with its priorities on RabbitMQ); the
    quarantine lane's is a plain queue, as a worker's `-Q fq.quarantine` declares it."""
    for queue in task_queues(broker_url()):
        if queue.name == name:
            return queue
    if name == QUARANTINE_QUEUE:
        return Queue(QUARANTINE_QUEUE, Exchange(QUARANTINE_QUEUE), routing_key=QUARANTINE_QUEUE)
    raise KeyError(f"{name} is not one of FairQueue's queues")


def consumes_fairqueue(names: Iterable[str]) -> bool:
    return bool(FAIRQUEUE_QUEUES.intersection(names))


def _worker_queues(app: Any, options: dict[str, Any]) -> set[str]:
    """The queues a worker about to start will consume: its -Q, else the app's task_queues
    (the default queue when none are set), less its -X."""
    include = set(str_to_list(options.get("queues") or []))
    if not include:
        include = {q.name for q in (app.conf.task_queues or ())} or {app.conf.task_default_queue}
    return include - set(str_to_list(options.get("exclude_queues") or []))


@celeryd_init.connect
def _on_celeryd_init(sender: Any = None, instance: Any = None, conf: Any = None, options: Any = None, **_: Any) -> None:
    app = instance.app
    if not consumes_fairqueue(_worker_queues(app, options or {})):
        return
    # The project's own publishes from this process keep its options: the app's pool is
    # made now, before the consumer's options become FairQueue's below.
    app.pool  # noqa: B018
    for queue in task_queues(str(conf.broker_url)):
        if queue.name not in app.amqp.queues:
            app.amqp.queues.add(queue)
    conf.broker_transport_options = transport_options()
    # After a broker reconnect Celery lowers the prefetch while older tasks run and raises it
    # again from the thread that acknowledges each: with the threads pool that thread and the
    # consumer's loop then both talk on the one AMQP connection and deadlock. FairQueue sets
    # the prefetch itself, from the consumer's loop (backpressure.prefetch_apply).
    conf.worker_enable_prefetch_count_reduction = False
    transport = transport_for(str(conf.broker_url), conf.broker_transport)
    if transport is not None:
        conf.broker_transport = transport
    log.info("worker %s consumes FairQueue's queues: FairQueue's transport options and prefetch apply", sender)


@celeryd_after_setup.connect
def _on_celeryd_after_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """Once -Q is applied and the consumer made, before it starts: a FairQueue worker's
    prefetch (the command line's default, read from the app's settings, is the project's)."""
    if not consumes_fairqueue(instance.app.amqp.queues.consume_from or instance.app.amqp.queues):
        return
    # Each worker reserves at most this many messages per slot (with late acks, taken only
    # when a slot frees). Admission already bounds what reaches the broker, so 1 means no
    # hoarding: a reserved message would run before a higher class published after it.
    multiplier = fq_settings().PREFETCH_MULTIPLIER
    instance.prefetch_multiplier = instance.consumer.prefetch_multiplier = multiplier
    instance.consumer.initial_prefetch_count = max(instance.concurrency * multiplier, 1)
