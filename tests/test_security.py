"""Security: tenant isolation on every endpoint, hashed keys, staff-only admin/dashboard/websocket,
the `/metrics` token, and production settings (required SECRET_KEY, clean `check --deploy`)."""

from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.test import Client, override_settings
from django.urls import reverse

from fairqueue.asgi import application
from fairqueue.jobs.api import api
from fairqueue.jobs.models import Job, JobStatus
from tenants import authentication
from tenants import selectors as tenant_selectors
from tenants.models import Tenant
from tenants.policy import policy_invalidate
from tests.base import RedisTestCase, RedisTransactionTestCase
from tests.factories import make_tenant

ROOT = Path(__file__).resolve().parent.parent
JOBS = "/api/v1/jobs"
ALL_STATUSES = [s.value for s in JobStatus]


# --- tenant isolation -------------------------------------------------------------------------------


class TenantIsolationTests(RedisTestCase):
    """Tenant B holds a valid key and knows A's job ids; it still sees and touches nothing of A's."""

    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        self.http = Client(raise_request_exception=False)
        with self.captureOnCommitCallbacks(execute=True):
            self.a, self.a_key = make_tenant("alpha", max_concurrency=1)
            self.b, self.b_key = make_tenant("bravo", max_concurrency=1)
        policy_invalidate()
        # A: one job in every status (submitted through the API: queued, then parked ones).
        self.a_jobs: dict[str, str] = {}
        first = self.submit(self.a_key, idempotency_key="shared-key")
        self.a_jobs["queued"] = first["id"]
        for status in ALL_STATUSES:
            if status == "queued":
                continue
            job = self.submit(self.a_key)
            if status != "parked":
                Job.objects.filter(id=job["id"]).update(status=status)
            self.a_jobs[status] = job["id"]
        self.b_job = self.submit(self.b_key)["id"]

    def auth(self, key: str) -> dict[str, str]:
        return {"HTTP_AUTHORIZATION": f"Bearer {key}"}

    def submit(self, key: str, **extra: Any) -> dict[str, Any]:
        body = {"task": "demo.sleep", "args": {"seconds": 1}, **extra}
        response = self.http.post(JOBS, json.dumps(body), content_type="application/json", **self.auth(key))
        self.assertIn(response.status_code, (200, 202), response.content)
        return response.json()  # type: ignore[no-any-return]

    def a_rows(self) -> dict[str, tuple[str, int]]:
        return {str(j.id): (j.status, j.generation) for j in Job.objects.filter(tenant=self.a)}

    def test_every_api_operation_is_covered_here(self) -> None:
        # If an endpoint is added, this fails until its isolation test below is written.
        operations = {
            f"{method.upper()} {path}" for path, item in api.get_openapi_schema()["paths"].items() for method in item
        }
        self.assertEqual(
            operations,
            {
                "POST /api/v1/jobs",
                "POST /api/v1/jobs/bulk",
                "GET /api/v1/jobs",
                "GET /api/v1/jobs/{job_id}",
                "POST /api/v1/jobs/{job_id}/cancel",
                "GET /api/v1/jobs/{job_id}/webhooks",
                "GET /api/v1/limits",
            },
        )

    def test_another_tenants_webhook_deliveries_are_a_404_in_every_status(self) -> None:
        for status, job_id in self.a_jobs.items():
            with self.subTest(status=status):
                response = self.http.get(f"{JOBS}/{job_id}/webhooks", **self.auth(self.b_key))
                self.assertEqual(response.status_code, 404)
                self.assertEqual(response.json()["error"]["code"], "not_found")
                self.assertNotIn(job_id, response.content.decode())
        self.assertEqual(self.http.get(f"{JOBS}/{self.a_jobs['queued']}/webhooks", **self.auth(self.a_key)).json(), [])

    def test_get_another_tenants_job_is_a_404_in_every_status(self) -> None:
        for status, job_id in self.a_jobs.items():
            with self.subTest(status=status):
                response = self.http.get(f"{JOBS}/{job_id}", **self.auth(self.b_key))
                self.assertEqual(response.status_code, 404)
                self.assertEqual(response.json()["error"]["code"], "not_found")
                self.assertNotIn(job_id, response.content.decode())
                # Indistinguishable from a job that never existed.
                unknown = self.http.get(f"{JOBS}/00000000-0000-4000-8000-000000000000", **self.auth(self.b_key))
                self.assertEqual(response.json(), unknown.json())
        self.assertEqual(self.http.get(f"{JOBS}/{self.a_jobs['queued']}", **self.auth(self.a_key)).status_code, 200)

    def test_cancel_another_tenants_job_is_a_404_and_changes_nothing(self) -> None:
        before = self.a_rows()
        for status, job_id in self.a_jobs.items():
            with self.subTest(status=status):
                response = self.http.post(f"{JOBS}/{job_id}/cancel", **self.auth(self.b_key))
                self.assertEqual(response.status_code, 404)
                self.assertEqual(response.json()["error"]["code"], "not_found")
        self.assertEqual(self.a_rows(), before)
        # A's parked job is still in A's line in Redis: A can still cancel it itself.
        mine = self.http.post(f"{JOBS}/{self.a_jobs['parked']}/cancel", **self.auth(self.a_key))
        self.assertEqual(mine.status_code, 200)

    def test_list_shows_only_the_callers_jobs_with_every_filter_and_page(self) -> None:
        a_ids = set(self.a_jobs.values())
        for status in [None, *ALL_STATUSES]:
            for limit, offset in ((500, 0), (1, 0), (1, 1), (2, 100)):
                params: dict[str, Any] = {"limit": limit, "offset": offset, "total": "true"}
                if status:
                    params["status"] = status
                with self.subTest(params=params):
                    response = self.http.get(JOBS, params, **self.auth(self.b_key))
                    self.assertEqual(response.status_code, 200)
                    page = response.json()
                    ids = {item["id"] for item in page["items"]}
                    self.assertFalse(ids & a_ids)
                    self.assertLessEqual(ids, {self.b_job})
                    self.assertEqual(page["total"]["value"], 1 if status in (None, "queued") else 0)
        everything = self.http.get(JOBS, {"limit": 500}, **self.auth(self.a_key)).json()
        self.assertEqual({item["id"] for item in everything["items"]}, a_ids)

    def test_list_filters_and_cursors_never_reach_another_tenants_jobs(self) -> None:
        a_ids = set(self.a_jobs.values())
        # A's own cursors, from every place in A's list, and filters A's jobs all match.
        a_cursors = []
        page = self.http.get(JOBS, {"limit": 1}, **self.auth(self.a_key)).json()
        while page["next"]:
            a_cursors.append(page["next"])
            page = self.http.get(JOBS, {"limit": 1, "cursor": page["next"]}, **self.auth(self.a_key)).json()
        self.assertEqual(len(a_cursors), len(a_ids) - 1)
        for params in (
            {"task": "demo.sleep"},
            {"submitted_since": "2000-01-01T00:00:00Z"},
            {"submitted_before": "2999-01-01T00:00:00Z"},
            *({"cursor": cursor} for cursor in a_cursors),
        ):
            with self.subTest(params=params):
                page = self.http.get(JOBS, {**params, "total": "true"}, **self.auth(self.b_key)).json()
                ids = {item["id"] for item in page["items"]}
                self.assertFalse(ids & a_ids)
                self.assertLessEqual(ids, {self.b_job})
                self.assertLessEqual(page["total"]["value"], 1)

    def test_limits_show_only_the_callers_tenant(self) -> None:
        b = self.http.get("/api/v1/limits", **self.auth(self.b_key)).json()
        a = self.http.get("/api/v1/limits", **self.auth(self.a_key)).json()
        self.assertEqual((b["tenant"], a["tenant"]), ("bravo", "alpha"))
        # B holds one slot and waits on nothing; A's queue (1 held, parked ones) is not in B's numbers.
        self.assertEqual((b["in_flight"], b["parked"]), (1, 0))
        self.assertEqual(a["in_flight"], 1)
        self.assertGreaterEqual(a["parked"], 1)
        self.assertNotIn("alpha", json.dumps(b))

    def test_idempotency_keys_never_return_another_tenants_job(self) -> None:
        mine = self.submit(self.b_key, idempotency_key="shared-key")
        self.assertNotEqual(mine["id"], self.a_jobs["queued"])
        bulk = self.http.post(
            f"{JOBS}/bulk",
            json.dumps({"jobs": [{"task": "demo.sleep", "args": {"seconds": 1}, "idempotency_key": "shared-key"}]}),
            content_type="application/json",
            **self.auth(self.b_key),
        )
        self.assertEqual(bulk.status_code, 202, bulk.content)
        self.assertEqual(bulk.json()[0]["id"], mine["id"])
        self.assertEqual(Job.objects.get(id=mine["id"]).tenant_id, self.b.id)

    def test_submissions_are_written_for_the_key_owner_only(self) -> None:
        # A body cannot name a tenant: unknown fields are refused, the key decides.
        response = self.http.post(
            JOBS,
            json.dumps({"task": "demo.sleep", "args": {"seconds": 1}, "tenant": "alpha"}),
            content_type="application/json",
            **self.auth(self.b_key),
        )
        self.assertEqual(response.status_code, 400)
        created = self.submit(self.b_key)
        self.assertEqual(Job.objects.get(id=created["id"]).tenant_id, self.b.id)


