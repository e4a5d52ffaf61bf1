"""Retention (fairqueue.jobs.retention and `manage.py prune_jobs`): real rows, real payload files."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from datetime import datetime, timedelta
from io import StringIO
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import transaction
from django.test import Client, override_settings
from django.utils import timezone

from fairqueue.jobs import payloads
from fairqueue.jobs.models import TERMINAL_STATUSES, Job, JobStatus, LedgerEntry
from fairqueue.jobs.retention import (
    TICK_BATCH_SIZE,
    TICK_MAX_BATCHES,
    PruneResult,
    jobs_prune,
    jobs_prune_batch,
    jobs_prune_select,
    retention_due_prune,
)
from tests.base import RedisTestCase
from tests.factories import make_tenant

OLD = timedelta(days=31)
RECENT = timedelta(days=1)
RETENTION = timedelta(days=30)


class RetentionTestCase(RedisTestCase):
    """A tenant, and a payload store of its own in a temporary folder."""

    def setUp(self) -> None:
        super().setUp()
        self.dir = Path(tempfile.mkdtemp(prefix="fq-retention-"))
        self.addCleanup(shutil.rmtree, self.dir, True)
        storages = {
            **settings.STORAGES,
            "payloads": {**settings.STORAGES["payloads"], "OPTIONS": {"location": str(self.dir)}},
        }
        override = override_settings(STORAGES=storages, FAIRQUEUE={**settings.FAIRQUEUE, "PAYLOAD_DIR": str(self.dir)})
        override.enable()
        self.addCleanup(override.disable)
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant, _ = make_tenant("acme")
        self.now = timezone.now()

    def job(self, status: str, *, finished_ago: timedelta | None, files: bool = True, **fields: object) -> Job:
        """A job row in `status`, finished `finished_ago` before self.now, with an args and
        a result payload file and a demo ledger row."""
        if files:
            fields["args_ref"] = payloads.payload_put(data=payloads.payload_encode({"big": "x"}), kind="args")
            fields["result_ref"] = payloads.payload_put(data=payloads.payload_encode({"ok": 1}), kind="results")
        finished_at = None if finished_ago is None else self.now - finished_ago
        job = Job.objects.create(
            tenant=self.tenant,
            task="demo.sleep",
            latency_class="default",
            status=status,
            finished_at=finished_at,
            **fields,
        )
        # Submitted long before it finished: age on its own never makes a job prunable.
        Job.objects.filter(id=job.id).update(submitted_at=self.now - timedelta(days=400))
        LedgerEntry.objects.create(job_id=job.id, task=job.task)
        return job

    def files(self) -> set[str]:
        return {str(p.relative_to(self.dir)) for p in self.dir.rglob("*") if p.is_file()}

    def refs(self, *jobs: Job) -> set[str]:
        return {ref for job in jobs for ref in (job.args_ref, job.result_ref) if ref}

    def prune(self, *, batch_size: int = 1000, max_batches: int | None = None) -> PruneResult:
        """Prune past RETENTION as a committed transaction would: payload files go on commit."""
        with self.captureOnCommitCallbacks(execute=True):
            return jobs_prune(older_than=RETENTION, batch_size=batch_size, max_batches=max_batches, now=self.now)

    def assert_kept(self, *jobs: Job) -> None:
        for job in jobs:
            self.assertTrue(Job.objects.filter(id=job.id).exists(), f"{job.status} job {job.id} was deleted")
            self.assertTrue(LedgerEntry.objects.filter(job_id=job.id).exists())
        self.assertLessEqual(self.refs(*jobs), self.files(), "a kept job lost a payload file")

    def assert_gone(self, *jobs: Job) -> None:
        for job in jobs:
            self.assertFalse(Job.objects.filter(id=job.id).exists(), f"{job.status} job {job.id} was kept")
            self.assertFalse(LedgerEntry.objects.filter(job_id=job.id).exists())
        self.assertFalse(self.refs(*jobs) & self.files(), "a pruned job left a payload file behind")


class PruneTests(RetentionTestCase):
    def test_old_finished_jobs_go_with_their_files_and_everything_else_stays(self) -> None:
        old = [self.job(status, finished_ago=OLD) for status in sorted(TERMINAL_STATUSES)]
        recent = [self.job(status, finished_ago=RECENT) for status in sorted(TERMINAL_STATUSES)]
        # Status alone decides: an unfinished job stays however old it is, even with the
        # finished_at of an earlier run.
        unfinished = [
            self.job(status, finished_ago=finished_ago)
            for status in (JobStatus.QUEUED, JobStatus.PARKED, JobStatus.RUNNING)
            for finished_ago in (None, timedelta(days=365))
        ]
        # Its slots are not freed in the engine yet: the reconciler needs the row.
        release_pending = self.job(JobStatus.FAILED, finished_ago=OLD, release_pending=True)

        result = self.prune()

        self.assertEqual(result, PruneResult(jobs=3, payload_files=6))
        self.assert_gone(*old)
        self.assert_kept(*recent, *unfinished, release_pending)
        self.assertEqual(self.prune(), PruneResult(), "a second run finds nothing")

    def test_batches_run_oldest_first_up_to_max_batches(self) -> None:
        jobs = [self.job(JobStatus.SUCCEEDED, finished_ago=OLD + timedelta(hours=age)) for age in range(5, 0, -1)]

        self.assertEqual(self.prune(batch_size=2, max_batches=2).jobs, 4)
        self.assert_gone(*jobs[:4])
        self.assert_kept(jobs[4])
        self.assertEqual(self.prune(batch_size=2).jobs, 1)
        self.assert_gone(jobs[4])

    def test_a_job_without_payload_files_or_with_a_missing_one(self) -> None:
        inline = self.job(JobStatus.SUCCEEDED, finished_ago=OLD, files=False)
        lost_file = self.job(JobStatus.FAILED, finished_ago=OLD)
        (self.dir / lost_file.args_ref).unlink()

        self.assertEqual(self.prune(), PruneResult(jobs=2, payload_files=2))
        self.assert_gone(inline, lost_file)
        self.assertEqual(self.files(), set())

    def test_a_rolled_back_batch_keeps_its_payload_files(self) -> None:
        job = self.job(JobStatus.SUCCEEDED, finished_ago=OLD)
        with self.captureOnCommitCallbacks(execute=True), self.assertRaises(RuntimeError), transaction.atomic():
            jobs_prune(older_than=RETENTION, now=self.now)
            raise RuntimeError("the caller's transaction fails")
        self.assert_kept(job)

    def test_negative_age_or_empty_batches_are_refused(self) -> None:
        with self.assertRaises(ValueError):
            jobs_prune(older_than=timedelta(days=-1))
        with self.assertRaises(ValueError):
            jobs_prune(older_than=RETENTION, batch_size=0)


class ConcurrentRetryTests(RetentionTestCase):
    """The admin retries a failed job after a batch selected it but before the batch ran."""

    def admin_retry(self, job: Job) -> None:
        staff = User.objects.create_superuser("ops", "ops@example.com", "pw")
        admin = Client()
        admin.force_login(staff)
        with self.captureOnCommitCallbacks(execute=True):
            resp = admin.post("/admin/jobs/job/", {"action": "retry_jobs", "_selected_action": [str(job.id)]})
        self.assertEqual(resp.status_code, 302)
        self.assertEqual(Job.objects.get(id=job.id).status, JobStatus.QUEUED)

    def run_batch(self, ids: list[uuid.UUID], cutoff: datetime) -> PruneResult:
        with self.captureOnCommitCallbacks(execute=True):
            return jobs_prune_batch(ids=ids, cutoff=cutoff)

    def test_a_job_retried_after_the_select_is_kept_with_its_payload_files(self) -> None:
        retried = self.job(JobStatus.FAILED, finished_ago=OLD + timedelta(hours=1))
        other = self.job(JobStatus.FAILED, finished_ago=OLD)
        cutoff = self.now - RETENTION
        ids = jobs_prune_select(cutoff=cutoff, limit=10)
        self.assertEqual(ids, [retried.id, other.id])

        self.admin_retry(retried)
        result = self.run_batch(ids, cutoff)

        self.assertEqual(result, PruneResult(jobs=1, payload_files=2))
        self.assert_gone(other)
        self.assert_kept(retried)  # its next run reads its arguments from the payload store

    def test_a_job_that_ran_again_and_finished_since_the_select_is_kept(self) -> None:
        job = self.job(JobStatus.FAILED, finished_ago=OLD)
        cutoff = self.now - RETENTION
        ids = jobs_prune_select(cutoff=cutoff, limit=10)

        self.admin_retry(job)
        Job.objects.filter(id=job.id).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())

        self.assertEqual(self.run_batch(ids, cutoff), PruneResult())
        self.assert_kept(job)


class RetentionTickTests(RetentionTestCase):
    def retention(self, days: float) -> override_settings:
        return override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "RETENTION_DAYS": days})

    def test_zero_days_disables_it(self) -> None:
        job = self.job(JobStatus.SUCCEEDED, finished_ago=timedelta(days=3650))
        with self.retention(0), self.captureOnCommitCallbacks(execute=True):
            self.assertIsNone(retention_due_prune())
        self.assert_kept(job)

    def test_prunes_past_the_setting_a_bounded_share_per_call(self) -> None:
        bound = TICK_BATCH_SIZE * TICK_MAX_BATCHES
        finished_at = self.now - timedelta(days=8)
        Job.objects.bulk_create(
            Job(tenant=self.tenant, task="demo.sleep", latency_class="default", status=JobStatus.SUCCEEDED)
            for _ in range(bound + 1)
        )
        Job.objects.update(finished_at=finished_at)
        recent = self.job(JobStatus.SUCCEEDED, finished_ago=timedelta(days=6))

        with self.retention(7), self.captureOnCommitCallbacks(execute=True):
            self.assertEqual(retention_due_prune(now=self.now), PruneResult(jobs=bound))
        self.assertEqual(Job.objects.count(), 2)
        with self.retention(7), self.captureOnCommitCallbacks(execute=True):
            self.assertEqual(retention_due_prune(now=self.now), PruneResult(jobs=1))
        self.assert_kept(recent)
        with self.retention(7), self.captureOnCommitCallbacks(execute=True):
            self.assertEqual(
                retention_due_prune(now=self.now + timedelta(days=2)), PruneResult(jobs=1, payload_files=2)
            )
        self.assert_gone(recent)


class PruneJobsCommandTests(RetentionTestCase):
    def run_command(self, *args: str) -> str:
        out = StringIO()
        with self.captureOnCommitCallbacks(execute=True):
            call_command("prune_jobs", *args, stdout=out)
        return out.getvalue()

    def test_deletes_and_says_what_it_deleted(self) -> None:
        old = [self.job(JobStatus.SUCCEEDED, finished_ago=OLD) for _ in range(3)]
        recent = self.job(JobStatus.CANCELLED, finished_ago=RECENT)
        waiting = self.job(JobStatus.QUEUED, finished_ago=None)

        out = self.run_command("--older-than", "30", "--batch-size", "2")

        self.assertRegex(out, r"^deleted 3 job\(s\) finished before \S+ and 6 payload file\(s\)\n$")
        self.assert_gone(*old)
        self.assert_kept(recent, waiting)

    def test_fractional_days(self) -> None:
        job = self.job(JobStatus.FAILED, finished_ago=timedelta(hours=13))
        self.assertIn("deleted 0 job(s)", self.run_command("--older-than", "0.6"))
        self.assertIn("deleted 1 job(s)", self.run_command("--older-than", "0.5"))
        self.assert_gone(job)

    def test_dry_run_deletes_nothing(self) -> None:
        jobs = [self.job(JobStatus.FAILED, finished_ago=OLD), self.job(JobStatus.SUCCEEDED, finished_ago=OLD)]
        jobs.append(self.job(JobStatus.SUCCEEDED, finished_ago=OLD, files=False))

        out = self.run_command("--older-than", "30", "--dry-run")

        self.assertIn("would delete 3 job(s) finished before", out)
        self.assertIn("and 4 payload file(s) (dry run: nothing deleted)", out)
        self.assert_kept(*jobs)

    def test_bad_input_is_a_clear_error(self) -> None:
        job = self.job(JobStatus.SUCCEEDED, finished_ago=OLD)
        cases = [
            ((), "the following arguments are required: --older-than"),
            (("--older-than", "-1"), "DAYS must be a number of days, 0 or more (got '-1')"),
            (("--older-than", "soon"), "DAYS must be a number of days, 0 or more (got 'soon')"),
            (("--older-than", "nan"), "DAYS must be a number of days, 0 or more (got 'nan')"),
            (("--older-than", "30", "--batch-size", "0"), "N must be a whole number, 1 or more (got '0')"),
        ]
        for args, message in cases:
            with self.subTest(args=args), self.assertRaisesMessage(CommandError, message):
                self.run_command(*args)
        self.assert_kept(job)
