"""The submit path's shape: what one submit costs in database statements and Redis
commands (counted, not timed), and the API-key cache: a rotated key or a deactivated
tenant stops working within a second, through a real web server process, and the
cache's answer without I/O (the async API's event loop) follows the same rules."""

from __future__ import annotations

import json
import time
from typing import Any

import redis
import requests
from django.conf import settings
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from fairqueue.bench.stack import GunicornServer
from fairqueue.jobs.models import Job, JobStatus
from tenants.authentication import authentication_cache_clear, tenant_authenticate_cached, tenant_authenticate_nowait
from tenants.keys import SYNCED_KEY
from tenants.policy import CHECK_INTERVAL_SECONDS, policy_invalidate
from tests.base import RedisTestCase, RedisTransactionTestCase
from tests.factories import make_tenant
from tests.redis_commands import ProcessCommands
from tests.workers import LOG_DIR, wait_for, worker_env

JOBS = "/api/v1/jobs"
BULK = "/api/v1/jobs/bulk"
NOOP = {"task": "demo.noop", "args": {}}
SUBMITS = 20
# An admitted submit is one FCALL (the engine runs four commands inside it: the clock, one
# HMGET, one HSET, the lease ZADD) and one LPUSH of the delivery, plus its entry into its
# two cells (fairqueue.jobs.cells), an EVALSHA before the row is written, with its quota
# checks (fairqueue.jobs.quotas), that runs fifteen commands inside: the tenant's waiting
# count (HMGET) and the memory guard's cap (GET), the job's cells read and written, per
# cell its set's ZADD, the summary's ZCARD, ZRANGE and HSET and the changes log's ZADD,
# and the summary's version (INCR) once (dashboard.snapshot reads only the cells changed
# since).
REDIS_PER_ADMITTED_SUBMIT = 6 + 16
# Once-a-second work any of the submits may fall on (the policy check, the tenant's signals,
# the submission counters): a bound for the whole run, not per submit.
REDIS_PERIODIC_ALLOWANCE = 40
INVALIDATION_DEADLINE_S = 5.0


class SubmitCostTests(RedisTransactionTestCase):
    """Autocommit, as in production: no test transaction around the statements counted."""

    serialized_rollback = True  # the latency classes the migrations seed

    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        authentication_cache_clear()
        _, self.key = make_tenant("acme", floor=1000, shard_capacity=1000)  # mirrored at its commit
        self.client = Client()

    def post(self, path: str, body: Any) -> Any:
        response = self.client.post(
            path, data=json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {self.key}"
        )
        self.assertEqual(response.status_code, 202, response.content)
        return response.json()

    def test_a_submit_is_one_insert_one_engine_call_and_one_publish(self) -> None:
        self.post(JOBS, NOOP)  # warm up: the key, the policy, the tenant's signals
        with CaptureQueriesContext(connection) as queries, ProcessCommands(settings.REDIS_URL) as own:
            for _ in range(SUBMITS):
                self.post(JOBS, NOOP)
        redis_delta = own.counts
        statements = [q["sql"] for q in queries.captured_queries]
        self.assertEqual(len(statements), SUBMITS, statements[:5])  # no key lookup, no second write
        self.assertTrue(all(sql.startswith('INSERT INTO "jobs_job"') for sql in statements), statements[:5])
        self.assertEqual(redis_delta.get("cmdstat_fcall"), SUBMITS, redis_delta)
        self.assertEqual(redis_delta.get("cmdstat_lpush"), SUBMITS, redis_delta)
        self.assertLessEqual(
            sum(redis_delta.values()), SUBMITS * REDIS_PER_ADMITTED_SUBMIT + REDIS_PERIODIC_ALLOWANCE, redis_delta
        )
        admitted = Job.objects.filter(status=JobStatus.QUEUED, admitted_at__isnull=False).count()
        self.assertEqual(admitted, SUBMITS + 1)

    def test_a_bulk_is_one_insert_one_engine_call_and_one_broker_pipeline(self) -> None:
        self.post(BULK, {"jobs": [NOOP]})  # warm up
        jobs = 20  # one multi-row INSERT on SQLite too (its statements take at most 999 values)
        with CaptureQueriesContext(connection) as queries, ProcessCommands(settings.REDIS_URL) as own:
            self.post(BULK, {"jobs": [NOOP] * jobs})
        redis_delta = own.counts
        statements = [q["sql"] for q in queries.captured_queries if not q["sql"].startswith(("BEGIN", "COMMIT"))]
        self.assertEqual(len(statements), 1, statements)
        # One multi-row INSERT, or on PostgreSQL one COPY (fairqueue.jobs.copy_insert).
        self.assertTrue(statements[0].startswith(('INSERT INTO "jobs_job"', 'COPY "jobs_job"')), statements)
        # One engine call admits the bulk's jobs (lua/admit_jobs.lua), each admission in it
        # as a call of its own (its clock read, PTTL, among them).
        self.assertEqual(redis_delta.get("cmdstat_fcall"), 1, redis_delta)
        self.assertEqual(redis_delta.get("cmdstat_pttl"), jobs, redis_delta)
        # One LPUSH per broker list (one here: one queue and priority), all its messages.
        self.assertEqual(redis_delta.get("cmdstat_lpush"), 1, redis_delta)
        lists = [k for k in self.redis.keys("*") if self.redis.type(k) == b"list"]
        self.assertEqual(sum(self.redis.llen(k) for k in lists), 1 + jobs, lists)  # the warm-up's, the bulk's
        self.assertLessEqual(
            sum(redis_delta.values()), jobs * REDIS_PER_ADMITTED_SUBMIT + REDIS_PERIODIC_ALLOWANCE, redis_delta
        )

    def test_a_parked_submit_is_updated_to_parked_and_not_marked_admitted(self) -> None:
        _, self.key = make_tenant("tiny", max_concurrency=1, floor=1)
        first, second = self.post(JOBS, NOOP), self.post(JOBS, NOOP)
        self.assertEqual(first["status"], JobStatus.QUEUED)
        self.assertIsNotNone(first["admitted_at"])
        self.assertEqual(second["status"], JobStatus.PARKED)
        self.assertIsNone(second["admitted_at"])
        row = Job.objects.get(id=second["id"])
        self.assertEqual((row.status, row.admitted_at), (JobStatus.PARKED, None))


