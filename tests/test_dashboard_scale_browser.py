"""The live dashboard at ten thousand tenants, in a real browser (issue 44): the production
web server (gunicorn + uvicorn worker processes), a real worker, headless Chromium.

10,000 tenants on 40 shards are written in bulk (fairqueue.bench.fleet_seed): 300 of them
busy (a running job each and jobs parked behind it), 20 of those waiting past twice their
objective (red), 20 past it (orange); the rest idle. A tenant with an API key gets jobs
through the HTTP API while the page is open. Measured, as the issue states its targets:

- every websocket frame's size as Chromium receives it (Playwright's websocket events):
  the first picture (every cell's history seeded full, as two minutes of ticks leave it)
  and each frame after it at most FRAME_BYTES_MAX;
- the main thread's responsiveness while frames arrive: a timer in the page, due every
  TIMER_MS, records how late it ran at worst over the whole run (a trivial script queued at
  any moment waits at most that long); at most LATE_MS_MAX. Recorded beside it: the same
  probe on a blank page open alongside (what the loaded machine alone costs a timer), long
  tasks and long animation frames (the browser's PerformanceObserver) and the page's own
  time per frame;
- the first render: from the page's navigation to the first picture drawn, at most
  FIRST_RENDER_MS_MAX once the dashboard is live (the tick's picture kept in Redis); the
  first open of a cold server (its first build of ten thousand rows) is recorded too;
- search: a tenant outside the top N is found by slug, shows its live row, is pinned (kept
  in the browser across a reload) and opened (its sparklines and admin link).

The figures go to var/test-output/dashboard-scale.json; screenshots dashboard-scale.png
(the page) and dashboard-scale-tenants.png (the tenant panel; docs/img/ has a copy).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from datetime import timedelta
from typing import Any

import redis
from django.test import tag
from django.utils import timezone

from dashboard.snapshot import HISTORY_LEN, history_key, snapshot_build
from fairqueue.bench.fleet_bench import fleet_seed
from fairqueue.jobs import cells
from fairqueue.jobs.models import Job, JobStatus
from tests.base import RedisTransactionTestCase
from tests.browser import OUTPUT, chromium_launch, chromium_require, staff_create, staff_login
from tests.factories import make_tenant
from tests.web import web_server
from tests.workers import WorkerProcess

# Sync Playwright runs an event loop in this thread; the ORM calls of the test itself are safe.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

TENANTS = 10_000
SHARDS = 40
BUSY = 300
WAITING = 900
LATE = 20  # busy tenants whose jobs wait past twice the objective (default class: 1 h)
OVER = 20  # and past it
TOP_N = 50  # the setting's default
FRAME_BYTES_MAX = 50 * 1024  # the targets
LATE_MS_MAX = 100
FIRST_RENDER_MS_MAX = 1000
TIMER_MS = 10
WATCH_SECONDS = 20  # frames measured while the page is watched
# A tenant with more waiting than the seeded busy ones (3 each) for most of that time: in the top N.
ACME_JOBS = 12
ACME_JOB_SECONDS = 3

# In the page: a timer due every TIMER_MS and how late it ran at worst (a trivial script
# queued at any moment waits at most that long); the longest task and the longest animation
# frame (script, style, layout and paint of one frame) the browser reports over 50 ms.
RESPONSIVENESS_PROBE = """(timerMs) => {
  const probe = window.__probe = {maxLateMs: 0, runs: 0, longTaskMs: 0, longTasks: 0, longFrameMs: 0};
  let due = performance.now() + timerMs;
  (function tick() {
    const now = performance.now();
    probe.maxLateMs = Math.max(probe.maxLateMs, now - due);
    probe.runs += 1;
    due = now + timerMs;
    setTimeout(tick, timerMs);
  })();
  new PerformanceObserver((list) => {
    for (const entry of list.getEntries()) {
      probe.longTasks += 1;
      probe.longTaskMs = Math.max(probe.longTaskMs, entry.duration);
    }
  }).observe({type: "longtask"});
  new PerformanceObserver((list) => {
    for (const entry of list.getEntries()) {
      if (entry.duration <= probe.longFrameMs) continue;
      probe.longFrameMs = entry.duration;
      probe.longFrame = {  // where the longest frame's time went
        scriptsMs: entry.scripts.reduce((sum, s) => sum + s.duration, 0),
        beforeRenderMs: entry.renderStart ? entry.renderStart - entry.startTime : entry.duration,
        styleAndLayoutMs: entry.styleAndLayoutStart ? entry.startTime + entry.duration - entry.styleAndLayoutStart : 0,
      };
    }
  }).observe({type: "long-animation-frame"});
}"""


def seed_cell_histories(client: redis.Redis) -> None:
    """Every cell's history as two minutes of ticks would have left it (the tick appends the
    cell's oldest age each second): the first picture is measured at its full size."""
    pipe = client.pipeline(transaction=False)
    for cell in snapshot_build(with_history=False)["cells"]:
        age = cell["oldest_age_s"] or 0.0
        key = history_key(cell["shard"], cell["class"])
        # Oldest first, so that the newest ends up first, as the tick keeps it.
        pipe.lpush(key, *[f"{max(0.0, age - (HISTORY_LEN - i)):.3f}" for i in range(HISTORY_LEN)])
    pipe.execute()


