"""The submit's own shapes against the general paths they stand in for: the rows a bulk
writes (one COPY on PostgreSQL, fairqueue.jobs.copy_insert) hold what the same jobs
submitted one by one hold, a taken idempotency key refuses the whole COPY, a lone row's
INSERT (built once per process on PostgreSQL) writes what `save()` writes, and a delivery's
message built from a template (fairqueue.jobs.broker, Redis transport) is the one Celery's
send_task publishes."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import datetime, timedelta
from typing import Any

from celery import signals
from django.db import IntegrityError, connection, transaction
from django.db.models.signals import post_init
from django.forms.models import model_to_dict
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from fairqueue.jobs import broker, fastinit, selectors
from fairqueue.jobs.api import JobOut, api
from fairqueue.jobs.copy_insert import rows_copy
from fairqueue.jobs.models import Job
from fairqueue.jobs.submission import JobRequest, _insert_one, job_submit, job_submit_bulk
from tenants.policy import policy_invalidate
from tests.base import RedisTestCase
from tests.factories import make_tenant

BULK = "/api/v1/jobs/bulk"
# Fields set per row or per moment, not by the request.
PER_ROW = {"id", "submitted_at", "admitted_at", "timeline", "idempotency_key", "run_at", "due_at"}


def varied_requests(prefix: str) -> list[JobRequest]:
    """Jobs that use every part of a row a submit writes."""
    return [
        JobRequest(task="demo.noop", idempotency_key=f"{prefix}-0"),
        JobRequest(
            task="demo.sleep",
            args={"seconds": 0.5, "echo": {"note": "ünïcode \u2603", "list": [1, 2.5, None, True]}},
            sub_tenant="cust-1",
            priority="default",
            idempotency_key=f"{prefix}-1",
            timeout_seconds=3.5,
            max_attempts=1,
        ),
        JobRequest(task="demo.noop", delay_seconds=3600, idempotency_key=f"{prefix}-2"),
        JobRequest(task="demo.noop", run_at="2020-01-01T00:00:00Z", idempotency_key=f"{prefix}-3"),
        JobRequest(task="demo.noop", batch=True, idempotency_key=f"{prefix}-4"),
    ]


def row(job_id: Any) -> dict[str, Any]:
    job = Job.objects.get(id=job_id)
    return {k: v for k, v in model_to_dict(job).items() if k not in PER_ROW}


class BulkRowsTests(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, _ = make_tenant("acme", batch_enabled=True, floor=100)
        policy_invalidate()

    def test_a_bulk_writes_the_rows_single_submits_write(self) -> None:
        with CaptureQueriesContext(connection) as queries:
            bulk = job_submit_bulk(tenant=self.tenant, reqs=varied_requests("bulk"))
        singles = [job_submit(tenant=self.tenant, req=req) for req in varied_requests("one")]
        if connection.vendor == "postgresql":
            self.assertTrue(any(q["sql"].startswith('COPY "jobs_job"') for q in queries.captured_queries))
        for b, s in zip(bulk, singles, strict=True):
            self.assertEqual(row(b.job.id), row(s.job.id))
            stored = Job.objects.get(id=b.job.id)
            self.assertEqual((stored.status, stored.admitted_at), (b.job.status, b.job.admitted_at))
            self.assertIsNotNone(stored.submitted_at)
            self.assertEqual(
                (stored.run_at is None, stored.due_at is None), (s.job.run_at is None, s.job.due_at is None)
            )
        # The objects a bulk returns are saved rows: a later save() updates them.
        job = bulk[0].job
        job.error = "edited"
        job.save(update_fields=["error"])
        self.assertEqual(Job.objects.get(id=job.id).error, "edited")

    def test_a_taken_idempotency_key_refuses_the_whole_write(self) -> None:
        job_submit(tenant=self.tenant, req=JobRequest(task="demo.noop", idempotency_key="taken"))
        fresh = [Job(tenant=self.tenant, task="demo.noop", latency_class="default") for _ in range(3)]
        fresh[1].idempotency_key = "taken"
        with self.assertRaises(IntegrityError), transaction.atomic():
            if connection.vendor == "postgresql":
                rows_copy(Job, fresh)
            else:
                Job.objects.bulk_create(fresh)
        self.assertFalse(Job.objects.filter(id__in=[j.id for j in fresh]).exists())


def job_values(tenant: Any, n: int, now: Any = None) -> dict[str, Any]:
    """What a submit gives `Job(...)`, varied: the rest comes from the fields' defaults."""
    now = now or timezone.now()
    return {
        "id": uuid.uuid4(),
        "engine_tag": "s:main",
        "engine_keys": "s:main\x1ft:acme",
        "tenant": tenant,
        "sub_tenant": "cust-1" if n % 2 else "",
        "task": "demo.sleep" if n % 2 else "demo.noop",
        "latency_class": "default",
        "priority": n % 3,
        "batch": n == 2,
        "idempotency_key": f"key-{n}" if n % 2 else None,
        "args": {"seconds": 0.5, "echo": {"note": "ünïcode \u2603", "n": n}} if n % 2 else {},
        "timeout_seconds": 3.5 if n == 1 else None,
        "callback_url": "",
        "resources": "",
        "run_at": now if n == 3 else None,
        "due_at": now + timedelta(hours=1) if n == 3 else None,
        "max_attempts": 1 + n,
        "status": "scheduled" if n == 3 else "queued",
        "traceparent": "",
    }


