"""Both Celery brokers, Redis and RabbitMQ: the latency-class order a worker reads in, and
the jobs end-to-end tests (real workers, SIGKILL re-delivery) on RabbitMQ.

The Redis variants of the end-to-end tests are tests/test_jobs_e2e.py itself; here they
run again with every message going through a RabbitMQ virtual host of their own.
"""

from __future__ import annotations

import time
import uuid

from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import SimpleTestCase, override_settings
from kombu import Consumer
from kombu.message import Message

from fairqueue.bench.noisy import BROKER_COMPARED
from fairqueue.bench.stack import amqp_queues_waiting
from fairqueue.celery import app
from fairqueue.jobs.broker import delivery_publish, delivery_route
from fairqueue.jobs.models import Job, JobStatus, LedgerEntry
from fairqueue.queues import (
    AMQP_BATCH_PRIORITY,
    AMQP_MAX_PRIORITY,
    BATCH_QUEUE,
    JOBS_QUEUE,
    PRIORITY_LEVELS,
    UnsupportedBroker,
    broker_is_amqp,
    message_target,
    task_queues,
)
from tests import test_jobs_e2e as e2e
from tests.base import RedisTestCase
from tests.factories import quarantine_lane_off
from tests.rabbitmq import RabbitMQBrokerMixin, Vhost
from tests.test_bench_noisy import bench_noisy_run, bench_redis_url
from tests.workers import WorkerProcess, wait_for

# (route, name) in publishing order; a worker must take them in ORDER_EXPECTED.
PUBLISHED = [
    (delivery_route(level=0, batch=True), "batch-1"),
    (delivery_route(level=PRIORITY_LEVELS - 1, batch=False), "lowest-class"),
    (delivery_route(level=0, batch=False), "highest-1"),
    (delivery_route(level=5, batch=False), "middle"),
    (delivery_route(level=3, batch=True), "batch-2"),  # a batch delivery's class level plays no part
    (delivery_route(level=0, batch=False), "highest-2"),
]
ORDER_EXPECTED = ["highest-1", "highest-2", "middle", "lowest-class", "batch-1", "batch-2"]
DRAIN_DEADLINE_S = 30.0
# Celery logs each task's return value; job_execute returns "skipped" for a delivery whose
# generation was already claimed (or finished).
SKIPPED_LOG = ": 'skipped'"


class PriorityMappingTests(SimpleTestCase):
    def test_each_transport_reads_the_highest_class_first_and_the_batch_lane_last(self) -> None:
        self.assertEqual(message_target(0, amqp=False), (JOBS_QUEUE, 0))  # kombu Redis: lowest number first
        self.assertEqual(message_target(PRIORITY_LEVELS - 1, amqp=False), (JOBS_QUEUE, PRIORITY_LEVELS - 1))
        # kombu reads each priority step of every queue before the next step: batch at the last.
        self.assertEqual(message_target(None, amqp=False), (BATCH_QUEUE, PRIORITY_LEVELS - 1))
        self.assertEqual(message_target(0, amqp=True), (JOBS_QUEUE, AMQP_MAX_PRIORITY))  # AMQP: highest first
        self.assertEqual(message_target(PRIORITY_LEVELS - 1, amqp=True), (JOBS_QUEUE, AMQP_BATCH_PRIORITY + 1))
        self.assertEqual(message_target(None, amqp=True), (JOBS_QUEUE, AMQP_BATCH_PRIORITY))
        self.assertEqual(message_target(PRIORITY_LEVELS + 3, amqp=True), message_target(PRIORITY_LEVELS - 1, amqp=True))

    def test_amqp_queues_are_declared_with_their_priorities(self) -> None:
        (jobs,) = task_queues("amqp://guest:guest@127.0.0.1:5672/x")
        self.assertEqual((jobs.name, jobs.queue_arguments), (JOBS_QUEUE, {"x-max-priority": AMQP_MAX_PRIORITY}))
        self.assertEqual([q.name for q in task_queues("redis://127.0.0.1:6379/0")], [JOBS_QUEUE, BATCH_QUEUE])

    def test_an_unsupported_broker_is_refused_with_a_clear_message(self) -> None:
        self.assertTrue(broker_is_amqp("amqps://u:p@rabbit:5671/fq"))
        self.assertFalse(broker_is_amqp("rediss://redis:6380/0"))
        with self.assertRaisesRegex(UnsupportedBroker, "redis://... or amqp://"):
            broker_is_amqp("sqs://key:secret@")


class BrokerOrderTests(RedisTestCase):
    """Publish deliveries of every kind, then take them one at a time the way a worker
    does (a consumer on the worker's queues, one message unacknowledged at a time)."""

    def drain_in_order(self, names: dict[str, str]) -> list[str]:
        """The names of the deliveries (by job id) in the order a consumer got them."""
        taken: list[str] = []

        def on_message(body: tuple[list[str], dict[str, object], dict[str, object]], message: Message) -> None:
            args, _kwargs, _embed = body
            taken.append(names[args[0]])
            message.ack()

        with app.connection_for_read() as conn:
            consumer = Consumer(conn, queues=list(app.amqp.queues.values()), callbacks=[on_message], accept=["json"])
            consumer.qos(prefetch_count=1, apply_global=broker_is_amqp(app.conf.broker_url))
            with consumer:
                deadline = time.monotonic() + DRAIN_DEADLINE_S
                while len(taken) < len(names) and time.monotonic() < deadline:
                    try:
                        conn.drain_events(timeout=1)
                    except TimeoutError:
                        continue
        return taken

    def test_a_worker_takes_the_highest_class_first_and_the_batch_lane_last(self) -> None:
        names = {}
        for route, name in PUBLISHED:
            job_id = str(uuid.uuid4())
            names[job_id] = name
            delivery_publish(f"{job_id}.0", route)
        self.assertEqual(self.drain_in_order(names), ORDER_EXPECTED)