# --- API keys ---------------------------------------------------------------------------------------


class ApiKeyStorageTests(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, self.key = make_tenant("acme")
        policy_invalidate()

    def test_only_a_sha256_of_the_key_is_stored(self) -> None:
        row = Tenant.objects.get(pk=self.tenant.pk)
        self.assertNotEqual(row.api_key_hash, self.key)
        self.assertEqual(row.api_key_hash, hashlib.sha256(self.key.encode()).hexdigest())
        self.assertRegex(row.api_key_hash, r"^[0-9a-f]{64}$")
        secret_part = self.key.split("_", 2)[2]
        for field in Tenant._meta.concrete_fields:
            value = str(field.value_from_object(row))
            with self.subTest(field=field.name):
                self.assertNotIn(self.key, value)
                self.assertNotIn(secret_part, value)

    def test_keys_are_random_and_long(self) -> None:
        keys = {Tenant(slug=f"t{i}").rotate_api_key() for i in range(20)}
        self.assertEqual(len(keys), 20)
        for key in keys:
            self.assertGreaterEqual(len(key.split("_", 2)[2]), 43)  # 32 random bytes, url-safe base64

    def test_comparison_is_constant_time(self) -> None:
        self.assertIn("hmac.compare_digest", inspect.getsource(Tenant.check_api_key))
        with mock.patch("tenants.models.hmac.compare_digest", wraps=hmac.compare_digest) as compare:
            self.assertEqual(tenant_selectors.tenant_authenticate(raw_key=self.key), self.tenant)
            self.assertEqual(compare.call_count, 1)
            # Right prefix, wrong secret: looked up by prefix, refused by the constant-time compare.
            prefix = self.key.rsplit("_", 1)[0]
            self.assertIsNone(tenant_selectors.tenant_authenticate(raw_key=prefix + "_" + "x" * 43))
            self.assertEqual(compare.call_count, 2)

    def test_the_lookup_never_filters_on_the_hash(self) -> None:
        # Filtering by hash in SQL would leak timing through the index; only the prefix is looked up.
        source = inspect.getsource(tenant_selectors.tenant_by_key_prefix)
        self.assertIn("api_key_prefix=", source)
        self.assertNotIn("api_key_hash", source)
        for caller in (tenant_selectors.tenant_authenticate, authentication.tenant_authenticate_cached):
            self.assertIn("tenant_by_key_prefix(prefix)", inspect.getsource(caller))
            self.assertNotIn("api_key_hash", inspect.getsource(caller))

    def test_wrong_keys_are_401(self) -> None:
        http = Client()
        prefix = self.key.rsplit("_", 1)[0]
        for key in (prefix + "_wrong", self.key + "x", self.key.upper(), "", "fq_", "x" * 10_000):
            with self.subTest(key=key[:40]):
                response = http.get(JOBS, HTTP_AUTHORIZATION=f"Bearer {key}")
                self.assertEqual(response.status_code, 401)
        self.assertEqual(http.get(JOBS, HTTP_AUTHORIZATION=f"Bearer {self.key}").status_code, 200)


# --- staff-only pages -------------------------------------------------------------------------------


class StaffOnlyPagesTests(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        User = get_user_model()
        self.staff = User.objects.create_user("ops", password="pw-ops-123", is_staff=True, is_superuser=True)
        self.plain = User.objects.create_user("customer", password="pw-cust-123")
        self.inactive = User.objects.create_user("gone", password="pw-gone-123", is_staff=True, is_active=False)

    def urls(self) -> list[str]:
        urls = ["/admin/", "/dashboard/"]
        for model in admin.site._registry:
            meta = model._meta
            urls.append(reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist"))
        return urls

    def test_anonymous_non_staff_and_inactive_users_are_sent_to_login(self) -> None:
        login = reverse("admin:login")
        for user in (None, self.plain, self.inactive):
            http = Client()
            if user is not None:
                http.force_login(user)
            for url in self.urls():
                with self.subTest(user=getattr(user, "username", "anonymous"), url=url):
                    response = http.get(url)
                    self.assertEqual(response.status_code, 302)
                    self.assertTrue(response["Location"].startswith(login), response["Location"])

    def test_staff_get_in(self) -> None:
        http = Client()
        http.force_login(self.staff)
        for url in self.urls():
            with self.subTest(url=url):
                # Some changelists redirect (the single pool-settings row, the dashboard link); never to login.
                response = http.get(url, follow=True)
                self.assertEqual(response.status_code, 200)
                self.assertNotIn(reverse("admin:login"), response.request["PATH_INFO"])

    def test_api_keys_do_not_open_the_admin(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            _, key = make_tenant("acme")
        response = Client().get("/admin/", HTTP_AUTHORIZATION=f"Bearer {key}")
        self.assertEqual(response.status_code, 302)


class DashboardWebsocketTests(RedisTransactionTestCase):
    """The socket refuses everyone but active staff, and other origins (tests/test_dashboard_consumer.py
    covers anonymous and non-staff users with the snapshot flow)."""

    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        User = get_user_model()
        self.staff = User.objects.create_user("ops", password="pw-ops-123", is_staff=True)
        self.plain = User.objects.create_user("customer", password="pw-cust-123")
        self.superuser_not_staff = User.objects.create_user("root", password="pw-root-123", is_superuser=True)
        self.inactive = User.objects.create_user("gone", password="pw-gone-123", is_staff=True)

    def cookie(self, user: Any) -> bytes:
        client = Client()
        client.force_login(user)
        return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()

    def deactivate(self, user: Any) -> None:
        user.is_active = False
        user.save(update_fields=["is_active"])

    async def outcome(self, cookie: bytes | None, origin: bytes = b"http://testserver") -> Any:
        headers = [(b"origin", origin)]
        if cookie:
            headers.append((b"cookie", cookie))
        comm = WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)
        connected, code = await comm.connect()
        if not connected:
            return ("rejected", code)
        message = await comm.receive_output(timeout=5)
        await comm.disconnect()
        return (message["type"], message.get("code"))

    async def test_only_active_staff_from_our_origin_get_data(self) -> None:
        refused = ("websocket.close", 4403)
        self.assertEqual(await self.outcome(None), refused)
        for user in (self.plain, self.superuser_not_staff):
            cookie = await database_sync_to_async(self.cookie)(user)
            self.assertEqual(await self.outcome(cookie), refused)
        # Logged in while staff, then deactivated: the old session no longer opens the socket.
        cookie = await database_sync_to_async(self.cookie)(self.inactive)
        await database_sync_to_async(self.deactivate)(self.inactive)
        self.assertEqual(await self.outcome(cookie), refused)
        staff = await database_sync_to_async(self.cookie)(self.staff)
        self.assertEqual(await self.outcome(staff), ("websocket.send", None))
        # A page on another origin cannot ride a staff session cookie.
        self.assertEqual((await self.outcome(staff, origin=b"https://evil.example"))[0], "rejected")
        self.assertEqual(await self.outcome(b"sessionid=forged"), refused)


# --- /metrics -----------------------------------------------------------------------------------


class MetricsTokenTests(RedisTestCase):
    def test_a_token_restricts_metrics(self) -> None:
        http = Client()
        token = secrets.token_urlsafe(32)
        with override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "METRICS_TOKEN": token}):
            for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer wrong"}, {"HTTP_AUTHORIZATION": f"Basic {token}"}):
                with self.subTest(headers=headers):
                    response = http.get("/metrics", **headers)  # type: ignore[arg-type]
                    self.assertEqual(response.status_code, 401)
                    self.assertNotIn(b"fairqueue_", response.content)
            # A staff session is not a metrics credential either.
            staff = get_user_model().objects.create_user("ops", password="pw-ops-123", is_staff=True)
            http.force_login(staff)
            self.assertEqual(http.get("/metrics").status_code, 401)
            with mock.patch("dashboard.views.hmac.compare_digest", wraps=hmac.compare_digest) as compare:
                ok = http.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
            self.assertEqual(ok.status_code, 200)
            self.assertIn(b"fairqueue_worker_slots", ok.content)
            self.assertEqual(compare.call_count, 1)
        with override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "METRICS_TOKEN": ""}):
            self.assertEqual(Client().get("/metrics").status_code, 200)