class FastInitTests(RedisTestCase):
    """A bulk's Job instances come from `fastinit.builder`, not `Job(...)`: the same
    instances, and the same rows once written."""

    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, _ = make_tenant("acme", batch_enabled=True, floor=100)
        policy_invalidate()

    def test_a_built_job_is_the_instance_job_init_builds(self) -> None:
        build = fastinit.builder(Job)
        self.assertIsNot(build, Job)
        for n in range(4):
            # submitted_at's default is the clock: the same for both when given, as a submit does.
            values = {**job_values(self.tenant, n), "submitted_at": timezone.now()}
            fast, slow = build(**values), Job(**values)
            with self.subTest(n=n):
                plain = {k: v for k, v in vars(slow).items() if k != "_state"}
                self.assertEqual([k for k in vars(fast) if k != "_state"], list(plain))  # the same order too
                self.assertEqual({k: v for k, v in vars(fast).items() if k != "_state"}, plain)
                self.assertEqual(
                    (fast._state.adding, fast._state.db, fast._state.fields_cache),
                    (slow._state.adding, slow._state.db, slow._state.fields_cache),
                )
                self.assertEqual(fast._state.db, "default")  # set by the tenant's descriptor, as in __init__
                self.assertIs(fast.tenant, self.tenant)
        # A callable default gives each instance its own value.
        a, b = build(**job_values(self.tenant, 0)), build(**job_values(self.tenant, 0))
        self.assertEqual((a.attempt_history, b.attempt_history), ([], []))
        self.assertIsNot(a.attempt_history, b.attempt_history)

    def test_what_the_builder_does_not_handle_goes_through_init(self) -> None:
        build = fastinit.builder(Job)
        with self.assertRaises(TypeError):
            build(task="demo.noop", no_such_field=1)
        both = {"task": "demo.noop", "tenant": self.tenant, "tenant_id": self.tenant.pk}
        self.assertEqual(vars(build(**both))["tenant_id"], vars(Job(**both))["tenant_id"])
        seen: list[Any] = []

        def receiver(sender: Any, instance: Any, **kwargs: Any) -> None:
            seen.append(instance)

        post_init.connect(receiver, sender=Job)
        try:
            build = fastinit.builder(Job)
            self.assertIs(build, Job)
            build(task="demo.noop")
            self.assertEqual(len(seen), 1)
        finally:
            post_init.disconnect(receiver, sender=Job)

    def test_built_jobs_write_the_rows_init_built_jobs_write(self) -> None:
        build = fastinit.builder(Job)
        now = timezone.now()
        fast = [build(**job_values(self.tenant, n, now)) for n in range(4)]
        slow = [Job(**{**job_values(self.tenant, n, now), "idempotency_key": None}) for n in range(4)]
        with transaction.atomic():
            if connection.vendor == "postgresql":
                rows_copy(Job, fast + slow)
            else:
                Job.objects.bulk_create(fast + slow)
        # Each row's own: its id, and the time the write stamps (auto_now_add).
        own = ("id", "idempotency_key", "submitted_at")
        columns = [f.column for f in Job._meta.concrete_fields if f.column not in own]
        table = connection.ops.quote_name(Job._meta.db_table)
        select = ", ".join(connection.ops.quote_name(c) for c in columns)
        for f, s in zip(fast, slow, strict=True):
            with connection.cursor() as cursor:
                ids = [Job._meta.pk.get_db_prep_value(j.pk, connection) for j in (f, s)]
                cursor.execute(f"SELECT {select} FROM {table} WHERE id IN (%s, %s)", ids)
                rows = cursor.fetchall()
            self.assertEqual(len(rows), 2)
            self.assertEqual(rows[0], rows[1])


