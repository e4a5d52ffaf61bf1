"""The broker's queues and message priorities, per transport (Redis or RabbitMQ).

The settings declare the queues from here and `fairqueue.jobs.broker` publishes by it, so
it imports neither Django nor the Celery application.

A latency class reaches the broker as a *level*: 0 for the highest-ranked class, then one
level per class down to PRIORITY_LEVELS - 1. The two transports read priorities the
opposite way round:

- kombu's Redis transport keeps one list per queue and priority step and reads the lowest
  number first. Its one BRPOP names the lists step by step, each step's queues in order
  (`fq.jobs@0, fq.batch@0, fq.jobs@1, ...`), so the batch lane, its own queue `fq.batch`,
  is read after every class only because its messages sit at the last step.
- RabbitMQ reads the highest number first, and only in a queue declared with
  `x-max-priority`. Two queues consumed on one channel are read in no particular order
  (the channel's next credit goes to whichever queue delivers first), and consumer
  priorities (`x-priority`) only rank the consumers of one queue, not one consumer's
  queues. So on AMQP the batch lane is the lowest priority of `fq.jobs` itself: strict
  by construction, and each worker has one consumer, so a prefetch of one message per
  slot holds on RabbitMQ 4 too (which applies prefetch per consumer, not per channel).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from kombu import Exchange, Queue

JOBS_QUEUE = "fq.jobs"
BATCH_QUEUE = "fq.batch"  # Redis only: on AMQP the batch lane is AMQP_BATCH_PRIORITY in JOBS_QUEUE
# The quarantine lane (jobs whose workers died under them): deliberately not among the
# queues every worker consumes (`task_queues`), so only a worker started for it reads it
# (`manage.py worker --quarantine`, or `celery -A fairqueue worker -Q fq.quarantine`).
# One priority: the lane's own engine key already admits its jobs in fair order.
QUARANTINE_QUEUE = "fq.quarantine"
QUARANTINE_PRIORITY = 0
PRIORITY_LEVELS = 10  # latency-class levels a broker tells apart; classes past the last share it
# Redis: level n is priority n; batch messages sit at the last step, after fq.jobs's.
REDIS_BATCH_PRIORITY = PRIORITY_LEVELS - 1
# AMQP: level 0 (the highest class) is priority PRIORITY_LEVELS, the lowest class 1, batch 0.
AMQP_MAX_PRIORITY = PRIORITY_LEVELS
AMQP_BATCH_PRIORITY = 0
AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp"})
REDIS_SCHEMES = frozenset({"redis", "rediss", "redis+socket", "sentinel"})
BROKER_CONNECT_TIMEOUT_SECONDS = 2.0


class UnsupportedBroker(ValueError):
    pass


def broker_is_amqp(url: str) -> bool:
    """True for a RabbitMQ (AMQP 0-9-1) broker URL, False for Redis; anything else is refused."""
    scheme = urlsplit(url).scheme.lower()
    if scheme in AMQP_SCHEMES:
        return True
    if scheme in REDIS_SCHEMES:
        return False
    raise UnsupportedBroker(
        f"unsupported Celery broker URL scheme {scheme!r}: use redis://... or amqp://... "
        "(the latency-class order is built for those two transports)"
    )


def message_target(level: int | None, *, amqp: bool) -> tuple[str, int]:
    """(queue, message priority) of a delivery at latency-class `level`, or in the batch
    lane when `level` is None. The one place the class -> priority mapping is written."""
    if level is not None:
        level = min(max(level, 0), PRIORITY_LEVELS - 1)
    if amqp:
        return JOBS_QUEUE, AMQP_BATCH_PRIORITY if level is None else AMQP_MAX_PRIORITY - level
    return (BATCH_QUEUE, REDIS_BATCH_PRIORITY) if level is None else (JOBS_QUEUE, level)


def task_queues(url: str) -> tuple[Queue, ...]:
    """The queues every worker consumes (Celery's `task_queues`) on the broker at `url`."""
    if broker_is_amqp(url):
        # A queue's arguments are fixed when it is first declared: a `fq.jobs` left from a
        # deployment without x-max-priority must be deleted once (RabbitMQ refuses the
        # redeclaration with PRECONDITION_FAILED).
        arguments = {"x-max-priority": AMQP_MAX_PRIORITY}
        return (Queue(JOBS_QUEUE, Exchange(JOBS_QUEUE), routing_key=JOBS_QUEUE, queue_arguments=arguments),)
    return tuple(Queue(name, Exchange(name), routing_key=name) for name in (JOBS_QUEUE, BATCH_QUEUE))


def broker_transport_options(url: str, *, visibility_timeout: int) -> dict[str, Any]:
    """Celery's `broker_transport_options` for the broker at `url`."""
    if broker_is_amqp(url):
        # RabbitMQ gives an unacknowledged delivery back as soon as its consumer's
        # connection closes (a SIGKILLed worker); it has no visibility timeout to tune.
        return {}
    return {
        # Strict priority: fq.jobs before fq.batch, and within fq.jobs one list per level,
        # read highest class first, instead of kombu's round robin.
        "queue_order_strategy": "priority",
        "priority_steps": list(range(PRIORITY_LEVELS)),
        # The engine's leases re-deliver work from dead workers; the broker's own
        # re-delivery is only a late safety net, so it must not fire on long jobs.
        "visibility_timeout": visibility_timeout,
        "global_keyprefix": "fq:celery:",
        # A broker that does not answer fails a publish fast (it then waits in the database
        # for the pending sweep) instead of holding a request for the OS's connect timeout.
        "socket_connect_timeout": BROKER_CONNECT_TIMEOUT_SECONDS,
    }
