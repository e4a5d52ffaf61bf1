"""The production web server (gunicorn supervising uvicorn worker processes, as
gunicorn.conf.py configures it): the API docs load from the app's own static files with no
outside network, static files are served hashed, compressed and cached, and /metrics gives
the same figures whichever worker process answers the scrape."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import glob
import http.client
import json
import os
import re
import runpy
import shutil
import tempfile
import threading
from collections.abc import Iterator
from inspect import iscoroutinefunction
from pathlib import Path
from urllib.parse import urlsplit

from django.core.handlers.asgi import ASGIHandler
from django.test import SimpleTestCase
from playwright.sync_api import expect, sync_playwright
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from fairqueue import apiserver
from fairqueue.apiserver import ApiASGIHandler, ApiPool, api_middleware, in_api_thread, is_api_path
from tests.base import RedisTransactionTestCase
from tests.browser import OUTPUT, chromium_launch, chromium_require
from tests.factories import make_tenant
from tests.web import web_server

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def mock_environ(**values: str) -> Iterator[None]:
    """The process environment with `values` set, put back as it was afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Chromium resolves no host name but 127.0.0.1: a page needing a CDN cannot load here.
OFFLINE_ARGS = ["--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"]
WEB_WORKERS = 2
POOL_WAIT_S = 10.0  # generous: a pool thread's step on a loaded machine
DASHBOARD_REQUESTS_BATCH = 20
DASHBOARD_REQUESTS_MAX = 400
SCRAPES = 8
REQUESTS_BY_VIEW = "django_http_requests_total_by_view_transport_method_total"


