"""`manage.py bench noisy`: a tiny run on the real stack checks the result's shape (not its
figures), and the metric definitions are checked on hand-made records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis
from django.conf import settings
from django.test import SimpleTestCase

from fairqueue.bench.documents import MODES as DOC_MODES
from fairqueue.bench.documents import PRESETS as DOC_PRESETS
from fairqueue.bench.documents import doc_metrics, doc_plan, peak_overlap
from fairqueue.bench.noisy import (
    NOISY_SLUG,
    PRESETS,
    SHORT_JOB_MODES,
    backlog_utilisation,
    mode_metrics,
    targets_check,
    workload_plan,
)

ROOT = Path(__file__).resolve().parent.parent
METRIC_KEYS = {
    "quiet_p50_wait_s",
    "quiet_p99_wait_s",
    "noisy_p50_wait_s",
    "noisy_p99_wait_s",
    "noisy_makespan_s",
    "utilization",
    "jobs_per_s",
    "jobs",
    "mean_job_s",
}


def bench_redis_url() -> str:
    """A Redis database for the bench under test: never the test suite's own."""
    url = os.environ.get("FAIRQUEUE_BENCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
    assert redis.Redis.from_url(url).connection_pool.connection_kwargs["db"] != redis.Redis.from_url(
        settings.REDIS_URL
    ).connection_pool.connection_kwargs.get("db", 0), "the bench must not share the test Redis database"
    return url


def bench_noisy_run(
    case: SimpleTestCase, args: list[str], *, unset: tuple[str, ...] = ()
) -> tuple[dict[str, Any], str]:
    """Run `manage.py bench noisy ARGS --json F` on its own stack (the test settings' Redis
    and database URLs, and `unset`, left out of its environment); its document and stdout.
    A failed run fails `case` with the run's output."""
    hidden = ("REDIS_URL", "DATABASE_URL", *unset)
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "noisy.json"
        done = subprocess.run(
            [sys.executable, "manage.py", "bench", "noisy", *args, "--json", str(out)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        case.assertEqual(done.returncode, 0, done.stdout[-2000:] + done.stderr[-3000:])
        return json.loads(out.read_text()), done.stdout


def record(tenant: str, submitted: float, started: float, seconds: float) -> dict[str, object]:
    return {
        "tenant": tenant,
        "seconds": seconds,
        "submitted": submitted,
        "started": started,
        "finished": started + seconds,
        "run_started": started,
        "run_finished": started + seconds,
        "ok": True,
    }


class MetricTests(SimpleTestCase):
    def test_plan_is_deterministic_and_bursts(self) -> None:
        w = PRESETS["smoke"]
        self.assertEqual(workload_plan(w), workload_plan(w))
        self.assertEqual(sum(1 for p in workload_plan(w) if p.tenant == NOISY_SLUG), w.burst_jobs)

    def test_utilisation_counts_only_backlog_time(self) -> None:
        # Two slots; one job waits 1 s (0.1 s grace) while one slot runs: half busy.
        records = [record("quiet-1", 0.0, 0.0, 2.0), record(NOISY_SLUG, 0.0, 1.0, 1.0)]
        util, backlog = backlog_utilisation(records, slots=2)
        self.assertAlmostEqual(backlog, 0.9)
        self.assertAlmostEqual(util or 0.0, 0.5)

    def test_only_steady_work_done_while_a_noisy_job_waits_counts_as_displacing_it(self) -> None:
        # Two slots. A long noisy job holds one; the other runs a steady job while a second
        # noisy job waits for it (displacing), then that noisy job, then a steady job while
        # no noisy job waits (in the window, delaying nothing).
        records = [
            record(NOISY_SLUG, 0.0, 0.0, 3.0),
            record("quiet-1", 0.0, 0.0, 1.0),
            record(NOISY_SLUG, 0.0, 1.0, 1.0),
            record("quiet-2", 2.0, 2.0, 0.5),
        ]
        m = mode_metrics(records, slots=2)
        self.assertAlmostEqual(m["noisy_makespan_s"], 3.0)
        self.assertAlmostEqual(m["quiet_work_in_noisy_window_s"], 0.75)
        self.assertAlmostEqual(m["quiet_work_displacing_noisy_s"], 0.5)
        self.assertAlmostEqual(m["noisy_makespan_excl_displacing_quiet_s"], 2.5)

    def test_targets_need_every_mode(self) -> None:
        m = mode_metrics([record("quiet-1", 0.0, 0.0, 0.1), record(NOISY_SLUG, 0.0, 0.2, 0.1)], slots=1)
        self.assertTrue(set(m) >= METRIC_KEYS)
        self.assertIsNone(targets_check({"fair": m})["noisy_makespan"]["met"])
        self.assertIsNotNone(targets_check({"fair": m, "fifo": m})["noisy_makespan"]["met"])


class BenchNoisySmokeTests(SimpleTestCase):
    def test_smoke_run_writes_the_documented_shape(self) -> None:
        url = bench_redis_url()
        with tempfile.TemporaryDirectory() as tmp:
            png = Path(tmp) / "noisy.png"
            doc, stdout = bench_noisy_run(self, ["--smoke", "--redis-url", url, "--plot", str(png)])
            self.assertTrue(png.stat().st_size > 0)
        self.assertEqual(set(doc["modes"]), set(SHORT_JOB_MODES))
        for mode, figures in doc["modes"].items():
            self.assertTrue(set(figures) >= METRIC_KEYS, mode)
            self.assertGreater(figures["jobs"], 0, mode)
            self.assertEqual(figures["failed"], 0, mode)
        self.assertIsNone(doc["modes"]["fair_no_burst"]["noisy_makespan_s"])
        self.assertEqual(
            set(doc["targets"]),
            {
                "quiet_p99_vs_fifo",
                "quiet_p99_vs_no_burst",
                "quiet_p99_vs_fifo_shared_shard",
                "quiet_p99_vs_no_burst_shared_shard",
                "utilization",
                "noisy_makespan",
                "noisy_makespan_excl_quiet_work",  # informational: not part of all_targets_met
                "noisy_makespan_excl_displacing_quiet_work",  # the same
            },
        )
        for target in doc["targets"].values():
            self.assertIn(target["met"], (True, False))
        self.assertIn("workload", doc)
        self.assertIn("PASS" if doc["all_targets_met"] else "MISS", stdout)
        self.assertEqual(redis.Redis.from_url(url).dbsize(), 0, "the bench must leave its Redis database empty")

    def test_smoke_run_over_http_sends_every_job_through_the_rest_api(self) -> None:
        url = bench_redis_url()
        doc, _ = bench_noisy_run(self, ["--smoke", "--submit", "http", "--modes", "fair", "--redis-url", url])
        self.assertEqual(doc["submit"], "http")
        fair = doc["modes"]["fair"]
        # Every planned job was accepted by the API (a refused request fails the run) and ran once.
        self.assertEqual(fair["jobs"], doc["workload"]["jobs_planned"])
        self.assertEqual(fair["failed"], 0)
        self.assertIn("client's clock", doc["definitions"]["wait"])
        self.assertEqual(redis.Redis.from_url(url).dbsize(), 0, "the bench must leave its Redis database empty")


class BenchDocumentsTests(SimpleTestCase):
    def test_the_document_figures_on_hand_made_runs(self) -> None:
        # Two slots. A large document of three pages, two at once; a one-page document that
        # waited 0.5 s for a slot.
        docs = [
            {"tenant": NOISY_SLUG, "submitted": 0.0, "finished": 2.0, "ok": True},
            {"tenant": "quiet-1", "submitted": 0.5, "finished": 2.0, "ok": True},
        ]
        runs = [
            {"doc": "big", "submitted": 0.0, "started": 0.0, "run_started": 0.0, "run_finished": 1.0},
            {"doc": "big", "submitted": 0.0, "started": 0.0, "run_started": 0.0, "run_finished": 1.0},
            {"doc": "big", "submitted": 0.0, "started": 1.0, "run_started": 1.0, "run_finished": 2.0},
            {"doc": "small", "submitted": 0.5, "started": 1.0, "run_started": 1.0, "run_finished": 2.0},
        ]
        m = doc_metrics(docs, runs, slots=2)
        self.assertEqual(m["peak_document_concurrency"], 2)
        self.assertAlmostEqual(m["small_p99_s"], 1.5)
        self.assertAlmostEqual(m["large_makespan_s"], 2.0)
        self.assertAlmostEqual(m["utilization"], 1.0)  # both slots busy while the backlog lasted
        self.assertEqual(peak_overlap([(0.0, 1.0), (1.0, 2.0)]), 1)  # end and start at once: not together
        self.assertEqual(doc_plan(DOC_PRESETS["smoke"]), doc_plan(DOC_PRESETS["smoke"]))

    def test_smoke_run_reports_every_mode_and_the_target(self) -> None:
        url = bench_redis_url()
        doc, stdout = bench_noisy_run(self, ["--documents", "--smoke", "--redis-url", url])
        self.assertEqual(set(doc["modes"]), set(DOC_MODES))
        w = doc["workload"]
        for mode, figures in doc["modes"].items():
            with self.subTest(mode=mode):
                self.assertEqual(figures["documents"], len(doc_plan(DOC_PRESETS["smoke"])))
                self.assertEqual(figures["failed"], 0)
                self.assertIsNotNone(figures["small_p99_s"])
                # Measured inside backlog periods only: a smoke run's mode may have none.
                if figures["utilization"] is not None:
                    self.assertTrue(0.0 <= figures["utilization"] <= 1.0, figures["utilization"])
        self.assertEqual(doc["modes"]["long"]["peak_document_concurrency"], 1)
        # The document key's cap: never more pages of one document at once than the fan-out.
        self.assertLessEqual(doc["modes"]["fanout"]["peak_document_concurrency"], w["fan_out"])
        self.assertEqual(doc["modes"]["fanout"]["runs"], sum(d.pages for d in doc_plan(DOC_PRESETS["smoke"])))
        self.assertIn(doc["targets"]["small_p99_vs_fifo"]["met"], (True, False))
        self.assertIn("small_p99_vs_fifo", stdout)
        self.assertEqual(redis.Redis.from_url(url).dbsize(), 0, "the bench must leave its Redis database empty")