class BrokerOrderOnRabbitMQTests(RabbitMQBrokerMixin, BrokerOrderTests):
    def test_the_publisher_follows_the_broker_the_app_is_set_to(self) -> None:
        self.assertEqual(settings.CELERY_BROKER_URL, self.vhost.url)
        delivery_publish(f"{uuid.uuid4()}.0", delivery_route(level=1, batch=True))
        self.assertEqual(self.vhost.ready_count(JOBS_QUEUE), 1)  # the batch lane is fq.jobs here

    def test_a_worker_cannot_leave_out_the_batch_lane_on_rabbitmq(self) -> None:
        with self.assertRaisesRegex(CommandError, "--no-batch needs the Redis broker"):
            call_command("worker", "--no-batch")


class JobsEndToEndOnRabbitMQTests(RabbitMQBrokerMixin, e2e.E2EBase):
    """The jobs end-to-end tests whose outcome goes through the broker, with RabbitMQ as
    the broker. Left out: payloads by reference and cancelling a parked job, whose paths
    never reach the broker (a delivery is a job id and a generation, whatever its size)."""

    _e2e = e2e.JobsEndToEndTests
    test_jobs_run_on_a_real_worker_and_report_their_result = _e2e.test_jobs_run_on_a_real_worker_and_report_their_result
    test_a_tenant_capped_at_two_never_runs_more_than_two = _e2e.test_a_tenant_capped_at_two_never_runs_more_than_two
    test_a_parked_job_takes_no_worker_slot = _e2e.test_a_parked_job_takes_no_worker_slot
    test_higher_latency_classes_run_first = _e2e.test_higher_latency_classes_run_first


class WorkerLossOnRabbitMQTests(RabbitMQBrokerMixin, e2e.WorkerLossTests):
    """The SIGKILL test on RabbitMQ, plus what only RabbitMQ does: give a dead worker's
    unacknowledged delivery to another worker at once, while its lease still runs."""

    def test_the_brokers_own_redelivery_never_runs_a_job_twice(self) -> None:
        _, key = e2e._tenant("fragile-amqp")
        quarantine_lane_off()  # this test is about re-delivery to a normal survivor
        lease = {"FAIRQUEUE_LEASE_SECONDS": "2"}
        with override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "LEASE_SECONDS": 2.0}):
            workers = {w.hostname: w for w in (WorkerProcess(slots=1, **lease).start() for _ in range(2))}
            blocker = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 3.0}})
            wait_for(lambda: Job.objects.get(id=blocker["id"]).status == JobStatus.RUNNING, message="blocker")
            job = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 2.0}})
            running = wait_for(
                lambda: (j := Job.objects.get(id=job["id"])).status == JobStatus.RUNNING and j, message="job to start"
            )
            victim = workers.pop(running.worker)
            (survivor,) = workers.values()
            victim.kill()
            # RabbitMQ hands the dead worker's unacknowledged delivery to the survivor as
            # soon as it has a free slot, while the job's running lease may still hold:
            # that delivery finds its generation already claimed and does nothing.
            wait_for(lambda: SKIPPED_LOG in survivor.log_path.read_text(), timeout=30, message="the redelivery")
            wait_for(
                lambda: Job.objects.get(id=job["id"]).status == JobStatus.SUCCEEDED, timeout=60, message="the re-run"
            )
            self.wait_all_finished([blocker["id"]])
        row = Job.objects.get(id=job["id"])
        self.assertEqual((row.attempts, row.worker_losses, row.worker), (2, 1, survivor.hostname))
        self.assertEqual(LedgerEntry.objects.get(job_id=row.id).writes, 1)
        self.assertEqual(self.vhost.ready_count(), 0)


class BenchNoisyBrokerSmokeTests(SimpleTestCase):
    def test_the_fair_mode_runs_on_both_brokers_in_one_run(self) -> None:
        url = bench_redis_url()
        vhost = Vhost("fq_bench_test").create()
        self.addCleanup(vhost.delete)
        argv = ["--smoke", "--modes", "fair", "--redis-url", url, "--broker-url", vhost.url]
        doc, stdout = bench_noisy_run(self, argv, unset=("CELERY_BROKER_URL",))
        self.assertEqual(list(doc["brokers"]), ["redis", "amqp"])
        self.assertEqual(doc["brokers"]["amqp"]["url"], f"amqp://127.0.0.1:5672/{vhost.name}")  # no credentials
        for broker in doc["brokers"].values():
            fair = broker["modes"]["fair"]
            self.assertEqual((fair["jobs"], fair["failed"]), (doc["workload"]["jobs_planned"], 0))
        self.assertEqual(doc["modes"], doc["brokers"]["redis"]["modes"])
        self.assertEqual(set(doc["broker_comparison"]["amqp"]["fair"]), set(BROKER_COMPARED))
        self.assertIn("amqp / redis, fair:", stdout)
        self.assertEqual(amqp_queues_waiting(vhost.url), 0, "the bench must leave its virtual host empty")