def request(port: int, path: str, *, method: str = "GET", headers: dict[str, str] | None = None, body: bytes = b""):  # type: ignore[no-untyped-def]
    """One request on a new connection (so the kernel may hand it to either worker process):
    (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def dashboard_requests_in(counter_file: str) -> float:
    """What one worker process counted itself for GET /dashboard/ (its own metrics file)."""
    for metric in MultiProcessCollector.merge([counter_file], accumulate=True):
        for s in metric.samples:
            if s.name == REQUESTS_BY_VIEW and s.labels.get("view") == "dashboard":
                return s.value
    return 0.0


class ProductionServerTests(RedisTransactionTestCase):
    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        # The server's request metrics go to a folder of this test's, to be read below.
        self.metrics_dir = tempfile.mkdtemp(prefix="fq-test-web-metrics-")
        self.addCleanup(shutil.rmtree, self.metrics_dir, ignore_errors=True)
        self.server = web_server(
            production=True, processes=WEB_WORKERS, DEBUG="0", PROMETHEUS_MULTIPROC_DIR=self.metrics_dir
        )
        self.server.start()
        self.addCleanup(self.server.stop)

    def test_api_docs_load_from_the_app_with_no_outside_network(self) -> None:
        chromium_require(self)
        here = f"127.0.0.1:{self.server.port}"
        with sync_playwright() as pw:
            browser = chromium_launch(pw, *OFFLINE_ARGS)
            # The guard itself: an outside host does not resolve in this browser.
            probe = browser.new_page()
            with self.assertRaisesRegex(Exception, "ERR_NAME_NOT_RESOLVED"):
                probe.goto("https://cdn.jsdelivr.net/npm/swagger-ui-dist/swagger-ui.css")
            probe.close()

            page = browser.new_page(viewport={"width": 1280, "height": 900})
            urls: list[str] = []
            failed: list[str] = []
            page.on("request", lambda r: urls.append(r.url))
            page.on("requestfailed", lambda r: failed.append(r.url))
            try:
                page.goto(f"{self.server.base_url}/api/v1/docs")
                operation = ".opblock-{} .opblock-summary-path[data-path='{}']"
                expect(page.locator(operation.format("post", "/api/v1/jobs"))).to_be_visible(timeout=20_000)
                expect(page.locator(operation.format("post", "/api/v1/jobs/bulk"))).to_be_visible()
                expect(page.locator(operation.format("get", "/api/v1/limits"))).to_be_visible()
                expect(page.locator(".info .title")).to_contain_text("FairQueue API")
                page.screenshot(path=str(OUTPUT / "api-docs.png"), full_page=True)
            except Exception:
                page.screenshot(path=str(OUTPUT / "api-docs-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
        network = [u for u in urls if urlsplit(u).scheme in ("http", "https", "ws", "wss")]
        self.assertEqual([u for u in network if urlsplit(u).netloc != here], [], "requests left this server")
        self.assertEqual(failed, [])
        # Swagger UI came from ninja's bundled files, collected under content-hashed names.
        self.assertTrue(
            any(re.search(r"/static/ninja/swagger-ui-bundle\.[0-9a-f]{12}\.js$", u) for u in network), network
        )
        self.assertIn(f"http://{here}/api/v1/openapi.json", network)

    def test_static_files_are_served_hashed_compressed_and_cached(self) -> None:
        status, _, page = request(self.server.port, "/admin/login/")
        self.assertEqual(status, 200)
        css = re.search(rb'href="(/static/admin/css/base\.[0-9a-f]{12}\.css)"', page)
        self.assertIsNotNone(css, page[:2000])
        path = css.group(1).decode()  # type: ignore[union-attr]

        status, headers, body = request(self.server.port, path, headers={"Accept-Encoding": "gzip"})
        self.assertEqual(status, 200)
        self.assertEqual(headers.get("content-encoding"), "gzip")
        self.assertIn("immutable", headers["cache-control"])
        self.assertEqual(body[:2], b"\x1f\x8b")  # a gzip stream, read whole through the async path

        status, plain_headers, plain = request(self.server.port, path)
        self.assertEqual(status, 200)
        self.assertNotIn("content-encoding", plain_headers)
        self.assertEqual(int(plain_headers["content-length"]), len(plain))
        self.assertIn(b"body", plain)

        status, _, nothing = request(self.server.port, path, headers={"If-None-Match": plain_headers["etag"]})
        self.assertEqual((status, nothing), (304, b""))
        status, head_headers, nothing = request(self.server.port, path, method="HEAD")
        self.assertEqual((status, nothing), (200, b""))
        self.assertEqual(head_headers["content-length"], plain_headers["content-length"])

    def test_metrics_are_the_same_whichever_worker_process_answers(self) -> None:
        _, key = make_tenant("acme", max_concurrency=1)
        job = json.dumps({"task": "demo.sleep", "args": {"seconds": 5}}).encode()
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        for _ in range(3):  # no worker runs them: one holds acme's only slot, two park
            status, headers, body = request(self.server.port, "/api/v1/jobs", method="POST", headers=auth, body=job)
            self.assertEqual(status, 202, body)
            # The API's own handler (fairqueue/apiserver.py) keeps the security middleware.
            self.assertEqual(headers.get("x-content-type-options"), "nosniff")
            self.assertEqual(headers.get("x-frame-options"), "DENY")
        # ...and checks the Host header like every other page.
        status, _, body = request(
            self.server.port, "/api/v1/jobs", method="POST", headers={**auth, "Host": "evil.example"}, body=job
        )
        self.assertEqual(status, 400, body)
        # New connections until each process has served some (the kernel picks who accepts).
        sent = 0
        counted: list[float] = []
        while sent < DASHBOARD_REQUESTS_MAX and sum(1 for n in counted if n) < WEB_WORKERS:
            for _ in range(DASHBOARD_REQUESTS_BATCH):
                status, _, _ = request(self.server.port, "/dashboard/")
                self.assertEqual(status, 302)  # to the login page
            sent += DASHBOARD_REQUESTS_BATCH
            counted = [dashboard_requests_in(f) for f in glob.glob(f"{self.metrics_dir}/counter_*.db")]
        self.assertEqual(sum(1 for n in counted if n), WEB_WORKERS, f"one process served all: {counted}")
        self.assertEqual(sum(counted), sent)

        acme = (("tenant", "acme"),)
        for _ in range(SCRAPES):
            status, _, text = request(self.server.port, "/metrics")
            self.assertEqual(status, 200)
            s = samples(text.decode())
            # django-prometheus's counter, summed over both processes' files...
            by_view = (REQUESTS_BY_VIEW, (("method", "GET"), ("transport", "http"), ("view", "dashboard")))
            self.assertEqual(s[by_view], sent)
            api_view = (REQUESTS_BY_VIEW, (("method", "POST"), ("transport", "http"), ("view", "api-v1:submit_job")))
            self.assertEqual(s[api_view], 3)  # the API's requests are counted too
            # ...and FairQueue's own series, read from Redis by whichever process answers.
            self.assertEqual(s[("fairqueue_tenant_limit", acme)], 1)
            self.assertEqual(s[("fairqueue_tenant_in_flight", acme)], 1)
            self.assertEqual(s[("fairqueue_tenant_parked", acme)], 2)


class MiddlewareChainTests(SimpleTestCase):
    def test_the_api_handler_runs_only_what_the_api_uses_inline(self) -> None:
        # /api/ requests: no session, user, message or CSRF middleware, and the hooks of the
        # rest called on the event loop (no thread hand-off, no thread per request).
        handler = ApiASGIHandler()
        self.assertTrue(handler._view_middleware)
        self.assertTrue(all(iscoroutinefunction(hook) for hook in handler._view_middleware), "view hooks run inline")
        chain: list[str] = []
        layer = handler._middleware_chain
        while layer is not None:
            inner = getattr(layer, "__wrapped__", layer)
            middleware = getattr(inner, "middleware", None)
            if middleware is None:
                break
            chain.append(type(middleware).__name__)
            layer = inner.get_response
        self.assertIn("PrometheusBeforeMiddleware", chain)
        self.assertIn("SecurityMiddleware", chain)
        self.assertIn("CommonMiddleware", chain)
        for skipped in ("SessionMiddleware", "CsrfViewMiddleware", "AuthenticationMiddleware", "MessageMiddleware"):
            self.assertNotIn(skipped, chain)
        self.assertEqual(len(chain), len(api_middleware()))

    def test_only_api_paths_go_to_the_api_handler(self) -> None:
        self.assertTrue(is_api_path({"path": "/api/v1/jobs"}))
        self.assertTrue(is_api_path({"path": "/fq/api/v1/jobs", "root_path": "/fq"}))
        self.assertFalse(is_api_path({"path": "/admin/"}))
        self.assertFalse(is_api_path({"path": "/apiary"}))

    def test_under_asgi_the_middleware_runs_synchronously_in_one_thread(self) -> None:
        # The static files middleware, synchronous and last, makes Django run every middleware
        # above it in sync mode; in async mode each of their hooks is a thread hand-off.
        handler = ASGIHandler()
        modes = {type(hook.__self__).__name__: hook.__self__.async_mode for hook in handler._view_middleware}
        self.assertIn("CsrfViewMiddleware", modes)
        self.assertEqual({name for name, is_async in modes.items() if is_async}, set())


class GunicornConfigTests(SimpleTestCase):
    def test_a_worker_freezes_what_it_loaded_out_of_the_collectors_walks(self) -> None:
        # gunicorn.conf.py read as gunicorn reads it, with its metrics folder a test's own.
        folder = tempfile.mkdtemp(prefix="fq-test-gunicorn-conf-")
        self.addCleanup(shutil.rmtree, folder, ignore_errors=True)
        with mock_environ(PROMETHEUS_MULTIPROC_DIR=folder):
            conf = runpy.run_path(str(ROOT / "gunicorn.conf.py"))
        loaded = {"kept": [1, 2]}  # what a loaded app holds: an object the collector tracks
        self.assertTrue(any(o is loaded for o in gc.get_objects()))
        self.addCleanup(gc.unfreeze)
        frozen_before = gc.get_freeze_count()
        conf["post_worker_init"](object())
        self.assertGreater(gc.get_freeze_count(), frozen_before)
        self.assertFalse(any(o is loaded for o in gc.get_objects()), "frozen objects leave the collector's walks")
        gc.unfreeze()
        self.assertTrue(any(o is loaded for o in gc.get_objects()))


_request_value: contextvars.ContextVar[str] = contextvars.ContextVar("test_request_value", default="")


class ApiPoolTests(SimpleTestCase):
    """The API's thread pool (fairqueue.apiserver.ApiPool) answers as run_in_executor did."""

    def test_calls_run_on_the_pools_threads_at_once_and_answer_on_the_loop(self) -> None:
        pool = ApiPool(3, name="fq-api-test")
        barrier = threading.Barrier(3, timeout=POOL_WAIT_S)

        def call(n: int) -> tuple[int, str]:
            barrier.wait()  # only passes if three calls run at the same time
            return n * 2, threading.current_thread().name

        async def main() -> list[tuple[int, str]]:
            return await asyncio.gather(*[pool.run(lambda n=n: call(n)) for n in range(3)])

        answers = asyncio.run(main())
        self.assertEqual([a for a, _ in answers], [0, 2, 4])
        self.assertEqual(len({name for _, name in answers}), 3)
        self.assertTrue(all(name.startswith("fq-api-test_") for _, name in answers))

    def test_an_exception_reaches_the_awaiting_request_and_the_thread_serves_on(self) -> None:
        pool = ApiPool(1, name="fq-api-test")

        def fail() -> None:
            raise KeyError("boom")

        async def main() -> str:
            with self.assertRaises(KeyError):
                await pool.run(fail)
            return await pool.run(lambda: "after")

        self.assertEqual(asyncio.run(main()), "after")

    def test_a_call_cancelled_before_a_thread_took_it_is_not_run(self) -> None:
        pool = ApiPool(1, name="fq-api-test")
        release = threading.Event()
        ran: list[str] = []

        def step(name: str) -> str:
            if name == "first":
                release.wait(POOL_WAIT_S)
            ran.append(name)
            return name

        async def main() -> str:
            first = pool.run(lambda: step("first"))  # holds the one thread
            second = pool.run(lambda: step("second"))
            second.cancel()
            release.set()
            await first
            return await pool.run(lambda: step("third"))

        self.assertEqual(asyncio.run(main()), "third")
        self.assertEqual(ran, ["first", "third"])

    def test_in_api_thread_carries_the_requests_context_into_the_pool(self) -> None:
        async def main() -> tuple[str, str]:
            token = apiserver._in_api_handler.set(True)
            _request_value.set("this request")
            try:
                return await in_api_thread(lambda: (_request_value.get(), threading.current_thread().name))
            finally:
                apiserver._in_api_handler.reset(token)

        value, thread = asyncio.run(main())
        self.assertEqual(value, "this request")
        self.assertTrue(thread.startswith("fq-api_"))
