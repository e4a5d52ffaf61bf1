"""The what-if on real rows: `manage.py whatif`, the admin's Preview (tenant and pool
settings), and the replay of a recorded `bench noisy` run against its measured waits."""

from __future__ import annotations

import json
import random
import statistics
import tempfile
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import SimpleTestCase
from django.urls import reverse
from django.utils import timezone

from fairqueue.bench.noisy import NOISY_SLUG, PRESETS, _policy_setup
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.simulation.bench_trace import trace_jobs
from fairqueue.simulation.calibration import latencies_measure
from fairqueue.simulation.scheduler import SimConfig, percentile, simulate
from tenants.models import PoolSettings, Tenant
from tenants.policy import PolicySnapshot
from tenants.whatif import policy_from_database
from tests.base import RedisTestCase
from tests.factories import make_tenant
from tests.test_tenants_admin import tenant_form

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "whatif"
# The duty tick's period on the fleet that recorded the fixtures (2026-12-02, with the pool
# cap and the slot-second fair order), which the replay models.
FIXTURES_TICK_SECONDS = 0.25
# The bar: simulated P50 and P99 waits within 25 % of the measured ones, or within
# ABSOLUTE_TOLERANCE_S of them for waits too short for a share to mean anything: with the pool
# cap the steady tenants' waits are tens of milliseconds, about what one dispatch takes, and
# the model draws dispatch latencies from a distribution, not job by job.
TOLERANCE = 0.25
ABSOLUTE_TOLERANCE_S = 0.05
SEEDS = 7  # the model draws latencies: the median over seeds is its prediction


def shard_history(
    workload: list[tuple[Tenant, int, float, float]], *, start: Any, slots: int, seconds: float, rnd: random.Random
) -> None:
    """Rows of finished jobs as a shard of `slots` slots ran them, first come first served:
    for each (tenant, count, spacing, offset) a job every `spacing` seconds from `offset`
    seconds after `start`, each about `seconds` long."""
    arrivals = sorted(
        (
            (start + timedelta(seconds=offset + i * spacing), tenant)
            for tenant, count, spacing, offset in workload
            for i in range(count)
        ),
        key=lambda arrival: arrival[0],
    )
    free = [start] * slots
    rows, submits = [], []
    for submitted, tenant in arrivals:
        slot = min(range(slots), key=lambda k: free[k])
        started = max(submitted, free[slot]) + timedelta(seconds=0.01)
        finished = started + timedelta(seconds=seconds * rnd.uniform(0.5, 1.5))
        free[slot] = finished
        rows.append(
            Job(
                tenant=tenant,
                task="demo.sleep",
                latency_class="default",
                priority=100,
                status=JobStatus.SUCCEEDED,
                engine_tag=f"s:{tenant.shard.name}",
                admitted_at=submitted + timedelta(seconds=0.002),
                started_at=started,
                finished_at=finished,
                worker=f"w{slot % 2}",
            )
        )
        submits.append(submitted)
    created = Job.objects.bulk_create(rows)
    for job, submitted in zip(created, submits, strict=True):  # submitted_at is auto_now_add: set it after
        Job.objects.filter(pk=job.pk).update(submitted_at=submitted)


def rows_of_a_busy_half_hour(steady: Tenant, bursty: Tenant) -> None:
    """A steady tenant's job every 5 s and, five minutes in, a burst of 400 from another,
    on 8 slots."""
    start = timezone.now() - timedelta(minutes=30)
    workload = [(steady, 300, 5.0, 0.0), (bursty, 400, 0.01, 300.0)]
    shard_history(workload, start=start, slots=8, seconds=2.0, rnd=random.Random(5))


class RowsTestCase(RedisTestCase):
    """A shard where a bursty tenant and a steady one shared 8 slots in the last half hour."""

    def setUp(self) -> None:
        super().setUp()
        with self.captureOnCommitCallbacks(execute=True):
            self.steady, _ = make_tenant("steady", floor=1, shard_capacity=8)
            self.bursty, _ = make_tenant("bursty", floor=1, shard_capacity=8)
        rows_of_a_busy_half_hour(self.steady, self.bursty)