class KeyCacheInvalidationTests(RedisTransactionTestCase):
    """Through a real web server process (gunicorn + uvicorn), whose key cache is its own."""

    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        self.tenant, self.key = make_tenant("acme")
        self.server = GunicornServer(env=worker_env(DEBUG="0"), log_dir=LOG_DIR / "submit-path", processes=1)
        self.server.start()
        self.addCleanup(self.server.stop)
        self.http = requests.Session()

    def submit(self, key: str) -> int:
        response = self.http.post(
            self.server.base_url + JOBS, json=NOOP, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        return response.status_code

    def test_a_rotated_key_stops_working_and_the_new_one_works(self) -> None:
        self.assertEqual(self.submit(self.key), 202)
        self.assertEqual(self.submit(self.key), 202)  # now served from the server's cache
        new_key = self.tenant.rotate_api_key()
        self.tenant.save(update_fields=["api_key_prefix", "api_key_hash", "api_key_rotated_at", "updated_at"])
        rotated = time.monotonic()
        wait_for(lambda: self.submit(self.key) == 401, timeout=INVALIDATION_DEADLINE_S, message="old key refused")
        self.assertLess(time.monotonic() - rotated, INVALIDATION_DEADLINE_S)
        self.assertEqual(self.submit(new_key), 202)
        self.assertEqual(self.submit(self.key), 401)

    def test_a_deactivated_tenant_is_refused_and_a_reactivated_one_served(self) -> None:
        self.assertEqual(self.submit(self.key), 202)
        self.assertEqual(self.submit(self.key), 202)
        self.tenant.active = False
        self.tenant.save()
        wait_for(lambda: self.submit(self.key) == 403, timeout=INVALIDATION_DEADLINE_S, message="tenant refused")
        self.tenant.active = True
        self.tenant.save()
        wait_for(lambda: self.submit(self.key) == 202, timeout=INVALIDATION_DEADLINE_S, message="tenant served")

    def test_a_key_version_lost_with_redis_still_invalidates(self) -> None:
        # Redis flushed (restarted empty): the policy is resynced under a new sync id, which
        # drops the cached keys too, so a rotation made meanwhile is honoured.
        self.assertEqual(self.submit(self.key), 202)
        self.redis.flushdb()
        new_key = self.tenant.rotate_api_key()
        self.tenant.save(update_fields=["api_key_prefix", "api_key_hash", "api_key_rotated_at", "updated_at"])
        wait_for(lambda: self.submit(self.key) == 401, timeout=INVALIDATION_DEADLINE_S, message="old key refused")
        self.assertEqual(self.submit(new_key), 202)
        self.assertEqual(redis.Redis.from_url(settings.REDIS_URL).exists(SYNCED_KEY), 1)


class KeyCacheWithoutIOTests(RedisTestCase):
    """tenant_authenticate_nowait (the async API's check on its event loop) answers only
    what tenant_authenticate_cached would, and only when that needs no Redis or database read."""

    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        authentication_cache_clear()
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, self.key = make_tenant("acme")

    def test_the_cache_alone_answers_only_under_a_fresh_marker(self) -> None:
        self.assertEqual(tenant_authenticate_nowait(raw_key=self.key), (False, None), "nothing cached yet")
        self.assertEqual(tenant_authenticate_cached(raw_key=self.key), self.tenant)
        self.assertEqual(tenant_authenticate_nowait(raw_key=self.key), (True, self.tenant))
        wrong = self.key[:-1] + ("y" if self.key.endswith("x") else "x")  # the same prefix, a wrong secret
        self.assertEqual(tenant_authenticate_nowait(raw_key=wrong), (True, None))
        self.assertEqual(tenant_authenticate_nowait(raw_key="not-a-key"), (True, None))

        # A check of Redis is due: the cache does not answer alone until it is made.
        time.sleep(CHECK_INTERVAL_SECONDS + 0.05)
        self.assertEqual(tenant_authenticate_nowait(raw_key=self.key), (False, None))
        self.assertEqual(tenant_authenticate_cached(raw_key=self.key), self.tenant)
        self.assertEqual(tenant_authenticate_nowait(raw_key=self.key), (True, self.tenant))

        # A rotation moves the key version: once read, the old key's entry is gone.
        with self.captureOnCommitCallbacks(execute=True):
            new_key = self.tenant.rotate_api_key()
            self.tenant.save()
        policy_invalidate()  # the next check, made now
        self.assertIsNone(tenant_authenticate_cached(raw_key=self.key))
        self.assertEqual(tenant_authenticate_nowait(raw_key=self.key), (True, None))
        self.assertEqual(tenant_authenticate_nowait(raw_key=new_key), (False, None))
        self.assertEqual(tenant_authenticate_cached(raw_key=new_key), self.tenant)
        self.assertEqual(tenant_authenticate_nowait(raw_key=new_key), (True, self.tenant))
