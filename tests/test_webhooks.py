"""Signed completion webhooks on the real stack: real workers send them to real HTTP
receivers on loopback (allowed here by FAIRQUEUE_WEBHOOK_ALLOWED_NETWORKS; refused by
default, as every private address is)."""

from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from unittest.mock import patch

from django.conf import settings
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from fairqueue.jobs.dispatch import jobs_redeliver
from fairqueue.jobs.models import Job, JobStatus
from tenants.models import Tenant
from tests.base import RedisTestCase
from tests.factories import make_tenant, quarantine_lane_off
from tests.test_jobs_e2e import E2EBase
from tests.test_tenants_admin import AdminTestCase, tenant_form
from tests.workers import WorkerProcess, wait_for
from webhooks.models import EventState, WebhookDelivery, WebhookEvent
from webhooks.outbox import job_finish
from webhooks.sender import senders, webhooks_send_due
from webhooks.signing import signature_header, signature_verify
from webhooks.targets import TargetRefused, target_resolve

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = ["127.0.0.0/8"]
# Workers send with fast retries and a short timeout, so a test sees several attempts.
WORKER_ENV = {
    "FAIRQUEUE_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8",
    "FAIRQUEUE_WEBHOOK_BACKOFF_FIRST_SECONDS": "0.3",
    "FAIRQUEUE_WEBHOOK_BACKOFF_MAX_SECONDS": "1",
    "FAIRQUEUE_WEBHOOK_TIMEOUT_SECONDS": "1",
}


def readme_verifier() -> Any:
    """The verification snippet of the README's Webhooks section, exactly as printed."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Webhooks", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the README's Webhooks section has no Python snippet"
    namespace: dict[str, Any] = {}
    exec(code.group(1), namespace)
    return namespace["fairqueue_signature_ok"]


class Receiver:
    """A real HTTP server in a thread: answers `fail_first` requests with 500, then 200."""

    def __init__(self, *, fail_first: int = 0) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.fail_first = fail_first
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    failing = len(receiver.requests) <= receiver.fail_first
                self.send_response(500 if failing else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/fairqueue?src=test"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class SilentReceiver:
    """Accepts connections and never answers (a receiver that hangs)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.held: list[socket.socket] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            self.accepted += 1

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


