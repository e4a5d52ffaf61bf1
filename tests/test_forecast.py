"""Scaling that anticipates the day: the hour-of-week profile, the replay, `fairqueue_slots_desired`."""

from __future__ import annotations

import io
import json
import math
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

from django.core.management import CommandError, call_command
from django.test import Client, SimpleTestCase

from dashboard.metrics import collector_register
from dashboard.snapshot import snapshot_build
from fairqueue.jobs import capacity
from fairqueue.jobs.capacity import HISTORY_KEY, capacity_step, profiles_read
from fairqueue.jobs.fleet import worker_heartbeat
from fairqueue.jobs.forecast import (
    HOURS_PER_WEEK,
    SECONDS_PER_HOUR,
    forecast_peak,
    hour_index,
    hour_of_week,
    profile_at,
    profile_build,
    slots_desired,
    with_spread,
)
from fairqueue.jobs.forecast_replay import TraceJob, replay, trace_read, trace_write
from fairqueue.jobs.models import Job, JobStatus
from tests.base import RedisTestCase
from tests.factories import make_tenant
from tests.test_metrics import samples

MONDAY = datetime(2026, 1, 5, tzinfo=UTC).timestamp()
DAY = 24 * SECONDS_PER_HOUR
WARMUP = 600
JOB_SECONDS = 120.0


def rising_day_trace(days: int) -> list[TraceJob]:
    """Evenly spaced jobs of fixed length (no randomness): 2 busy slots at night, a rise
    from 06:00 to 10:00 up to 40, a plateau, a fall from 17:00 to 19:00. Every day alike."""

    def busy(hour: float) -> float:
        if 6 <= hour < 10:
            return 2 + 38 * (hour - 6) / 4
        if 10 <= hour < 17:
            return 40
        if 17 <= hour < 19:
            return 40 - 38 * (hour - 17) / 2
        return 2

    jobs, owed = [], 0.0
    step = 10.0
    for day in range(days):
        for i in range(int(DAY / step)):
            at = MONDAY + day * DAY + i * step
            owed += busy(i * step / SECONDS_PER_HOUR) / JOB_SECONDS * step  # arrivals = busy / duration
            while owed >= 1:
                jobs.append(TraceJob(at, JOB_SECONDS))
                owed -= 1
    return jobs


class ProfileModelTests(SimpleTestCase):
    def test_hour_of_week_counts_from_monday_midnight_utc(self) -> None:
        self.assertEqual(hour_of_week(hour_index(MONDAY)), 0)
        self.assertEqual(hour_of_week(hour_index(MONDAY + 7 * DAY - 1)), HOURS_PER_WEEK - 1)

    def test_weeks_are_weighted_by_recency_and_none_before_the_history(self) -> None:
        h = hour_index(MONDAY) + 9  # Monday 09:00, four weeks of it: 10, 20, 30, 40 slots
        hourly = {h + k * HOURS_PER_WEEK: 10.0 * (k + 1) for k in range(4)}
        now = h + 3 * HOURS_PER_WEEK + 5
        profile = profile_build(hourly, now_hour=now, history_start_hour=h, weeks=4, decay=0.5)
        weights = [1, 0.5, 0.25, 0.125]  # latest (40) first
        expected = sum(w * v for w, v in zip(weights, (40, 30, 20, 10), strict=True)) / sum(weights)
        self.assertAlmostEqual(profile[9], expected)
        # With history from the last two weeks only, the older weeks do not count as idle.
        short = profile_build(hourly, now_hour=now, history_start_hour=h + 2 * HOURS_PER_WEEK, weeks=4, decay=0.5)
        self.assertAlmostEqual(short[9], (40 + 0.5 * 30) / 1.5)
        # An hour that has not ended yet is not used: at 09:30 of the fourth week, the third's counts.
        during = profile_build(hourly, now_hour=h + 3 * HOURS_PER_WEEK, history_start_hour=h, weeks=1)
        self.assertAlmostEqual(during[9], 30)

    def test_the_forecast_rises_smoothly_and_looks_one_warmup_ahead(self) -> None:
        profile = [0.0] * HOURS_PER_WEEK
        profile[9] = 20.0
        nine_thirty = MONDAY + 9.5 * SECONDS_PER_HOUR
        self.assertAlmostEqual(profile_at(profile, nine_thirty), 20.0)  # the hour's mean at its middle
        self.assertAlmostEqual(profile_at(profile, nine_thirty - 1800), 10.0)  # half-way from 08:30
        eight_fifty = MONDAY + 8 * SECONDS_PER_HOUR + 50 * 60
        ahead = forecast_peak({"default": profile}, start=eight_fifty, horizon_seconds=WARMUP, spread_sigmas=0)
        self.assertAlmostEqual(ahead, profile_at(profile, eight_fifty + WARMUP))
        self.assertAlmostEqual(with_spread(16.0, 1.0), 20.0)  # mean + one Poisson sigma

    def test_desired_is_the_larger_of_the_need_now_and_the_forecast(self) -> None:
        self.assertEqual(
            slots_desired(busy_now=17, forecast_busy=8.5, target_utilisation=0.85),
            {"needed_now": 20, "forecast": 10, "desired": 20},
        )
        self.assertEqual(
            slots_desired(busy_now=0, forecast_busy=8.5, target_utilisation=0.85),
            {"needed_now": 0, "forecast": 10, "desired": 10},
        )