def every_field_job(tenant: Any, n: int, at: datetime) -> Job:
    """A new job with every column set away from its default (JSON with unicode, times, nulls)."""
    return Job(
        tenant=tenant,
        sub_tenant=f"cust-{n}",
        task="demo.sleep",
        args={"seconds": 0.5, "echo": {"note": "ünïcode \u2603", "list": [1, 2.5, None, True]}, "n": n},
        args_ref=f"ref-{n}",
        latency_class="default",
        priority=3,
        batch=True,
        promoted_at=at,
        idempotency_key=f"key-{n}",
        timeout_seconds=3.25,
        status="parked",
        attempts=2,
        worker_losses=1,
        generation=4,
        worker="w1",
        admitted_at=at,
        started_at=at + timedelta(seconds=1),
        finished_at=None,
        result={"ok": [1, "two"]},
        result_ref="rr",
        error="Err: ü",
        error_reason="exception",
        engine_tag="{bench}",
        engine_keys="a b c",
        callback_url="https://example.com/hook",
        resources="api db",
        traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        timeline="submitted 1\nadmitted 2\n",
        release_pending=True,
        run_at=at + timedelta(hours=1),
        due_at=at + timedelta(hours=2),
        max_attempts=5,
        attempt_failures=1,
        attempt_history=[{"attempt": 1, "status": "failed", "error": "x"}],
    )


