"""What a worker would fetch from the broker before a delivery published now (the check
behind the slot handoff of issue 19), on the real broker."""

from __future__ import annotations

from kombu import Message

from fairqueue.celery import app
from fairqueue.jobs.admission import PRIORITY_LEVELS
from fairqueue.jobs.broker import (
    BATCH_QUEUE,
    BATCH_ROUTE,
    JOBS_QUEUE,
    deliveries_ahead,
    delivery_publish,
    delivery_route,
)
from tests.base import RedisTestCase

BOTH_QUEUES = [JOBS_QUEUE, BATCH_QUEUE]


class BrokerBacklogTests(RedisTestCase):
    """What a worker would fetch before a delivery published now, on the real broker."""

    def test_a_class_waits_behind_itself_and_higher_classes_only(self) -> None:
        self.assertFalse(deliveries_ahead(delivery_route(level=3, batch=False), BOTH_QUEUES))
        delivery_publish("00000000-0000-0000-0000-000000000001.0", delivery_route(level=3, batch=False))
        self.assertTrue(deliveries_ahead("3", BOTH_QUEUES), "the same class, published earlier")
        self.assertTrue(deliveries_ahead("7", BOTH_QUEUES), "a lower class")
        self.assertFalse(deliveries_ahead("2", BOTH_QUEUES), "a higher class goes first")
        self.assertTrue(deliveries_ahead(BATCH_ROUTE, BOTH_QUEUES), "the batch lane goes after every class")

    def test_a_worker_fetches_every_class_before_the_batch_lane(self) -> None:
        batch_job, low_class_job = "00000000-0000-0000-0000-000000000003", "00000000-0000-0000-0000-000000000004"
        delivery_publish(f"{batch_job}.0", BATCH_ROUTE)
        delivery_publish(f"{low_class_job}.0", delivery_route(level=PRIORITY_LEVELS - 1, batch=False))
        fetched: list[str] = []

        def take(body: list[list[object]], message: Message) -> None:
            fetched.append(str(body[0][0]))
            message.ack()

        # The fetch a worker makes: one BRPOP over every (queue, level) list.
        conn = app.connection_for_read()
        with conn, conn.Consumer(list(app.amqp.queues.values()), callbacks=[take], accept=["json"]):
            while len(fetched) < 2:
                conn.drain_events(timeout=5)
        self.assertEqual(fetched, [low_class_job, batch_job])

    def test_a_waiting_batch_delivery_is_ahead_of_a_batch_job_only_for_a_worker_reading_the_lane(self) -> None:
        delivery_publish("00000000-0000-0000-0000-000000000002.0", BATCH_ROUTE)
        self.assertTrue(deliveries_ahead(BATCH_ROUTE, BOTH_QUEUES))
        self.assertFalse(deliveries_ahead("0", BOTH_QUEUES), "the highest class goes before the lane")
        self.assertFalse(deliveries_ahead("0", [JOBS_QUEUE]))