# --- production settings ----------------------------------------------------------------------------

# Import the settings without reading a developer's .env, so only the env given here counts.
_NO_DOTENV = "import environ; environ.Env.read_env = classmethod(lambda *a, **k: None)\n"


def run_django(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"), **env}
    clean.setdefault("DJANGO_SETTINGS_MODULE", "fairqueue.settings")
    return subprocess.run(
        [sys.executable, "-c", _NO_DOTENV + code],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )


def production_env(db_dir: str, **extra: str) -> dict[str, str]:
    return {
        "DEBUG": "0",
        "FAIRQUEUE_DEMO": "0",
        "SECRET_KEY": secrets.token_urlsafe(64),
        "ALLOWED_HOSTS": "fairqueue.example.com",
        "DATABASE_URL": f"sqlite:///{db_dir}/x.sqlite3",
        **extra,
    }


PRINT_SETTINGS = """
import django, json
django.setup()
from django.conf import settings as s
print(json.dumps({k: getattr(s, k, None) for k in (
    "DEBUG", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_SSL_REDIRECT", "SECURE_HSTS_SECONDS",
    "ALLOWED_HOSTS")}))
"""

CHECK_DEPLOY = """
from django.core.management import execute_from_command_line
execute_from_command_line(["manage.py", "check", "--deploy", "--fail-level", "WARNING"])
"""


class ProductionSettingsTests(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.tmp = tempfile.mkdtemp(prefix="fq-prod-")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def test_settings_refuse_to_load_without_a_secret_key(self) -> None:
        for env in ({"DEBUG": "0", "FAIRQUEUE_DEMO": "0"}, {}, {"FAIRQUEUE_DEMO": "0", "SECRET_KEY": ""}):
            with self.subTest(env=env):
                done = run_django("import django; django.setup()", **env)
                self.assertNotEqual(done.returncode, 0)
                self.assertIn("ImproperlyConfigured: SECRET_KEY must be set", done.stderr)
                self.assertIn("FAIRQUEUE_DEMO=1", done.stderr)  # says how to run the demo instead

    def test_the_demo_runs_without_one(self) -> None:
        for env in ({"FAIRQUEUE_DEMO": "1"}, {"DEBUG": "1"}):
            with self.subTest(env=env):
                done = run_django(PRINT_SETTINGS, DATABASE_URL=f"sqlite:///{self.tmp}/x.sqlite3", **env)
                self.assertEqual(done.returncode, 0, done.stderr)

    def test_production_defaults(self) -> None:
        done = run_django(PRINT_SETTINGS, **production_env(self.tmp))
        self.assertEqual(done.returncode, 0, done.stderr)
        values = json.loads(done.stdout.strip().splitlines()[-1])
        self.assertFalse(values["DEBUG"])
        self.assertTrue(values["SESSION_COOKIE_SECURE"])
        self.assertTrue(values["CSRF_COOKIE_SECURE"])
        self.assertTrue(values["SECURE_SSL_REDIRECT"])
        self.assertGreaterEqual(values["SECURE_HSTS_SECONDS"], 31536000)
        self.assertEqual(values["ALLOWED_HOSTS"], ["fairqueue.example.com"])

    def test_debug_is_off_unless_asked_for(self) -> None:
        env = production_env(self.tmp)
        del env["DEBUG"]
        done = run_django(PRINT_SETTINGS, **env)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertFalse(json.loads(done.stdout.strip().splitlines()[-1])["DEBUG"])

    def test_check_deploy_is_clean(self) -> None:
        done = run_django(CHECK_DEPLOY, **production_env(self.tmp))
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("System check identified no issues", done.stdout + done.stderr)

    def test_check_deploy_catches_a_weak_secret_key(self) -> None:
        # The check is live: a short key is reported, so the clean result above means something.
        done = run_django(CHECK_DEPLOY, **production_env(self.tmp, SECRET_KEY="short"))
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("security.W009", done.stdout + done.stderr)
