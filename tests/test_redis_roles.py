"""Separate connections per role: engine state, Celery broker, channel layer and cache each
take their own URL (defaulting to REDIS_URL), and each kind of key lands only where its role
says. The processes read the roles from the environment, as a deployment's would."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from typing import Any

import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client, SimpleTestCase
from websockets.sync.client import connect as websocket_connect

from fairqueue.bench.stack import WebServer
from fairqueue.jobs.models import Job, JobStatus, LedgerEntry
from tests.base import RedisTransactionTestCase
from tests.factories import make_tenant
from tests.redis_server import RedisServer
from tests.workers import LOG_DIR, ROOT, WorkerProcess, kill_all_workers, wait_for, worker_env

ROLE_DBS = {"FAIRQUEUE_ENGINE_URL": 1, "CELERY_BROKER_URL": 2, "CHANNELS_REDIS_URL": 3, "CACHE_URL": 4}
SHARED_DB = 5  # REDIS_URL: with every role elsewhere, nothing may land here

_PRINT_ROLES = (
    "from django.conf import settings as s; import json; "
    "print(json.dumps({'engine': s.FAIRQUEUE['ENGINE_URL'], 'broker': s.CELERY_BROKER_URL, "
    "'channels': s.CHANNEL_LAYERS['default']['CONFIG']['hosts'][0], 'cache': s.CACHES['default']['LOCATION']}))"
)


def manage_shell(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise AssertionError(f"manage.py shell failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


class RoleSettingsTests(SimpleTestCase):
    def test_each_role_reads_its_own_url_and_defaults_to_redis_url(self) -> None:
        base = worker_env(REDIS_URL="redis://shared:6379/0")
        defaults = json.loads(manage_shell(_PRINT_ROLES, base))
        self.assertEqual(
            defaults,
            {
                "engine": "",  # empty: the engine's client uses REDIS_URL (tenants.redis_client.engine_url)
                "broker": "redis://shared:6379/0",
                "channels": "redis://shared:6379/0",
                "cache": "redis://shared:6379/0",
            },
        )
        apart = json.loads(
            manage_shell(
                _PRINT_ROLES,
                {
                    **base,
                    "FAIRQUEUE_ENGINE_URL": "redis://engine:7000/0",
                    "CELERY_BROKER_URL": "redis://broker:6379/2",
                    "CHANNELS_REDIS_URL": "redis://channels:6379/3",
                    "CACHE_URL": "redis://cache:6379/4",
                },
            )
        )
        self.assertEqual(
            apart,
            {
                "engine": "redis://engine:7000/0",
                "broker": "redis://broker:6379/2",
                "channels": "redis://channels:6379/3",
                "cache": "redis://cache:6379/4",
            },
        )

    def test_tests_ignore_the_roles_of_the_environment(self) -> None:
        # This process runs `manage.py test`: every role is the test database.
        self.assertEqual(settings.FAIRQUEUE["ENGINE_URL"], "")
        self.assertEqual(settings.CELERY_BROKER_URL, settings.REDIS_URL)
        self.assertEqual(settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"], [settings.REDIS_URL])
        self.assertEqual(settings.CACHES["default"]["LOCATION"], settings.REDIS_URL)


class RolesApartEndToEndTests(RedisTransactionTestCase):
    """Web (daphne) and a worker, each role on its own database of a private Redis server."""

    serialized_rollback = True

    def tearDown(self) -> None:
        kill_all_workers()
        super().tearDown()

    def test_a_job_runs_and_every_kind_of_key_lands_only_in_its_roles_database(self) -> None:
        with RedisServer() as server:
            base = server.url.rsplit("/", 1)[0]
            roles = {name: f"{base}/{db}" for name, db in ROLE_DBS.items()}
            env = {"REDIS_URL": f"{base}/{SHARED_DB}", **roles}
            _, key = make_tenant("apart", max_concurrency=2)
            staff = get_user_model().objects.create_user("ops", password="pw-ops-123", is_staff=True)
            web = WebServer(env=worker_env(**env), log_dir=LOG_DIR / "roles")
            with web, WorkerProcess(slots=2, name="roles", **env):
                ids = [self.post(web, key, {"task": "demo.sleep", "args": {"seconds": 0.05}}) for _ in range(3)]
                wait_for(
                    lambda: Job.objects.filter(id__in=ids, status=JobStatus.SUCCEEDED).count() == len(ids),
                    timeout=60,
                    message="jobs to succeed",
                )
                channel_keys = self.watch_dashboard(web, staff, server)
            manage_shell("from django.core.cache import cache; cache.set('probe', 1, 60)", worker_env(**env))

            self.assertEqual(LedgerEntry.objects.filter(job_id__in=ids).count(), len(ids))
            keys = {db: self.keys(server, db) for db in [*ROLE_DBS.values(), SHARED_DB]}
            engine = keys[ROLE_DBS["FAIRQUEUE_ENGINE_URL"]]
            self.assertTrue(any(k.startswith("fq:{s:default}:") for k in engine), engine)  # engine state
            for fleet_key in ("fq:{policy}:version", "fq:workers:seen", "fq:stats"):
                self.assertIn(fleet_key, engine)
            self.assert_only(keys[ROLE_DBS["CELERY_BROKER_URL"]], "fq:celery:")
            self.assert_only(channel_keys | keys[ROLE_DBS["CHANNELS_REDIS_URL"]], "fq:channels:")
            self.assert_only(keys[ROLE_DBS["CACHE_URL"]], "fq:cache:")
            for prefix in ("fq:celery:", "fq:channels:", "fq:cache:"):
                self.assertFalse([k for k in engine if k.startswith(prefix)], f"{prefix} keys in the engine database")
            self.assertEqual(keys[SHARED_DB], set(), "with every role elsewhere, nothing uses REDIS_URL")

    def post(self, web: WebServer, key: str, body: dict[str, Any]) -> str:
        req = urllib.request.Request(
            f"{web.base_url}/api/v1/jobs",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            self.assertEqual(resp.status, 202)
            return str(json.loads(resp.read())["id"])

    def watch_dashboard(self, web: WebServer, staff: Any, server: RedisServer) -> set[str]:
        """Open the live dashboard as staff (a channels group, a tick's broadcast); the keys
        of the channel layer's database while it is open (they go when it closes)."""
        client = Client()
        client.force_login(staff)
        cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
        url = web.base_url.replace("http://", "ws://") + "/ws/dashboard/"
        headers = {"Cookie": cookie, "Origin": web.base_url}
        with websocket_connect(url, additional_headers=headers, open_timeout=10) as ws:
            first = json.loads(ws.recv(timeout=10))
            self.assertIn("apart", first["rows"])
            json.loads(ws.recv(timeout=10))  # a tick's broadcast through the channel layer
            return self.keys(server, ROLE_DBS["CHANNELS_REDIS_URL"])

    def keys(self, server: RedisServer, db: int) -> set[str]:
        client = redis.Redis(host="127.0.0.1", port=server.port, db=db, decode_responses=True)
        return set(client.scan_iter(count=1000))

    def assert_only(self, keys: set[str], prefix: str) -> None:
        self.assertTrue(keys, f"no {prefix} keys at all")
        self.assertEqual({k for k in keys if not k.startswith(prefix)}, set(), f"only {prefix} keys belong here")
