"""Publishing job deliveries to the broker, over long-lived pooled producers.

Every worker consumes the same queues, so no admin edit can leave work in a queue nobody
reads: `fq.jobs`, where a latency class is a message priority read strictly highest
first, and the idle-capacity batch lane, read only when no class waits (fairqueue/queues.py
says how on Redis and on RabbitMQ). A delivery's route travels through the engine as its
opaque data string: the class level, or BATCH_ROUTE; the broker it is published to turns
it into a queue and a message priority. With tracing on, the job's trace context follows
the route after a space (fairqueue.tracing.job_carry), so a delivery published by another
job's release still goes out in its own job's trace.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

import redis
from celery import current_app as app
from celery import signals

from fairqueue import tracing
from fairqueue.engine.scripts import LUA_DIR
from fairqueue.jobs import celery_host
from fairqueue.queues import (
    BATCH_QUEUE,
    JOBS_QUEUE,
    QUARANTINE_PRIORITY,
    QUARANTINE_QUEUE,
    broker_is_amqp,
    message_target,
)

__all__ = [
    "BATCH_QUEUE",
    "JOBS_QUEUE",
    "QUARANTINE_QUEUE",
    "broker_identity",
    "broker_ping",
    "deliveries_publish",
    "delivery_publish",
    "delivery_pull",
    "delivery_route",
    "delivery_unpull",
    "route_carry",
    "split_engine_id",
]

RUN_TASK_NAME = "fairqueue.run_job"
BATCH_ROUTE = "batch"
QUARANTINE_ROUTE = "quarantine"  # fairqueue.jobs.quarantine: read only by quarantine workers
DEFAULT_LEVEL = 5  # a route this code does not know (an older version's) still runs


def split_engine_id(engine_id: str) -> tuple[str, int]:
    """`<job id>.<generation>` (Job.engine_id) -> (job id, generation)."""
    job_id, _, gen = engine_id.rpartition(".")
    return job_id, int(gen)


def delivery_route(*, level: int, batch: bool, carry: str = "", quarantined: bool = False) -> str:
    """The engine data string that says where a delivery of this job is published (and,
    after a space, the job's trace `carry`, when it has one). A quarantined job goes to the
    quarantine lane whatever its class or batch flag."""
    route = QUARANTINE_ROUTE if quarantined else BATCH_ROUTE if batch else str(level)
    return f"{route} {carry}" if carry else route


def route_carry(data: str) -> tuple[str, str]:
    """(route, trace carry) of a delivery's engine data string."""
    route, _, carry = data.partition(" ")
    return route, carry


def route_level(data: str) -> int | None:
    """The class level a route names, or None for the batch lane."""
    route = route_carry(data)[0]
    if route == BATCH_ROUTE:
        return None
    return int(route) if route.isdigit() else DEFAULT_LEVEL


def route_target(route: str, *, amqp: bool) -> tuple[str, int]:
    """(queue, message priority) of a delivery on `route` (an engine data string)."""
    if route_carry(route)[0] == QUARANTINE_ROUTE:
        return QUARANTINE_QUEUE, QUARANTINE_PRIORITY
    return message_target(route_level(route), amqp=amqp)


def delivery_queue(route: str) -> str:
    """The queue a delivery on `route` is published to."""
    return route_target(route, amqp=_amqp())[0]


def _amqp() -> bool:
    return broker_is_amqp(str(app.conf.broker_url))


def deliveries_ahead(route: str, consumed: Sequence[str]) -> bool:
    """Whether the broker holds a delivery that a worker reading `consumed` (in that
    order) would fetch before one published now on `route`: one of a higher class, or of
    the same class published earlier.

    On the Redis transport a worker's fetch is one BRPOP over a list per (queue, priority
    step), in kombu's order; this reads the lengths of that list's entries up to the
    route's own, in one round trip, so it follows kombu's order whatever it is. Other
    transports tell a queue's length, not its order, and a passive check of a queue that
    does not exist closes the channel: there every delivery counts as behind one, so the
    worker publishes rather than runs it in place.
    """
    if _amqp():
        return True
    queue, priority = route_target(route, amqp=False)
    with celery_host.producer_pool().acquire(block=True) as producer:
        channel = producer.channel
        order = _fetch_order(channel, consumed)
        if order is None or queue not in consumed:
            return True
        lists = order[: order.index(channel._q_for_pri(queue, priority)) + 1]
        with channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            for name in lists:
                pipe.llen(name)
            return any(pipe.execute())


def _fetch_order(channel: Any, consumed: Sequence[str]) -> list[str] | None:
    """The lists a worker reading `consumed` (in that order) fetches from, in the order of
    kombu's one BRPOP over them; None on a channel that is not kombu's Redis one."""
    list_name = getattr(channel, "_q_for_pri", None)  # kombu's Redis channel: the list of (queue, priority)
    if list_name is None:
        return None
    return [list_name(q, p) for p in channel.priority_steps for q in consumed]


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
    with celery_host.producer_pool().acquire(block=True) as producer:
        if _templated(producer, deliveries):
            _send_templated(producer, deliveries)
            return
        with producer.batch(max_size=max(len(deliveries), 1)):
            amqp = producer.connection.transport.driver_type == "amqp"
            for engine_id, data in deliveries:
                job_id, gen = split_engine_id(engine_id)
                route, carry = route_carry(data)
                queue, priority = route_target(route, amqp=amqp)
                # Celery's instrumentation puts the current context in the message's headers:
                # the job's own, whichever job's release is publishing it.
                with tracing.within(tracing.carry_read(carry)[0]):
                    app.send_task(
                        RUN_TASK_NAME,
                        args=[job_id, gen],
                        queue=queue,
                        priority=priority,
                        producer=producer,
                        declare=_declarations(queue, amqp=amqp),
                        # No retry loop on the caller's path (a request's): a delivery that
                        # cannot go now waits in the database for the pending sweep.
                        retry=False,
                    )


# --- the Redis transport's messages, from one template per publish ----------------------------
#
# Celery's send_task and kombu's publish cost several times the rest of a job's submit, and
# all but a few fields of every delivery's message are the same. On the Redis transport a
# publish is an LPUSH of the message's JSON to the list of its (queue, priority): there, one
# message per (queue, priority) is built by Celery itself (send_task, into a producer that
# keeps the message instead of publishing it) and each delivery's is that message with its
# own task id, arguments and delivery tag, pushed in one pipeline. Where something may
# change a message per publish (a receiver of Celery's publish signals, such as the tracing
# instrumentation, or sent events) every delivery goes through send_task.

REDIS_BODY_ENCODING = "base64"
JSON_SERIALIZER = "json"
JSON_CONTENT_TYPE = "application/json"
PUBLISH_ARGUMENTS = (
    "exchange",
    "routing_key",
    "serializer",
    "compression",
    "retry",
    "retry_policy",
    "declare",
    "timeout",
    "confirm_timeout",
)
TEMPLATE_JOB_ID = "00000000-0000-0000-0000-000000000000"
# A delivery's own values in its message.
MESSAGE_FIELDS = ("task_id", "root_id", "parent_id", "delivery_tag", "argsrepr", "body")


class _KeptMessage:
    """A stand-in producer for send_task: keeps what Celery would publish (kombu
    Producer.publish's arguments) instead of publishing it."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.body: Any = None
        self.options: dict[str, Any] = {}

    def publish(self, body: Any, **options: Any) -> None:
        self.body, self.options = body, options


def _templated(producer: Any, deliveries: Sequence[tuple[str, str]]) -> bool:
    """Whether these deliveries' messages may be built from a template."""
    return (
        producer.connection.transport.driver_type == "redis"
        and getattr(producer.channel, "_q_for_pri", None) is not None
        and not any(route_carry(data)[1] for _, data in deliveries)
        and _conf_templatable()
        and not any(s.receivers for s in (signals.before_task_publish, signals.after_task_publish, signals.task_sent))
    )


_conf_allows_templates: bool | None = None


def _conf_templatable() -> bool:
    """Whether Celery's configuration lets a message be built from a template (JSON, not
    compressed, no sent events). Read once per process, as the templates themselves are
    built once (a thread's first publish) and kept: each of these lookups in Celery's
    configuration (its key aliases, Django's settings behind them) took tens of
    microseconds, more than the rest of a delivery's message."""
    global _conf_allows_templates
    if _conf_allows_templates is None:
        _conf_allows_templates = (
            app.conf.task_serializer == JSON_SERIALIZER
            and not app.conf.task_compression
            and not app.conf.task_send_sent_event
        )
    return _conf_allows_templates


class _MessageTemplate:
    """The Redis transport's message for a delivery to one (queue, priority), as Celery
    builds it for a template job: its JSON text, cut where a delivery's own values go (the
    task id, wherever Celery put it; the parent and root task ids; the arguments' repr; the
    body; the delivery tag). `message` joins the pieces with one delivery's values."""

    def __init__(self, connection: Any, queue: str, priority: int) -> None:
        marks = {name: f"@fq-{name}-{uuid.uuid4().hex}@" for name in MESSAGE_FIELDS}
        kept = _KeptMessage(connection)
        app.send_task(
            RUN_TASK_NAME,
            args=[TEMPLATE_JOB_ID, 0],
            task_id=marks["task_id"],
            root_id=marks["root_id"],
            parent_id=marks["parent_id"],
            queue=queue,
            priority=priority,
            producer=kept,
            declare=[],
            add_to_parent=False,
        )
        properties = dict(kept.options)
        headers = properties.pop("headers")
        _, self.kwargs, self.embed = kept.body
        # kombu's Producer.publish arguments that are not message properties.
        for name in PUBLISH_ARGUMENTS:
            properties.pop(name, None)
        # kombu's Producer.publish and the virtual channel's basic_publish add these.
        properties["delivery_info"] = {"exchange": "", "routing_key": queue}
        properties["priority"] = priority
        properties["body_encoding"] = REDIS_BODY_ENCODING
        properties["delivery_tag"] = marks["delivery_tag"]
        text = json.dumps(
            {
                "body": marks["body"],
                "content-encoding": "utf-8",
                "content-type": JSON_CONTENT_TYPE,
                "headers": {**headers, "argsrepr": marks["argsrepr"]},
                "properties": properties,
            }
        )
        # Each mark is a JSON string in the text; a delivery's value replaces it, quotes and
        # all, as the JSON of that value (a parent id may be null).
        by_mark = {json.dumps(mark): name for name, mark in marks.items()}
        pieces = re.split("(" + "|".join(map(re.escape, by_mark)) + ")", text)
        self.pieces = pieces[0::2]  # the fixed text, around...
        self.fields = [by_mark[mark] for mark in pieces[1::2]]  # ...each place a delivery's value goes
        # The body is json.dumps([args, kwargs, embed]): "[" + the args' JSON + ", " and then
        # this, the same for every delivery (the JSON of [kwargs, embed] without its "[").
        self.body_rest = json.dumps([self.kwargs, self.embed])[1:]

    def message(self, job_id: str, gen: int, parent: tuple[str | None, str | None]) -> str:
        """One delivery's message; `parent`: the (root id, parent id) of the task publishing
        it (`_parent_ids`)."""
        args = [job_id, gen]
        # json.dumps(args) as json.dumps writes a string and an int (job ids are strings,
        # generations ints: split_engine_id).
        args_json = f"[{encode_basestring_ascii(job_id)}, {int(gen)!r}]"
        task_id = str(uuid.uuid4())
        root_id, parent_id = parent
        values = {
            "task_id": task_id,
            "root_id": root_id or task_id,
            "parent_id": parent_id,
            "delivery_tag": str(uuid.uuid4()),
            "argsrepr": repr(args),
            "body": base64.b64encode(f"[{args_json}, {self.body_rest}".encode()).decode(),
        }
        out = [self.pieces[0]]
        for name, piece in zip(self.fields, self.pieces[1:], strict=True):
            out += (_json_text(values[name]), piece)
        return "".join(out)


def _json_text(value: str | None) -> str:
    """``json.dumps(value)`` for a string or None, without its encoder's dispatch: for a
    string ``json.dumps`` (ASCII output, its default) is ``encode_basestring_ascii``."""
    return "null" if value is None else encode_basestring_ascii(value)


# One template per (queue, priority) and thread: Celery names the publishing thread in a
# message (reply_to, its thread_oid). Built on a thread's first publish there, and kept in
# the thread's own storage, so it goes with the thread (Django's ASGI handler runs each
# page request in a thread of its own).
_thread_templates = threading.local()


def _template(connection: Any, queue: str, priority: int) -> _MessageTemplate:
    templates: dict[tuple[str, int], _MessageTemplate] | None = getattr(_thread_templates, "by_target", None)
    if templates is None:
        templates = _thread_templates.by_target = {}
    template = templates.get((queue, priority))
    if template is None:
        template = templates[(queue, priority)] = _MessageTemplate(connection, queue, priority)
    return template


def _parent_ids() -> tuple[str | None, str | None]:
    """(root id, parent id) of a message published now, as send_task sets them: those of
    the task this worker thread runs, or none (a task then is its own root)."""
    parent = app.current_worker_task
    if parent is None:
        return None, None
    return parent.request.root_id or parent.request.id, parent.request.id


# One redis-py client per kombu Redis channel, for its publishes. kombu's conn_or_acquire
# builds a new client object (over the channel's connection pool) on every call, and
# building one (its command callbacks, its key-prefixing wrapper) cost about as much as
# the rest of a single delivery's publish. A client holds no connection of its own (each
# command or pipeline takes one from the channel's pool and gives it back), so it can be
# kept for as long as the channel lives.
_publish_clients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_publish_clients_lock = threading.Lock()


def _publish_client(channel: Any) -> Any:
    client = _publish_clients.get(channel)
    if client is None:
        with _publish_clients_lock:
            client = _publish_clients.get(channel)
            if client is None:
                with channel.conn_or_acquire() as made:
                    client = _publish_clients[channel] = made
    return client


def _send_templated(producer: Any, deliveries: Sequence[tuple[str, str]]) -> None:
    channel = producer.channel
    parent = _parent_ids()
    # One LPUSH per list, its messages in the deliveries' order: what one LPUSH per message
    # in that order leaves in the list (each goes to the head), in fewer commands.
    by_list: dict[str, list[str]] = {}
    for engine_id, data in deliveries:
        job_id, gen = split_engine_id(engine_id)
        target = route_target(data, amqp=False)
        template = _template(producer.connection, *target)
        by_list.setdefault(channel._q_for_pri(*target), []).append(template.message(job_id, gen, parent))
    pipe = _publish_client(channel).pipeline(transaction=False)
    for name, messages in by_list.items():
        pipe.lpush(name, *messages)
    pipe.execute()


def broker_identity() -> str | None:
    """Which server the broker is now, for noticing that it restarted: a Redis broker's run
    id (new at every start; a server that keeps nothing on disk comes back empty, its
    deliveries lost). None on RabbitMQ, whose durable queues keep their messages."""
    if _amqp():
        return None
    with celery_host.producer_pool().acquire(block=True) as producer:
        if getattr(producer.channel, "_q_for_pri", None) is None:
            return None
        return str(_publish_client(producer.channel).info("server")["run_id"])


def broker_ping(*, timeout: float) -> None:
    """Raise unless the broker answers within about `timeout` seconds: a Redis broker a
    PING over the publishing pool, RabbitMQ a fresh connection (an idle pooled one would
    not notice that the server went away)."""
    if _amqp():
        with celery_host.connection_for_write() as connection:
            connection.ensure_connection(max_retries=0, timeout=timeout)
        return
    with celery_host.producer_pool().acquire(block=True, timeout=timeout) as producer:
        _publish_client(producer.channel).ping()


def _declarations(queue: str, *, amqp: bool) -> list[Any]:
    """What a publish declares first. On Redis nothing: the anonymous exchange pushes to a
    list by name, and declaring cost a third of each publish. RabbitMQ drops a message
    routed to a queue that does not exist yet (no worker has started since the broker
    was new), so there the queue is declared, with its priorities: kombu remembers it per
    connection, so that is one round trip per pooled connection."""
    return [celery_host.fairqueue_queue(queue)] if amqp else []


# --- a delivery taken from the broker by the slot that runs it (fairqueue.jobs.handoff) -------

_PULL_SOURCE = (LUA_DIR / "broker_pull.lua").read_text()


@dataclass(frozen=True)
class Pulled:
    """A delivery of a job taken off the broker by `delivery_pull`: the job's id and
    generation, and the message itself with the list it came from (to put it back)."""

    job_id: str
    generation: int
    list_name: str
    message: bytes | str


def delivery_pull(consumed: Sequence[str]) -> Pulled | None:
    """Take, without waiting, the next message a worker reading `consumed` would fetch,
    if it is a delivery of a job; one round trip (lua/broker_pull.lua).

    The message goes nowhere else: not into kombu's unacknowledged set, so a worker that
    dies holding it leaves the job to the engine, whose hold on it runs out and is
    re-delivered, as for any delivery (the broker's own re-delivery is only a late safety
    net: fairqueue.queues). Anything else (another task's message, one with an ETA or an
    expiry, which Celery's consumer handles) goes back to the head of its list, where the
    worker's next fetch takes it, and None is returned. Redis transport only; None on other
    brokers."""
    if _amqp():
        return None
    puller = _puller()
    if puller is None:
        return None
    keys = puller.keys(consumed)
    if not keys:
        return None
    try:
        reply = puller.script(keys=keys)
        if not reply:
            return None
        index, message = reply
        key = keys[int(index) - 1]
        target = run_job_target(message)
        if target is None:
            puller.client.rpush(key, message)
            return None
    except Exception:
        _puller_drop(puller)  # a broken connection or pool: the next pull starts afresh
        raise
    return Pulled(job_id=target[0], generation=target[1], list_name=key, message=message)


def delivery_unpull(pulled: Pulled) -> None:
    """Put a pulled delivery back at the head of its list (the slot could not run it)."""
    puller = _puller()
    if puller is None:  # pulled from Redis, so this does not happen; nothing to put back to
        return
    puller.client.rpush(pulled.list_name, pulled.message)


class _Puller:
    """What a pull needs, made once per process: a plain redis-py client over the broker
    channel's connection pool (kombu's own client wraps every command to prefix its keys,
    and taking a producer from the pool for each pull cost more than the pull), the script,
    and the prefixed list names for each set of consumed queues."""

    def __init__(self, channel: Any) -> None:
        pool = channel.pool  # kombu's Redis channel: its connection pool, as its own clients take it
        provider = pool.connection_kwargs.get("credential_provider")
        self.client = redis.Redis(connection_pool=pool, **({"credential_provider": provider} if provider else {}))
        self.script = self.client.register_script(_PULL_SOURCE)
        self._prefix = getattr(channel, "global_keyprefix", "") or ""
        self._channel = channel
        self._keys: dict[tuple[str, ...], list[str]] = {}

    def keys(self, consumed: Sequence[str]) -> list[str]:
        """The lists, with kombu's key prefix, in the fetch order of a worker reading `consumed`."""
        wanted = tuple(consumed)
        keys = self._keys.get(wanted)
        if keys is None:
            keys = self._keys[wanted] = [self._prefix + name for name in _fetch_order(self._channel, wanted) or []]
        return keys


_puller_made: _Puller | None = None
_puller_lock = threading.Lock()


def _puller() -> _Puller | None:
    global _puller_made
    puller = _puller_made
    if puller is None:
        with _puller_lock, celery_host.producer_pool().acquire(block=True) as producer:
            if _puller_made is None and _fetch_order(producer.channel, []) is not None:
                _puller_made = _Puller(producer.channel)
            puller = _puller_made
    return puller


def _puller_drop(puller: _Puller) -> None:
    global _puller_made
    with _puller_lock:
        if _puller_made is puller:
            _puller_made = None


def run_job_target(message: bytes | str) -> tuple[str, int] | None:
    """(job id, generation) of a Redis transport message that delivers a job (Celery's
    message protocol 2, JSON, the job task), or None for any other message."""
    try:
        envelope = json.loads(message)
        headers = envelope.get("headers") or {}
        if (
            headers.get("task") != RUN_TASK_NAME
            or envelope.get("content-type") != JSON_CONTENT_TYPE
            or headers.get("compression")
            or headers.get("eta")
            or headers.get("expires")
        ):
            return None
        body = envelope["body"]
        if (envelope.get("properties") or {}).get("body_encoding") == REDIS_BODY_ENCODING:
            body = base64.b64decode(body)
        args, kwargs, _embed = json.loads(body)
        job_id = args[0] if len(args) > 0 else kwargs["job_id"]
        generation = args[1] if len(args) > 1 else kwargs["generation"]
        return str(job_id), int(generation)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