class WhatIfOnRows(RowsTestCase):
    def command(self, *args: str) -> str:
        out = StringIO()
        call_command("whatif", *args, stdout=out)
        return out.getvalue()

    def test_command_compares_current_and_proposed(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "whatif.json"
            change = ["--set", "bursty.max_concurrency=2"]
            out = self.command("--shard", "default", "--hours", "1", "--slots", "8", *change, "--json", str(path))
            doc = json.loads(path.read_text())
        self.assertIn("Changes: bursty.max_concurrency None -> 2", out)
        self.assertIn("700 jobs", out)
        self.assertRegex(out, r"steady\s+300\s")
        self.assertEqual(doc["jobs"], 700)
        now, new = doc["current"]["waits"]["bursty"], doc["proposed"]["waits"]["bursty"]
        # 400 jobs of about 2 s on 2 slots instead of (nearly) all 8: about 4x the drain.
        self.assertGreater(new["p50"], 3 * now["p50"])
        # The same work in the hour, but while jobs waited the pool was far less used.
        self.assertAlmostEqual(doc["proposed"]["utilisation"], doc["current"]["utilisation"], places=3)
        self.assertLess(doc["proposed"]["backlog_utilisation"], doc["current"]["backlog_utilisation"] / 2)
        self.assertEqual(len(doc["current"]["series_waiting"]), len(doc["current"]["series_t"]))
        self.assertGreater(max(doc["current"]["series_waiting"]), 100)
        self.assertIsNone(Tenant.objects.get(slug="bursty").max_concurrency, "a what-if saves nothing")

    def test_command_refuses_bad_input_clearly(self) -> None:
        cases = {
            ("--shard", "nope"): "No shard 'nope'",
            ("--shard", "default", "--hours", "0"): "Hours must be more than 0",
            ("--shard", "default", "--hours", "x"): "Hours must be a number",
            ("--shard", "default", "--set", "steady.floor"): "write SLUG.FIELD=VALUE",
            ("--shard", "default", "--set", "ghost.floor=2"): "no tenant 'ghost'",
            ("--shard", "default", "--set", "steady.name=x"): "'name' is not one of",
            ("--shard", "default", "--set", "steady.floor=-1"): "steady",
            ("--shard", "default", "--set", "steady.burst_pct=11"): "Ensure this value is less than or equal to 10",
            ("--shard", "default", "--set", "pool.f_min=5"): "must not exceed f_max",
            ("--shard", "default", "--slots", "0"): "--slots must be at least 1",
        }
        for args, message in cases.items():
            with self.subTest(args=args), self.assertRaisesMessage(CommandError, message):
                self.command(*args)

    def test_nothing_to_replay_is_said(self) -> None:
        Job.objects.all().delete()
        with self.assertRaisesMessage(CommandError, "nothing to replay"):
            self.command("--shard", "default")

    def test_proposed_policy_keeps_unsaved_values_apart(self) -> None:
        steady = Tenant.objects.get(slug="steady")
        steady.floor = 5
        proposed = policy_from_database(tenants=[steady])
        self.assertEqual(proposed.tenants["steady"].floor, 5)
        self.assertEqual(policy_from_database().tenants["steady"].floor, 1)
        pool = PoolSettings.load()
        pool.target_utilisation = 0.5
        self.assertEqual(policy_from_database(pool=pool).pool.target_utilisation, 0.5)


class AdminPreview(RowsTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.staff = get_user_model().objects.create_superuser("boss", "boss@example.com", "pw-not-used-123")
        self.client.force_login(self.staff)
        self.url = reverse("admin:tenants_tenant_change", args=[self.steady.pk])

    def form(self, **overrides: Any) -> dict[str, Any]:
        data = tenant_form(slug="steady", name="Steady", floor="1", shard=self.steady.shard_id)
        data.update(overrides)
        return data

    def test_change_page_explains_the_live_state_beside_the_preview(self) -> None:
        page = self.client.get(self.url)
        self.assertContains(page, "Live state (Redis)")
        self.assertContains(page, "What-if preview")
        self.assertContains(page, 'name="_whatif"')
        html = page.content.decode()
        self.assertRegex(html, r"limit \d+ = max\(ceiling 3 \S pressure [\d.]+ = \d+, floor 1\)")
        self.assertIn("matches the database: yes", html)
        self.assertIn("floor 1, burst floor 2, burst 50% of base, hard max none", html)
        self.assertIn("in flight, 0 parked", html)

    def test_preview_shows_the_comparison_and_saves_nothing(self) -> None:
        before = LogEntry.objects.count()
        response = self.client.post(self.url, self.form(floor="6", _whatif="Preview", _whatif_hours="1"))
        self.assertEqual(response.status_code, 200)
        self.assertContains(response, 'id="fq-whatif-table"')
        self.assertContains(response, "steady.floor 1 -&gt; 6")
        self.assertContains(response, "<svg")
        self.assertContains(response, 'value="6"')  # the operator's value is still in the form
        self.assertNotContains(response, "errornote")
        self.assertEqual(Tenant.objects.get(slug="steady").floor, 1)
        self.assertEqual(LogEntry.objects.count(), before)
        rows = {row["tenant"]: row for row in response.context["fq_whatif"].rows}
        self.assertEqual(rows["steady"]["jobs"], "300")
        self.assertEqual(rows["bursty"]["jobs"], "400")

    def test_bad_input_is_a_form_error_not_a_500(self) -> None:
        for data, fragment in (
            (self.form(floor="-3"), "Ensure this value is greater than or equal to 0"),
            (self.form(burst_pct="12"), "Burst must be between 0 and 10"),
            (self.form(max_concurrency="0"), "A hard max of 0 would block every job"),
        ):
            with self.subTest(fragment=fragment):
                response = self.client.post(self.url, {**data, "_whatif": "Preview"})
                self.assertEqual(response.status_code, 200)
                self.assertContains(response, fragment)
                self.assertContains(response, "Correct the errors in the form to preview it.")
                self.assertNotContains(response, 'id="fq-whatif-table"')
        for hours, fragment in (("abc", "Hours must be a number"), ("0", "more than 0"), ("48", "at most 24 hours")):
            with self.subTest(hours=hours):
                response = self.client.post(self.url, self.form(floor="6", _whatif="Preview", _whatif_hours=hours))
                self.assertEqual(response.status_code, 200)
                self.assertContains(response, fragment)
                self.assertNotContains(response, 'id="fq-whatif-table"')
        self.assertEqual(Tenant.objects.get(slug="steady").floor, 1)

    def test_save_still_saves(self) -> None:
        response = self.client.post(self.url, self.form(floor="3"))
        self.assertEqual(response.status_code, 302)
        self.assertEqual(Tenant.objects.get(slug="steady").floor, 3)

    def test_preview_needs_a_staff_login(self) -> None:
        self.client.logout()
        response = self.client.post(self.url, self.form(floor="6", _whatif="Preview"))
        self.assertEqual(response.status_code, 302)
        self.assertIn(reverse("admin:login"), response["Location"])
        get_user_model().objects.create_user("customer", password="pw-customer-123")
        self.client.login(username="customer", password="pw-customer-123")
        response = self.client.post(self.url, self.form(floor="6", _whatif="Preview"))
        self.assertEqual(response.status_code, 302)
        self.assertEqual(Tenant.objects.get(slug="steady").floor, 1)

    def test_pool_settings_preview(self) -> None:
        pool = PoolSettings.load()
        url = reverse("admin:tenants_poolsettings_change", args=[pool.pk])
        self.assertContains(self.client.get(url), 'name="_whatif_shard"')
        data = {
            "target_utilisation": "0.5",
            "f_min": "0.25",
            "f_max": "4.0",
            "rate_window_seconds": "300",
            "default_job_seconds": "1.0",
            "batch_objective_seconds": "43200",
            "floor_headroom": "0",
            "quarantine_after_losses": "1",
            "quarantine_poison_losses": "2",
            "quarantine_slots": "1",
            "backlog_quota": "100000",
            "batch_backlog_quota": "1000000",
            "submit_rate": "0",
            "submit_burst": "1000",
            "memory_guard_pct": "80",
            "_whatif": "Preview",
            "_whatif_hours": "1",
            "_whatif_shard": "default",
        }
        response = self.client.post(url, data)
        self.assertContains(response, 'id="fq-whatif-table"')
        self.assertContains(response, "pool.target_utilisation 0.85 -&gt; 0.5")
        self.assertEqual(PoolSettings.load().target_utilisation, 0.85)
        response = self.client.post(url, {**data, "f_min": "9"})
        self.assertContains(response, "must not exceed f_max")
        self.assertNotContains(response, 'id="fq-whatif-table"')


class ReplayOfARecordedBench(RedisTestCase):
    """A `bench noisy --quick --modes fair` run's jobs (tests/fixtures/whatif, recorded with
    fairqueue.simulation.bench_trace) replayed under the bench's own policy: the simulated
    quiet and noisy P50/P99 waits are within 25 % of the measured ones."""

    def test_simulated_waits_match_the_measured_ones(self) -> None:
        _policy_setup("fair", PRESETS["quick"])  # the bench's own tenants, shard and pool
        policy = policy_from_database()
        paths = sorted(FIXTURES.glob("noisy-*.json"))
        self.assertTrue(paths)
        for path in paths:
            with self.subTest(fixture=path.name):
                self.check(json.loads(path.read_text()), policy)

    def check(self, trace: dict[str, Any], policy: PolicySnapshot) -> None:
        arrivals, timings = trace_jobs(trace)
        slots = trace["slots"]
        latencies = latencies_measure(timings, slots=slots)
        measured = [t.started - t.submitted for t in timings]
        runs = [
            simulate(
                arrivals,
                policy=policy,
                shard="bench",
                config=SimConfig(slots=slots, latencies=latencies, seed=s, refresh_seconds=FIXTURES_TICK_SECONDS),
            )
            for s in range(SEEDS)
        ]
        figures = {}
        for kind in ("quiet", "noisy"):
            mine = [(a.tenant == NOISY_SLUG) == (kind == "noisy") for a in arrivals]
            real = [w for w, m in zip(measured, mine, strict=True) if m]
            for q in (50, 99):
                simulated = statistics.median(
                    percentile([w for w, m in zip(r.job_waits, mine, strict=True) if m], q) or 0.0 for r in runs
                )
                want = percentile(real, q) or 0.0
                figures[f"{kind} P{q}"] = (want, simulated)
        said = ", ".join(f"{k} {w:.3f} s measured, {s:.3f} s simulated" for k, (w, s) in figures.items())
        print(f"\n{trace['source']}: {said}")
        for name, (want, simulated) in figures.items():
            self.assertLessEqual(
                abs(simulated - want), max(TOLERANCE * want, ABSOLUTE_TOLERANCE_S), f"{name}: {figures}"
            )


class SpeedBenchSmoke(SimpleTestCase):
    """`manage.py bench whatif --quick` runs and writes its figures (their shape: the speed
    itself is a figure for docs/whatif.md, not a test's business)."""

    def test_quick_bench_writes_its_figures(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "whatif.json"
            out = StringIO()
            call_command("bench", "whatif", "--quick", "--json", str(path), stdout=out)
            doc = json.loads(path.read_text())
        self.assertIn("x real time", out.getvalue())
        self.assertEqual(doc["hours"], 1.0)
        self.assertGreater(doc["jobs"], 10_000)
        self.assertEqual(doc["stranded"], 0)
        self.assertGreater(doc["peak_waiting"], 1000)  # the burst queues up
        self.assertGreater(doc["simulated_s_per_wall_s"], 0)
        with self.assertRaisesMessage(CommandError, "--hours must be more than 0"):
            call_command("bench", "whatif", "--hours", "0", stdout=StringIO())
