"""The dashboard's capacity chart and worker table in a real browser (the production server, real
workers, headless Chromium): slots live, desired and the forecast drawn from the job
history, and a worker under memory pressure saying why it offers fewer slots.

The chart's last three hours are seeded (a fleet's history takes hours to accrue): each
point is what the duty would have recorded under the profile built from the database,
with the product's own functions. Screenshots: var/test-output/capacity*.png (the copy in
docs/img/ comes from here).
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from datetime import UTC, datetime, timedelta

import redis

from fairqueue.jobs.capacity import HISTORY_KEY, capacity_figures, capacity_read, profiles_read, profiles_refresh
from fairqueue.jobs.fleet import WORKERS_KEY, fleet_read
from fairqueue.jobs.forecast import profiles_at
from fairqueue.jobs.submission import JobRequest, job_submit
from tests import worker_tasks  # noqa: F401  (registers test.hog here, to submit it)
from tests.base import RedisTransactionTestCase
from tests.browser import OUTPUT, chromium_launch, chromium_require, staff_create, staff_login
from tests.factories import make_tenant
from tests.test_forecast import history_jobs
from tests.web import web_server
from tests.workers import WorkerProcess, wait_for

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

# Busy slots an hour before now (-4 .. -1), this hour (0) and ahead (1 .. 3): a morning rise.
RISE = {-4: 1, -3: 1, -2: 2, -1: 3, 0: 4, 1: 6, 2: 9, 3: 12}
WORKER_SLOTS = 4
TARGET = 0.85
SEEDED_MINUTES = 180
GIB = 1024**3


def seed_chart_history(client: redis.Redis, now: float) -> None:
    """The points the duty would have recorded each minute under the current profile."""
    profiles, _ = profiles_read()
    desired: dict[int, int] = {}
    points = []
    warmup_minutes = 10
    for i in range(SEEDED_MINUTES, 0, -1):
        ts = int(now) - i * 60
        busy = round(profiles_at(profiles, ts))
        figures = capacity_figures(busy_now=busy, profiles=profiles, target_utilisation=TARGET, now=ts)
        desired[i] = math.ceil(figures["desired"] / WORKER_SLOTS) * WORKER_SLOTS
        ready = min(desired[i], desired.get(i + warmup_minutes, desired[i]))  # a warm-up to serve
        points.append(json.dumps([ts, ready, busy, figures["desired"], figures["forecast"]]))
    client.delete(HISTORY_KEY)
    client.lpush(HISTORY_KEY, *points)  # newest ends up first, as the duty keeps it


class CapacityBrowserTests(RedisTransactionTestCase):
    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        chromium_require(self)
        staff_create()
        self.tenant, _ = make_tenant("acme", floor=4, max_concurrency=8)
        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        for offset, busy in RISE.items():
            history_jobs(self.tenant, hours=[hour + timedelta(hours=offset, days=-7)], busy=busy)
            if offset < 0:  # this week's finished hours alike
                history_jobs(self.tenant, hours=[hour + timedelta(hours=offset)], busy=busy)
        profiles_refresh()
        seed_chart_history(self.redis, time.time())
        self.server = web_server(production=True, processes=2)
        self.server.start()
        self.addCleanup(self.server.stop)
        self.base = self.server.base_url

    def test_capacity_chart_and_worker_backpressure_in_a_real_browser(self) -> None:
        from playwright.sync_api import expect, sync_playwright  # heavy, and only this test needs it

        steady = WorkerProcess(slots=8, name="steady")
        pressed = WorkerProcess(
            slots=WORKER_SLOTS,
            name="pressed",
            FAIRQUEUE_TASK_MODULES="tests.worker_tasks",
            FAIRQUEUE_WORKER_MEMORY_LIMIT_BYTES=str(GIB),
            FAIRQUEUE_BACKPRESSURE_MEMORY_HIGH="0.5",
            FAIRQUEUE_BACKPRESSURE_MEMORY_LOW="0.4",
            FAIRQUEUE_BACKPRESSURE_RECOVER_SECONDS="2",
        )
        hold = f"test:hold:{uuid.uuid4().hex}"
        self.redis.set(hold, "1", ex=300)
        with pressed, sync_playwright() as pw:
            # The hog goes to the pressed worker, alone until it has shrunk; then the steady one joins.
            job_submit(tenant=self.tenant, req=JobRequest(task="test.hog", args={"megabytes": 700, "hold_key": hold}))
            wait_for(lambda: int(self.redis.hget(WORKERS_KEY, pressed.hostname) or 9) == 1, timeout=60)
            steady.start()
            self.addCleanup(steady.kill)
            browser = chromium_launch(pw)
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            try:
                staff_login(page, self.base, "/dashboard/")
                expect(page.locator("#conn-state")).to_have_text("live", timeout=10_000)

                expect(page.locator("#cap-slots")).to_have_text("9", timeout=10_000)  # 8 + the pressed worker's 1

                def shown_as_computed() -> bool:
                    # Recomputed on every try: the forecast term moves on as the minutes pass.
                    now = capacity_read(fleet=fleet_read(), target_utilisation=TARGET, with_history=False)
                    shown = (page.locator("#cap-desired").text_content(), page.locator("#cap-forecast").text_content())
                    return now["forecast"] > 0 and shown == (str(now["desired"]), str(now["forecast"]))

                wait_for(shown_as_computed, timeout=15, interval=0.3, message="desired and forecast as computed")
                for line in ("live", "desired", "forecast", "ahead"):
                    expect(page.locator(f"#capacity-chart polyline.{line}")).to_have_count(1)
                points = page.locator("#capacity-chart polyline.live").get_attribute("points") or ""
                self.assertGreater(len(points.split()), SEEDED_MINUTES)  # the seeded hours and now

                row = page.locator(f"#workers tr[data-worker='{pressed.hostname}']")
                expect(row.locator("td.offered")).to_have_text("1", timeout=10_000)
                expect(row.locator("td.configured")).to_have_text("4")
                expect(row.locator("td.reason")).to_contain_text("memory")
                expect(row).to_have_class("pressured")
                page.wait_for_timeout(1500)
                page.locator("#capacity-panel").screenshot(path=str(OUTPUT / "capacity-chart.png"))
                page.screenshot(path=str(OUTPUT / "capacity.png"), full_page=True)

                self.redis.delete(hold)  # pressure eases: the row comes back to its 4 slots
                expect(row.locator("td.offered")).to_have_text("4", timeout=60_000)
                expect(row.locator("td.reason")).to_have_text("—", timeout=30_000)
            except Exception:
                page.screenshot(path=str(OUTPUT / "capacity-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
