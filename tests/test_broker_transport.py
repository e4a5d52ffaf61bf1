"""A FairQueue worker's Redis broker transport (fairqueue/jobs/broker_transport.py): a
channel left behind by a lost connection fails with a connection error, which Celery
recovers from, never with the AttributeError that stopped a worker's consumer for good."""

from __future__ import annotations

from django.conf import settings
from django.test import SimpleTestCase
from kombu import Connection

from fairqueue.celery import app
from fairqueue.jobs.broker_transport import TRANSPORT, transport_for
from tests.workers import WorkerProcess


def _pool_after_collect(transport: str | None) -> BaseException | None:
    """What a consumer's channel raises for a new connection pool once Celery's consumer has
    `collect()`ed its connection (as it does when the broker goes away): what a later close
    retrying the restore of unacknowledged deliveries, or a job's acknowledgement, meets.
    (The whole race, a worker's broker restarting under load, is the chaos test's.)"""
    conn = Connection(settings.CELERY_BROKER_URL, transport=transport)
    channel = conn.default_channel
    conn.collect()  # closes the channel, then detaches its transport
    try:
        channel._connparams()
    except Exception as exc:
        return exc
    return None


class DetachedChannelTests(SimpleTestCase):
    def test_kombus_own_transport_raises_attribute_error_which_celery_calls_unrecoverable(self) -> None:
        # The defect the transport is for: should kombu fix it, this fails and the
        # transport can go.
        self.assertIsInstance(_pool_after_collect(None), AttributeError)

    def test_fairqueues_transport_raises_a_connection_error_celery_reconnects_from(self) -> None:
        error = _pool_after_collect(TRANSPORT)
        with Connection(settings.CELERY_BROKER_URL, transport=TRANSPORT) as conn:
            connection_errors = conn.connection_errors
        self.assertIsInstance(error, connection_errors)
        self.assertNotIsInstance(error, AttributeError)


class TransportChoiceTests(SimpleTestCase):
    def test_redis_brokers_get_it_unless_the_project_chose_a_transport(self) -> None:
        self.assertEqual(transport_for("redis://127.0.0.1:6379/0", None), TRANSPORT)
        self.assertEqual(transport_for("redis://127.0.0.1:6379/0", "redis"), TRANSPORT)
        self.assertIsNone(transport_for("redis://127.0.0.1:6379/0", "myproject.transport:Transport"))
        self.assertIsNone(transport_for("amqp://guest@127.0.0.1//", None))
        self.assertIsNone(transport_for("rediss://127.0.0.1:6380/0", None))  # kombu's TLS defaults

    def test_a_fairqueue_worker_reads_the_broker_with_it(self) -> None:
        worker = WorkerProcess(slots=1, name="transport").start()
        self.addCleanup(worker.terminate)
        replies = app.control.inspect(destination=[worker.hostname], timeout=5).conf(with_defaults=True) or {}
        self.assertEqual(replies[worker.hostname]["broker_transport"], TRANSPORT)
