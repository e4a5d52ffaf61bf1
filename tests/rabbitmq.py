"""RabbitMQ for tests: a fresh virtual host per test class on the local server, and this
process's Celery app pointed at it for the class (its workers get the same broker URL
through tests.workers.worker_env), so runs never see each other's messages.

The server is the machine's own (`FAIRQUEUE_TEST_AMQP_URL`, default guest on
127.0.0.1:5672); virtual hosts are made and dropped with `rabbitmqctl`, which needs root
(or the server's Erlang cookie). `make test` and `.ci/run` start the server when it is
installed (scripts/ensure_rabbitmq.sh).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

from django.test import override_settings
from kombu import Connection

from fairqueue.celery import app
from fairqueue.queues import JOBS_QUEUE, broker_transport_options, task_queues

AMQP_SERVER_URL = os.environ.get("FAIRQUEUE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672")
RABBITMQCTL_TIMEOUT_S = 60
# The settings Celery reads from the broker URL (fairqueue/settings.py, Celery section).
BROKER_CONF_KEYS = ("broker_url", "task_queues", "broker_transport_options")


class RabbitMQUnavailable(RuntimeError):
    pass


def _server_check() -> None:
    parts = urlsplit(AMQP_SERVER_URL)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5672
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        raise RabbitMQUnavailable(
            f"the RabbitMQ broker tests need a RabbitMQ server at {host}:{port} ({exc}); "
            "`make test` starts a local one when rabbitmq-server is installed "
            "(Debian/Ubuntu: apt-get install rabbitmq-server), or set FAIRQUEUE_TEST_AMQP_URL"
        ) from exc
    if shutil.which("rabbitmqctl") is None:
        raise RabbitMQUnavailable("the RabbitMQ broker tests need rabbitmqctl to create their virtual hosts")


def rabbitmqctl(*args: str) -> str:
    done = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=RABBITMQCTL_TIMEOUT_S, check=False
    )
    if done.returncode:
        raise RabbitMQUnavailable(f"rabbitmqctl {' '.join(args)} failed: {done.stdout}{done.stderr}")
    return done.stdout


class Vhost:
    """A RabbitMQ virtual host of its own, with the test user's full permissions."""

    def __init__(self, prefix: str = "fq_test") -> None:
        self.name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        self.url = f"{AMQP_SERVER_URL.rstrip('/')}/{quote(self.name, safe='')}"

    def create(self) -> Vhost:
        _server_check()
        user = urlsplit(AMQP_SERVER_URL).username or "guest"
        rabbitmqctl("add_vhost", self.name)
        rabbitmqctl("set_permissions", "-p", self.name, user, ".*", ".*", ".*")
        return self

    def delete(self) -> None:
        rabbitmqctl("delete_vhost", self.name)

    def queues_purge(self) -> None:
        """Drop every message left in the FairQueue queues (a test's leftovers)."""
        with Connection(self.url) as conn:
            for queue in task_queues(self.url):
                queue(conn.default_channel).declare()
                queue(conn.default_channel).purge()

    def ready_count(self, queue_name: str = JOBS_QUEUE) -> int:
        """Messages waiting in `queue_name` (not counting deliveries not yet acknowledged)."""
        with Connection(self.url) as conn:
            for queue in task_queues(self.url):
                if queue.name == queue_name:
                    _, count, _ = queue(conn.default_channel).queue_declare(passive=True)
                    return int(count)
        raise KeyError(queue_name)


def _celery_conf_apply(conf: dict[str, Any]) -> None:
    app.conf.update(conf)
    # Forget what the app built for the previous broker: its connection pool, and the amqp
    # helper holding the declared queues, the router and the producer pool. The pools
    # themselves stay open in kombu's registry, keyed by broker URL, so switching back
    # finds them working (closing one would close it for good); those of a test class's
    # virtual host end when the host is deleted.
    app._pool = None
    app.__dict__.pop("amqp", None)


def celery_broker_use(url: str) -> Callable[[], None]:
    """Point this process's Celery app (and `settings.CELERY_BROKER_URL`) at `url`; returns
    the function that restores the broker it had."""
    saved = {key: app.conf[key] for key in BROKER_CONF_KEYS}
    visibility = int(saved["broker_transport_options"].get("visibility_timeout", 0))
    _celery_conf_apply(
        {
            "broker_url": url,
            "task_queues": task_queues(url),
            "broker_transport_options": broker_transport_options(url, visibility_timeout=visibility),
        }
    )
    overridden = override_settings(CELERY_BROKER_URL=url)
    overridden.enable()

    def restore() -> None:
        overridden.disable()
        _celery_conf_apply(saved)

    return restore


class RabbitMQBrokerMixin:
    """Runs a test class with Celery on RabbitMQ: a fresh virtual host for the class,
    emptied around each test and deleted afterwards; publishing from this process and the
    workers the tests start both go there."""

    vhost: Vhost

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()  # type: ignore[misc]
        cls.vhost = Vhost().create()
        cls.addClassCleanup(cls.vhost.delete)  # type: ignore[attr-defined]
        cls.addClassCleanup(celery_broker_use(cls.vhost.url))  # type: ignore[attr-defined]

    def setUp(self) -> None:
        self.vhost.queues_purge()
        super().setUp()  # type: ignore[misc]