class ReplayTests(SimpleTestCase):
    def test_the_forecast_leads_utilisation_on_a_rising_day(self) -> None:
        report = replay(
            rising_day_trace(14), warmup_seconds=WARMUP, target_utilisation=0.85, worker_slots=4, min_slots=4
        )
        self.assertGreater(report["scale_up_steps_rising"], 5)
        # Asked for at least a warm-up before utilisation does: ready when the rise comes.
        self.assertGreaterEqual(report["minutes_earlier_median_rising"], WARMUP / 60)
        self.assertEqual(report["scale_up_steps_forecast_later"], 0)
        self.assertLess(report["underprovisioned_slot_hours"], report["utilisation_underprovisioned_slot_hours"] / 4)
        self.assertLess(report["unserved_slot_hours"], report["utilisation_unserved_slot_hours"])

    def test_a_trace_shorter_than_two_weeks_is_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, "at least two weeks"):
            replay(rising_day_trace(10), warmup_seconds=WARMUP, target_utilisation=0.85, worker_slots=4, min_slots=4)

    def test_the_command_writes_the_figures_as_json(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out, trace = Path(tmp) / "forecast.json", Path(tmp) / "trace.csv"
            stdout = io.StringIO()
            call_command(
                "forecast", "--synthetic", "--quick", "--json", str(out), "--write-trace", str(trace), stdout=stdout
            )
            report = json.loads(out.read_text())
            for key in (
                "minutes_earlier_median",
                "overprovisioned_slot_hours",
                "underprovisioned_slot_hours",
                "utilisation_overprovisioned_slot_hours",
                "utilisation_underprovisioned_slot_hours",
            ):
                self.assertIsInstance(report[key], float, key)
                self.assertGreaterEqual(report[key], 0, key)
            self.assertGreater(report["scale_up_steps"], 0)
            self.assertIn("forecast asked earlier by a median of", stdout.getvalue())
            # The written trace replays to the same figures from the file.
            self.assertEqual(len(trace_read(trace)), report["trace"]["jobs"])
            again = Path(tmp) / "again.json"
            call_command("forecast", "--from-trace", str(trace), "--json", str(again), stdout=io.StringIO())
            replayed = json.loads(again.read_text())
            self.assertEqual(replayed["minutes_earlier_median"], report["minutes_earlier_median"])

    def test_bad_traces_say_what_is_wrong(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            bad = Path(tmp) / "bad.csv"
            bad.write_text("submitted_at,duration_s\n1767571200,12\n1767571260,soon\n")
            with self.assertRaisesRegex(CommandError, r"bad.csv:3"):
                call_command("forecast", "--from-trace", str(bad), stdout=io.StringIO())
            with self.assertRaisesRegex(CommandError, "no trace file"):
                call_command("forecast", "--from-trace", str(Path(tmp) / "missing.csv"), stdout=io.StringIO())
            short = Path(tmp) / "short.csv"
            trace_write(short, rising_day_trace(3))
            with self.assertRaisesRegex(CommandError, "at least two weeks"):
                call_command("forecast", "--from-trace", str(short), stdout=io.StringIO())


def history_jobs(tenant, *, hours: list[datetime], busy: int) -> None:  # type: ignore[no-untyped-def]
    """`busy` finished one-hour jobs starting at each of `hours`: `busy` slots all hour."""
    rows = []
    for start in hours:
        for _ in range(busy):
            rows.append(
                Job(
                    tenant=tenant,
                    task="demo.sleep",
                    latency_class="default",
                    status=JobStatus.SUCCEEDED,
                    started_at=start,
                    finished_at=start + timedelta(hours=1),
                )
            )
    Job.objects.bulk_create(rows)


class SlotsDesiredTests(RedisTestCase):
    """The profile from the job history in the database, into /metrics and the snapshot."""

    BUSY = 8

    def setUp(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, _ = make_tenant("acme")
        now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        week_ago = [now - timedelta(days=7, hours=h) for h in range(-2, 3)]  # that hour of the week ±2 h
        today = [now - timedelta(hours=h) for h in (1, 2)]  # this week's finished hours alike
        history_jobs(self.tenant, hours=week_ago + today, busy=self.BUSY)
        # Batch-lane jobs are never demand the fleet must scale for.
        history_jobs(self.tenant, hours=[now - timedelta(days=7)], busy=3)
        batch_ids = list(Job.objects.filter(started_at=now - timedelta(days=7)).values_list("id", flat=True)[:3])
        Job.objects.filter(id__in=batch_ids).update(batch=True)
        self.http = Client()

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        collector_register().invalidate()
        return samples(self.http.get("/metrics").content.decode())

    def test_slots_desired_anticipates_the_hour_and_follows_the_need_when_larger(self) -> None:
        capacity_step()  # the duty: rebuild the profile, record a chart point
        profiles, meta = profiles_read()
        self.assertEqual(set(profiles), {"default"})
        this_hour = hour_of_week(hour_index(datetime.now(UTC).timestamp()))
        self.assertAlmostEqual(profiles["default"][this_hour], self.BUSY)
        self.assertIsNotNone(meta["computed_at"])
        expected = math.ceil(with_spread(max(profiles["default"][this_hour : this_hour + 2]), 1.0) / 0.85 - 1e-9)
        s = self.scrape()
        self.assertEqual(s[("fairqueue_slots_needed_now", ())], 0)  # no worker busy
        self.assertEqual(s[("fairqueue_slots_forecast", ())], expected)
        self.assertEqual(s[("fairqueue_slots_desired", ())], expected)
        self.assertIn(("fairqueue_forecast_busy_slots", (("class", "default"),)), s)

        worker_heartbeat(hostname="w1", slots=20, running=17, running_batch=0)
        s = self.scrape()
        self.assertEqual(s[("fairqueue_slots_needed_now", ())], 20)  # 17 busy at 0.85
        self.assertEqual(s[("fairqueue_slots_desired", ())], max(20, expected))

        snap = snapshot_build()
        self.assertEqual(snap["capacity"]["desired"], max(20, expected))
        self.assertEqual(len(snap["capacity"]["history"]), 1)  # the point the duty recorded
        self.assertEqual(len(snap["capacity"]["ahead"]), 25)
        self.assertEqual(snap["capacity"]["ahead"][0][1], expected)  # the chart's line ahead starts at the term
        self.assertEqual(snap["workers"][0]["hostname"], "w1")

    def test_the_duty_rebuilds_once_per_period_and_after_redis_loses_it(self) -> None:
        capacity_step()
        capacity_step()
        self.assertEqual(self.redis.llen(HISTORY_KEY), 1)  # one point per period, however often it ticks
        computed = profiles_read()[1]["computed_at"]
        capacity_step()
        self.assertEqual(profiles_read()[1]["computed_at"], computed)
        self.redis.delete(capacity.PROFILES_KEY)
        capacity_step()
        self.assertGreater(profiles_read()[1]["computed_at"], computed)