class TargetTests(RedisTestCase):
    def test_private_loopback_and_link_local_targets_are_refused_by_default(self) -> None:
        for url in (
            "http://127.0.0.1:9/x",
            "http://localhost/x",
            "http://10.1.2.3/x",
            "http://192.168.0.10/x",
            "http://169.254.169.254/latest/meta-data",
            "http://[::1]/x",
            "http://[fe80::1]/x",
            "http://0.0.0.0/x",
            "http://[::ffff:127.0.0.1]/x",
        ):
            with self.assertRaises(TargetRefused, msg=url):
                target_resolve(url)
        for url in ("ftp://example.com/x", "http://user:pw@example.com/", "not a url", "https:///nohost"):
            with self.assertRaises(TargetRefused, msg=url):
                target_resolve(url)
        with override_settings(FAIRQUEUE=_webhooks(ALLOWED_NETWORKS=LOOPBACK)):
            self.assertEqual(target_resolve("http://127.0.0.1:8080/hook?a=1").path, "/hook?a=1")
            with self.assertRaises(TargetRefused):
                target_resolve("http://10.1.2.3/x")  # still private, not in the allowed networks

    def test_submit_refuses_a_private_callback_url_and_a_tenant_without_secret(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            tenant, key = make_tenant("hooked")
        client = Client()

        def submit(url: str) -> Any:
            return client.post(
                "/api/v1/jobs",
                json.dumps({"task": "demo.noop", "callback_url": url}),
                content_type="application/json",
                HTTP_AUTHORIZATION=f"Bearer {key}",
            )

        resp = submit("http://169.254.169.254/latest")
        self.assertEqual(resp.status_code, 400, resp.content)
        self.assertEqual(resp.json()["error"]["code"], "invalid_callback_url")
        self.assertEqual(resp.json()["error"]["field"], "callback_url")
        with override_settings(FAIRQUEUE=_webhooks(ALLOWED_NETWORKS=LOOPBACK)):
            resp = submit("http://127.0.0.1:9/hook")
            self.assertEqual(resp.status_code, 400, resp.content)
            self.assertEqual(resp.json()["error"]["code"], "webhook_secret_missing")
            tenant.rotate_webhook_secret()
            with self.captureOnCommitCallbacks(execute=True):
                tenant.save(update_fields=["webhook_secret", "webhook_secret_rotated_at", "updated_at"])
            # Every process drops its cached tenant rows within a policy check.
            resp = wait_for(lambda: (r := submit("http://127.0.0.1:9/hook")).status_code == 202 and r, timeout=10)
            self.assertEqual(resp.json()["callback_url"], "http://127.0.0.1:9/hook")
        self.assertEqual(Job.objects.count(), 1)  # the refused submits wrote nothing

    def test_a_bulk_looks_each_callback_url_up_once_and_names_the_job_it_refuses(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            tenant, key = make_tenant("hooked")
            tenant.rotate_webhook_secret()
            tenant.save(update_fields=["webhook_secret", "webhook_secret_rotated_at", "updated_at"])
        hook = "http://localhost:9/hook"
        jobs = [{"task": "demo.noop", "callback_url": hook} for _ in range(40)]
        lookups: list[str] = []
        real_getaddrinfo = socket.getaddrinfo

        def counted(host: Any, *args: Any, **kwargs: Any) -> Any:  # the real lookup, counted
            lookups.append(host)
            return real_getaddrinfo(host, *args, **kwargs)

        def bulk(body: list[dict[str, Any]]) -> Any:
            return Client().post(
                "/api/v1/jobs/bulk",
                json.dumps({"jobs": body}),
                content_type="application/json",
                HTTP_AUTHORIZATION=f"Bearer {key}",
            )

        with (
            override_settings(FAIRQUEUE=_webhooks(ALLOWED_NETWORKS=LOOPBACK)),
            patch.object(socket, "getaddrinfo", counted),
        ):
            resp = wait_for(lambda: (r := bulk(jobs)).status_code == 202 and r, timeout=10)
            # One lookup for the forty jobs (Redis clients look their own host up too).
            self.assertEqual(lookups.count("localhost"), 1)
            resp = bulk([*jobs[:3], {"task": "demo.noop", "callback_url": "http://169.254.169.254/x"}])
        self.assertEqual(resp.status_code, 400, resp.content)
        self.assertEqual(resp.json()["error"]["field"], "jobs[3].callback_url")
        self.assertEqual(Job.objects.count(), 40)  # the refused bulk wrote nothing

    def test_a_job_failed_by_the_poison_pill_limit_gets_its_event_with_the_status(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            tenant, _ = make_tenant("pills", webhook_url="https://example.com/hooks")
        quarantine_lane_off()  # the poison-pill limit without the lane
        limit = settings.FAIRQUEUE["POISON_PILL_LIMIT"]
        job = Job.objects.create(
            tenant=tenant, task="demo.noop", latency_class="default", status=JobStatus.RUNNING, worker_losses=limit - 1
        )
        jobs_redeliver([job.engine_id])  # its worker died once more: failed for good
        job.refresh_from_db()
        self.assertEqual((job.status, job.error_reason), (JobStatus.FAILED, "worker_lost"))
        event = WebhookEvent.objects.get(job=job)
        body = json.loads(event.body)
        self.assertEqual((event.type, event.url, event.state), ("job.failed", "https://example.com/hooks", "pending"))
        self.assertEqual((body["id"], body["job"]["error_reason"]), (str(event.id), "worker_lost"))
        jobs_redeliver([job.engine_id])  # a stale reclaim of the same delivery: no second event
        self.assertEqual(WebhookEvent.objects.filter(job=job).count(), 1)

    def test_the_signature_verifies_and_refuses_tampering_and_replays(self) -> None:
        verify = readme_verifier()
        body = b'{"id":"e1"}'
        header = signature_header("whsec_x", body)
        self.assertTrue(verify("whsec_x", body, header))
        self.assertTrue(signature_verify("whsec_x", body, header))
        self.assertFalse(verify("whsec_y", body, header))
        self.assertFalse(verify("whsec_x", body + b" ", header))
        old = signature_header("whsec_x", body, timestamp=1_000_000_000)
        self.assertFalse(verify("whsec_x", body, old))
        self.assertFalse(signature_verify("whsec_x", body, old))


def _webhooks(**changes: object) -> dict[str, Any]:
    return {**settings.FAIRQUEUE, "WEBHOOKS": {**settings.FAIRQUEUE["WEBHOOKS"], **changes}}


@override_settings(FAIRQUEUE=_webhooks(ALLOWED_NETWORKS=LOOPBACK, BACKOFF_FIRST_SECONDS=0.3, BACKOFF_MAX_SECONDS=1))
class WebhookDeliveryTests(E2EBase):
    def tenant(self, slug: str, **fields: object) -> tuple[Tenant, str, str]:
        tenant, key = make_tenant(slug, **fields)
        secret = tenant.rotate_webhook_secret()
        tenant.save()
        return tenant, key, secret

    def webhooks(self, key: str, job_id: object) -> list[dict[str, Any]]:
        resp = self.client.get(f"/api/v1/jobs/{job_id}/webhooks", HTTP_AUTHORIZATION=f"Bearer {key}")
        self.assertEqual(resp.status_code, 200, resp.content)
        return resp.json()  # type: ignore[no-any-return]

    def test_a_receiver_that_fails_twice_gets_the_same_signed_event_three_times(self) -> None:
        verify = readme_verifier()
        receiver = Receiver(fail_first=2)
        self.addCleanup(receiver.close)
        _, key, secret = self.tenant("acme")
        _, other_key = make_tenant("other")
        with WorkerProcess(slots=2, **WORKER_ENV):
            job = self.submit(
                key, {"task": "demo.sleep", "args": {"seconds": 0.05, "echo": "hi"}, "callback_url": receiver.url}
            )
            wait_for(lambda: len(receiver.requests) >= 3, timeout=90, message="three deliveries")
            events = wait_for(
                lambda: (e := self.webhooks(key, job["id"])) and e[0]["state"] == "delivered" and e,
                timeout=30,
                message="the event to be marked delivered",
            )
        self.assertEqual(len(receiver.requests), 3)  # delivered: not sent again
        bodies = {body for _, body in receiver.requests}
        self.assertEqual(len(bodies), 1, "every attempt sends the same bytes")
        event = json.loads(bodies.pop())
        for headers, body in receiver.requests:
            self.assertTrue(verify(secret, body, headers["fairqueue-signature"]), headers)
            self.assertFalse(verify("whsec_wrong", body, headers["fairqueue-signature"]))
            self.assertEqual(headers["fairqueue-event-id"], event["id"])
            self.assertEqual(headers["content-type"], "application/json")
        self.assertEqual(event["type"], "job.succeeded")
        self.assertEqual(event["job"]["id"], job["id"])
        self.assertEqual(event["job"]["tenant"], "acme")
        self.assertEqual(event["job"]["status"], "succeeded")
        self.assertEqual(event["job"]["result"]["echo"], "hi")
        for stamp in ("submitted_at", "started_at", "finished_at"):
            self.assertIsNotNone(event["job"][stamp])
        # The API lists each attempt; another tenant cannot see them.
        [listed] = events
        self.assertEqual(listed["id"], event["id"])
        self.assertEqual(listed["attempts"], 3)
        self.assertEqual([d["outcome"] for d in listed["deliveries"]], ["http_error", "http_error", "delivered"])
        self.assertEqual([d["status_code"] for d in listed["deliveries"]], [500, 500, 200])
        resp = self.client.get(f"/api/v1/jobs/{job['id']}/webhooks", HTTP_AUTHORIZATION=f"Bearer {other_key}")
        self.assertEqual(resp.status_code, 404)

    def test_a_receiver_that_never_answers_is_retried_and_blocks_no_worker_slot(self) -> None:
        silent = SilentReceiver()
        self.addCleanup(silent.close)
        _, key, _ = self.tenant("slow-hooks", webhook_url="")
        Tenant.objects.filter(slug="slow-hooks").update(webhook_url=silent.url)  # the tenant's own URL
        with WorkerProcess(slots=2, **WORKER_ENV):
            hooked = self.submit(key, {"task": "demo.noop"})
            wait_for(
                lambda: WebhookDelivery.objects.filter(event__job_id=hooked["id"], outcome="timeout").count() >= 2,
                timeout=90,
                message="two timed-out attempts",
            )
            # Meanwhile the worker's two slots keep running jobs.
            ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.05}})["id"] for _ in range(12)]
            jobs = self.wait_all_finished(ids, timeout=60)
            still_timing_out = WebhookDelivery.objects.filter(event__job_id=hooked["id"], outcome="timeout").count()
        self.assertTrue(all(j.status == JobStatus.SUCCEEDED for j in jobs))
        event = WebhookEvent.objects.get(job_id=hooked["id"])
        self.assertIn(event.state, (EventState.PENDING, EventState.SENDING))  # still being retried
        self.assertGreaterEqual(still_timing_out, 2)
        self.assertGreaterEqual(silent.accepted, 2)
        self.assertEqual(event.url, silent.url)

    def test_a_target_that_turned_private_is_refused_at_send_without_connecting(self) -> None:
        # Set when it was allowed (or public); by the send it is not: nothing is sent there.
        tenant, _ = make_tenant("turned", webhook_url="http://10.20.30.40/hook")
        tenant.rotate_webhook_secret()
        tenant.save()
        job = Job.objects.create(tenant=tenant, task="demo.noop", latency_class="default", status=JobStatus.QUEUED)
        job_finish(job, where={"id": job.id}, fields={"status": JobStatus.CANCELLED, "finished_at": timezone.now()})
        self.assertEqual(webhooks_send_due(), 1)
        wait_for(lambda: not senders.in_hand, message="the attempt to finish")
        [attempt] = WebhookDelivery.objects.filter(job=job)
        self.assertEqual(attempt.outcome, "refused_target")
        self.assertIn("10.20.30.40", attempt.error)
        event = WebhookEvent.objects.get(job=job)
        self.assertEqual((event.state, event.attempts), (EventState.PENDING, 1))  # retried later, with backoff
        self.assertGreater(event.next_attempt_at, timezone.now())

    def test_a_cancelled_job_is_reported_once_and_a_job_without_target_writes_no_event(self) -> None:
        receiver = Receiver()
        self.addCleanup(receiver.close)
        _, key, secret = self.tenant("cancels", max_concurrency=1)
        Tenant.objects.filter(slug="cancels").update(webhook_url=receiver.url)
        _, quiet_key = make_tenant("quiet")
        # No worker: the first job holds the only slot, the second parks and is cancelled.
        self.submit(key, {"task": "demo.sleep", "args": {"seconds": 1}})
        parked = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 1}})
        self.submit(quiet_key, {"task": "demo.noop"})
        resp = self.client.post(f"/api/v1/jobs/{parked['id']}/cancel", HTTP_AUTHORIZATION=f"Bearer {key}")
        self.assertEqual(resp.json()["status"], "cancelled")
        self.assertEqual(WebhookEvent.objects.count(), 1)  # one event, for the cancelled job only
        self.assertEqual(webhooks_send_due(), 1)  # this process's own senders, as a duty holder's
        wait_for(lambda: not senders.in_hand, message="the send to finish")
        self.assertEqual(webhooks_send_due(), 0)  # delivered: nothing due
        [(headers, body)] = receiver.requests
        self.assertTrue(signature_verify(secret, body, headers["fairqueue-signature"]))
        event = json.loads(body)
        self.assertEqual((event["type"], event["job"]["status"]), ("job.cancelled", "cancelled"))
        self.assertIsNone(event["job"]["started_at"])
        self.assertEqual(WebhookEvent.objects.get().state, EventState.DELIVERED)