class SingleRowTests(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, _ = make_tenant("acme", floor=100)

    def columns(self, job: Job) -> dict[str, Any]:
        values = Job.objects.filter(id=job.id).values().get()
        return {k: v for k, v in values.items() if k not in ("id", "idempotency_key", "submitted_at")}

    def test_the_submits_insert_writes_what_save_writes(self) -> None:
        # More rows than psycopg's prepare threshold (5): the later INSERTs run prepared.
        at = timezone.now() - timedelta(minutes=5)
        for n in range(8):
            fast, orm = every_field_job(self.tenant, n, at), every_field_job(self.tenant, n, at)
            orm.idempotency_key = f"orm-{n}"
            with CaptureQueriesContext(connection) as queries:
                _insert_one(fast)
            orm.save(force_insert=True)
            self.assertEqual([q["sql"][:23] for q in queries.captured_queries], ['INSERT INTO "jobs_job" '])
            self.assertEqual(self.columns(fast), self.columns(orm))
            stored = Job.objects.get(id=fast.id)
            self.assertEqual(stored.submitted_at, fast.submitted_at)  # auto_now_add set on the object too
            self.assertEqual(stored.idempotency_key, f"key-{n}")
        # Saved: a later save() updates the row rather than inserting it again.
        fast.error = "edited"
        fast.save()
        self.assertEqual(Job.objects.get(id=fast.id).error, "edited")

    def test_defaults_and_nulls_are_written_as_save_writes_them(self) -> None:
        fast = Job(tenant=self.tenant, task="demo.noop", latency_class="default")
        orm = Job(tenant=self.tenant, task="demo.noop", latency_class="default")
        _insert_one(fast)
        orm.save(force_insert=True)
        self.assertEqual(self.columns(fast), self.columns(orm))

    def test_a_taken_idempotency_key_is_an_integrity_error_and_the_transaction_goes_on(self) -> None:
        at = timezone.now()
        _insert_one(every_field_job(self.tenant, 1, at))
        with transaction.atomic():
            with self.assertRaises(IntegrityError), transaction.atomic():
                _insert_one(every_field_job(self.tenant, 1, at))
            other = every_field_job(self.tenant, 2, at)
            _insert_one(other)
        self.assertEqual(Job.objects.filter(tenant=self.tenant).count(), 2)
        self.assertTrue(Job.objects.filter(id=other.id).exists())


class BulkAnswerTests(RedisTestCase):
    def test_the_bulk_answer_is_what_ninja_renders_for_the_same_jobs(self) -> None:
        policy_invalidate()
        with self.captureOnCommitCallbacks(execute=True):
            _, key = make_tenant("acme", batch_enabled=True, floor=100)
        policy_invalidate()
        later = (timezone.now() + timedelta(days=2)).isoformat()
        sleep = {"task": "demo.sleep", "args": {"seconds": 0.5}}
        jobs = [
            {"task": "demo.noop", "args": {}},
            {**sleep, "sub_tenant": "c", "idempotency_key": "k", "batch": True},
            {"task": "demo.noop", "run_at": later, "timeout_seconds": 2.5},
            {"task": "demo.noop", "delay_seconds": 90.25, "max_attempts": 1},
        ]
        auth = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
        response = Client().post(BULK, data=json.dumps({"jobs": jobs}), content_type="application/json", **auth)
        self.assertEqual(response.status_code, 202, response.content)
        self.assertEqual(response["Content-Type"], api.get_content_type())
        answered = json.loads(response.content)
        jobs = [Job.objects.get(id=j["id"]) for j in answered]
        # What ninja answers for `list[JobOut]`: each job validated, then its renderer.
        dumped = [JobOut.model_validate(selectors.job_to_dict(job)).model_dump() for job in jobs]
        rendered = json.loads(api.renderer.render(None, dumped, response_status=202))  # type: ignore[arg-type]
        self.assertEqual(answered, rendered)
        self.assertIsNotNone(answered[2]["run_at"])
        self.assertIsNotNone(answered[3]["next_attempt_at"])


class MessageTemplateTests(RedisTestCase):
    def broker_messages(self) -> dict[bytes, list[dict[str, Any]]]:
        """Every message in the broker's lists, by list (and the lists emptied)."""
        found = {}
        for key in sorted(self.redis.keys("*")):
            if self.redis.type(key) == b"list":
                found[key] = [json.loads(m) for m in self.redis.lrange(key, 0, -1)]
                self.redis.delete(key)
        return found

    def comparable(self, message: dict[str, Any]) -> dict[str, Any]:
        """The message with its fresh ids named, not spelled out, and its body decoded."""
        task_id = message["headers"]["id"]
        uuid.UUID(task_id)
        uuid.UUID(message["properties"]["delivery_tag"])
        text = json.dumps(message).replace(task_id, "<task id>")
        out = json.loads(text)
        out["properties"]["delivery_tag"] = "<tag>"
        out["body"] = base64.b64decode(out["body"]).decode()  # as written, byte for byte
        return out

    def test_a_templated_message_is_the_one_send_task_publishes(self) -> None:
        deliveries = [
            (f"{uuid.uuid4()}.0", broker.delivery_route(level=5, batch=False)),
            (f"{uuid.uuid4()}.2", broker.delivery_route(level=0, batch=True)),
            (f"{uuid.uuid4()}.1", broker.delivery_route(level=5, batch=False)),
            (f"{uuid.uuid4()}.0", broker.delivery_route(level=9, batch=False)),
            (f"{uuid.uuid4()}.3", broker.delivery_route(level=0, batch=False)),
        ]
        with broker.app.producer_pool.acquire(block=True) as producer:
            self.assertTrue(broker._templated(producer, deliveries))
        # In two publishes: the second from the templates the first built. The first has two
        # deliveries for one list (one LPUSH of both, which must leave them in order).
        broker.deliveries_publish(deliveries[:3])
        broker.deliveries_publish(deliveries[3:])
        templated = self.broker_messages()
        for engine_id, route in deliveries:  # one by one, through send_task
            with broker.app.producer_pool.acquire(block=True) as producer:
                broker.app.send_task(
                    broker.RUN_TASK_NAME,
                    args=list(broker.split_engine_id(engine_id)),
                    queue=broker.delivery_queue(route),
                    priority=broker.message_target(broker.route_level(route), amqp=False)[1],
                    producer=producer,
                    declare=[],
                )
        sent = self.broker_messages()
        self.assertEqual(list(templated), list(sent))
        self.assertEqual(sum(len(m) for m in templated.values()), len(deliveries))
        for key, messages in templated.items():
            self.assertEqual([self.comparable(m) for m in messages], [self.comparable(m) for m in sent[key]])
        every = [m for ms in templated.values() for m in ms]
        self.assertEqual(len({m["headers"]["id"] for m in every}), len(every))
        self.assertEqual(len({m["properties"]["delivery_tag"] for m in every}), len(every))

    def test_the_configuration_read_once_is_celerys(self) -> None:
        broker.deliveries_publish([(f"{uuid.uuid4()}.0", "5")])  # read by now
        conf = broker.app.conf
        self.assertIs(
            broker._conf_templatable(),
            conf.task_serializer == "json" and not conf.task_compression and not conf.task_send_sent_event,
        )
        self.assertTrue(broker._conf_templatable())  # this project's configuration: templates

    def test_a_publish_signal_receiver_sees_every_delivery(self) -> None:
        seen: list[str] = []

        def receiver(sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
            seen.append(headers["id"])

        signals.before_task_publish.connect(receiver)
        self.addCleanup(signals.before_task_publish.disconnect, receiver)
        deliveries = [(f"{uuid.uuid4()}.0", "5") for _ in range(3)]
        broker.deliveries_publish(deliveries)
        self.assertEqual(len(seen), 3)
        self.assertEqual(sum(len(m) for m in self.broker_messages().values()), 3)