# The main thread's lateness is a time measured on a shared machine: `make test` runs it
# tagged "serial", on its own after the shards, so the suite's other processes do not skew it.
@tag("serial")
class DashboardAtScaleTests(RedisTransactionTestCase):
    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        chromium_require(self)
        staff_create()
        fleet_seed(TENANTS, WAITING, SHARDS, lambda line: None, busy=BUSY)
        now = timezone.now()
        for slugs, age in (
            ([f"t{i}" for i in range(LATE)], timedelta(hours=2, minutes=30)),
            ([f"t{i}" for i in range(LATE, LATE + OVER)], timedelta(hours=1, minutes=30)),
        ):
            Job.objects.filter(tenant__slug__in=slugs, status=JobStatus.PARKED).update(submitted_at=now - age)
        cells.cells_rebuild()  # rows written straight to the database reach the cells so
        self.tenant, self.key = make_tenant("acme", max_concurrency=2)
        seed_cell_histories(self.redis)
        self.server = web_server(production=True, processes=2)
        self.server.start()
        self.addCleanup(self.server.stop)
        self.base = self.server.base_url

    def submit(self, n: int) -> None:
        for _ in range(n):
            request = urllib.request.Request(
                f"{self.base}/api/v1/jobs",
                data=json.dumps({"task": "demo.sleep", "args": {"seconds": ACME_JOB_SECONDS}}).encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"},
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                self.assertEqual(response.status, 202)

    def first_render_ms(self, page: Any) -> float:
        page.wait_for_function("window.fqDashboard && window.fqDashboard.firstRenderAt !== null", timeout=30_000)
        return float(page.evaluate("window.fqDashboard.firstRenderAt"))

    def test_ten_thousand_tenants_stay_live(self) -> None:
        from playwright.sync_api import expect, sync_playwright

        figures: dict[str, Any] = {"tenants": TENANTS + 1, "shards": SHARDS + 1, "busy": BUSY + 1}
        sockets: list[list[tuple[float, int]]] = []  # per websocket: (when, bytes) as Chromium received them

        def on_websocket(ws: Any) -> None:
            received: list[tuple[float, int]] = []
            sockets.append(received)

            def on_frame(payload: str | bytes) -> None:
                size = len(payload) if isinstance(payload, bytes) else len(payload.encode())
                received.append((time.monotonic(), size))

            ws.on("framereceived", on_frame)

        with WorkerProcess(slots=2), sync_playwright() as pw:
            browser = chromium_launch(pw)
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.on("websocket", on_websocket)
            try:
                staff_login(page, self.base, "/dashboard/")
                figures["first_render_cold_server_ms"] = round(self.first_render_ms(page))
                expect(page.locator("#conn-state")).to_have_text("live", timeout=10_000)
                page.wait_for_timeout(2500)  # the ticks run: their picture is kept for pages that open
                page.reload()
                figures["first_render_ms"] = round(self.first_render_ms(page))
                expect(page.locator("#conn-state")).to_have_text("live", timeout=10_000)
                opened_before = len(sockets) - 1  # the reloaded page's sockets from here on

                # The table: the top N, the red tenants first; the totals over all of them.
                top = page.locator("#tenants-top tr[data-tenant]")
                expect(top).to_have_count(TOP_N)
                expect(page.locator("#tenants tr[data-tenant]")).to_have_count(TOP_N)
                expect(page.locator("#total-tenants")).to_have_text(str(TENANTS + 1))
                expect(page.locator("#total-red")).to_have_text(str(LATE))
                expect(page.locator("#total-orange")).to_have_text(str(OVER))
                first_slug = top.first.get_attribute("data-tenant")
                self.assertIn(first_slug, {f"t{i}" for i in range(LATE)})
                expect(top.first.locator("td.oldest")).to_have_class("oldest red")
                expect(page.locator("#grid tbody tr")).to_have_count(20)
                expect(page.locator("#grid-summary")).to_contain_text(f"of {SHARDS + 1} shards")

                # Frames arrive while the page is measured; the API's jobs move acme's row. A
                # blank page beside it runs the same probe: the machine's own scheduling noise.
                blank = browser.new_page()
                blank.evaluate(RESPONSIVENESS_PROBE, TIMER_MS)
                page.evaluate(RESPONSIVENESS_PROBE, TIMER_MS)
                started = time.monotonic()
                evaluate_ms = []
                self.submit(ACME_JOBS)
                acme_shown = False
                while time.monotonic() - started < WATCH_SECONDS:
                    t0 = time.perf_counter()
                    page.evaluate("1")  # a trivial script, from outside the page
                    evaluate_ms.append((time.perf_counter() - t0) * 1000)
                    if not acme_shown and page.locator("tr[data-tenant=acme]").count():
                        acme_shown = True
                    page.wait_for_timeout(100)
                watched_sockets = len(sockets)
                probe = page.evaluate("window.__probe")
                blank_probe = blank.evaluate("window.__probe")
                blank.close()
                stats = page.evaluate("window.fqDashboard")
                self.assertTrue(acme_shown, "the tenant with running jobs came into the top N")

                # Search by slug for a tenant outside the top N: its live row, a pin, opened.
                page.fill("#tenant-search", "t9999")
                found = page.locator("#tenants-search tr[data-tenant=t9999]")
                expect(found).to_have_count(1, timeout=10_000)
                expect(page.locator("#search-status")).to_have_text("1 match.")
                expect(found.locator("td.limit")).to_have_text("1", timeout=10_000)  # its live row
                page.fill("#tenant-search", "t999")
                expect(page.locator("#search-status")).to_have_text("11 matches.", timeout=10_000)
                found.locator("button.pin").click()
                expect(page.locator("#tenants-pinned tr[data-tenant=t9999]")).to_have_count(1)
                found = page.locator("#tenants-pinned tr[data-tenant=t9999]")
                found.locator("button.open").click()
                expect(page.locator("#tenant-detail")).to_be_visible()
                expect(page.locator("#detail-slug")).to_have_text("t9999")
                expect(page.locator("#detail-admin")).to_have_attribute("href", "/dashboard/tenants/t9999/admin/")
                expect(page.locator("#detail-limit")).to_have_text("1", timeout=10_000)
                page.wait_for_timeout(3000)  # a few ticks draw its sparklines
                expect(page.locator("#detail-spark-in-flight polyline")).not_to_have_attribute("points", "")
                page.screenshot(path=str(OUTPUT / "dashboard-scale.png"), full_page=True)
                page.locator("#tenant-panel").screenshot(path=str(OUTPUT / "dashboard-scale-tenants.png"))

                page.reload()  # the pin is kept in this browser
                pinned = page.locator("#tenants-pinned tr[data-tenant=t9999]")
                expect(pinned).to_have_count(1, timeout=10_000)
                expect(pinned.locator("td.limit")).to_have_text("1", timeout=10_000)
            except Exception:
                page.screenshot(path=str(OUTPUT / "dashboard-scale-failure.png"), full_page=True)
                raise
            finally:
                browser.close()

        # Every socket the reloaded page opened (it reconnects if the server drops one): the
        # first frame of each is a picture, the others deltas.
        watched = [frames for frames in sockets[opened_before:watched_sockets] if frames]
        pictures = [frames[0][1] for frames in sockets[opened_before:] if frames]
        measured = [
            size for frames in watched for when, size in frames[1:] if started <= when <= started + WATCH_SECONDS
        ]
        figures.update(
            first_picture_bytes=pictures[0],
            picture_bytes_max=max(pictures),
            reconnects_while_watched=len(watched) - 1,
            frames_measured=len(measured),
            frame_bytes_max=max(measured),
            frame_bytes_median=sorted(measured)[len(measured) // 2],
            main_thread_late_ms_max=round(probe["maxLateMs"], 1),
            blank_page_late_ms_max=round(blank_probe["maxLateMs"], 1),
            timer_runs=probe["runs"],
            long_tasks=probe["longTasks"],
            long_task_ms_max=round(probe["longTaskMs"], 1),
            long_animation_frame_ms_max=round(probe["longFrameMs"], 1),
            long_animation_frame=probe.get("longFrame"),
            page_ms_per_frame_max=round(stats["maxHandleMs"], 1),
            evaluate_roundtrip_ms_max=round(max(evaluate_ms), 1),
            load_average=os.getloadavg()[0],
        )
        (OUTPUT / "dashboard-scale.json").write_text(json.dumps(figures, indent=2) + "\n")
        print(f"\ndashboard at scale: {json.dumps(figures)}")
        self.assertGreaterEqual(len(measured), WATCH_SECONDS // 2, "a frame about every second")
        self.assertLessEqual(figures["frame_bytes_max"], FRAME_BYTES_MAX, figures)
        self.assertLessEqual(figures["picture_bytes_max"], FRAME_BYTES_MAX, figures)
        self.assertLessEqual(figures["main_thread_late_ms_max"], LATE_MS_MAX, figures)
        self.assertLessEqual(figures["first_render_ms"], FIRST_RENDER_MS_MAX, figures)