SECRET_RE = re.compile(r'<code class="fq-webhook-secret">(whsec_[^<]+)</code>')


class WebhookAdminTests(AdminTestCase):
    def test_setting_a_url_issues_a_secret_shown_once_and_rotation_shows_a_new_one(self) -> None:
        tenant = self.make_tenant("hooks")
        url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
        refused = self.client.post(url, tenant_form(slug="hooks", webhook_url="http://10.0.0.5/hook"))
        self.assert_form_error(refused, "webhook_url", "private, loopback, link-local or reserved")
        with override_settings(FAIRQUEUE=_webhooks(ALLOWED_NETWORKS=LOOPBACK)):
            shown = self.client.post(url, tenant_form(slug="hooks", webhook_url="http://127.0.0.1:9/hook"))
            self.assertEqual(shown.status_code, 200)
            self.assertIn("no-store", shown["Cache-Control"])
            [secret] = SECRET_RE.findall(shown.content.decode())
            tenant.refresh_from_db()
            self.assertEqual((tenant.webhook_url, tenant.webhook_secret), ("http://127.0.0.1:9/hook", secret))
            again = self.client.post(url, tenant_form(slug="hooks", webhook_url="http://127.0.0.1:9/other"))
            self.assertEqual(again.status_code, 302)  # a secret exists: not shown again
            self.assertNotIn(secret, self.client.get(url).content.decode())
        rotated = self.client.post(
            reverse("admin:tenants_tenant_changelist"),
            {"action": "rotate_webhook_secrets", "_selected_action": [tenant.pk]},
        )
        [new_secret] = SECRET_RE.findall(rotated.content.decode())
        self.assertNotEqual(new_secret, secret)
        tenant.refresh_from_db()
        self.assertEqual(tenant.webhook_secret, new_secret)

    def test_a_tenant_created_with_a_url_shows_its_key_and_secret_once(self) -> None:
        with (
            override_settings(FAIRQUEUE=_webhooks(ALLOWED_NETWORKS=LOOPBACK)),
            self.captureOnCommitCallbacks(execute=True),
        ):
            shown = self.client.post(
                reverse("admin:tenants_tenant_add"), tenant_form(slug="fresh", webhook_url="http://127.0.0.1:9/h")
            )
        self.assertEqual(shown.status_code, 200)
        [secret] = SECRET_RE.findall(shown.content.decode())
        self.assertIn('class="fq-api-key"', shown.content.decode())
        self.assertEqual(Tenant.objects.get(slug="fresh").webhook_secret, secret)

    def test_the_job_page_lists_its_delivery_attempts(self) -> None:
        tenant = self.make_tenant("hooks", webhook_url="https://example.com/hook")
        job = Job.objects.create(tenant=tenant, task="demo.noop", latency_class="default", status=JobStatus.FAILED)
        now = timezone.now()
        event = WebhookEvent.objects.create(
            job=job,
            tenant=tenant,
            type="job.failed",
            url=tenant.webhook_url,
            body="{}",
            next_attempt_at=now,
            created_at=now,
        )
        WebhookDelivery.objects.create(
            event=event, job=job, attempt=1, started_at=now, finished_at=now, outcome="http_error", status_code=503
        )
        page = self.client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
        self.assertIn("webhook deliveries", page.lower())
        self.assertIn("Non-2xx answer", page)
        self.assertIn("503", page)
