"""`manage.py prune_jobs --older-than DAYS [--batch-size N] [--dry-run]`: delete finished
jobs, their payload files and demo ledger rows, in batches; safe while the system runs.
Logic in fairqueue.jobs.retention."""

from __future__ import annotations

import argparse
import math
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.utils import timezone

from fairqueue.jobs.retention import DEFAULT_BATCH_SIZE, jobs_prune, jobs_prune_preview


def _days(value: str) -> float:
    try:
        days = float(value)
    except ValueError:
        days = math.nan
    if not math.isfinite(days) or days < 0:
        raise argparse.ArgumentTypeError(f"DAYS must be a number of days, 0 or more (got {value!r})")
    return days


def _batch_size(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"N must be a whole number, 1 or more (got {value!r})")
    return size


class Command(BaseCommand):
    help = (
        "Delete jobs that finished (succeeded, failed or cancelled) more than DAYS days ago, with their "
        "payload files; unfinished jobs are never touched."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than", dest="days", type=_days, required=True, metavar="DAYS", help="age in days (may be 0.5)"
        )
        parser.add_argument(
            "--batch-size", type=_batch_size, default=DEFAULT_BATCH_SIZE, metavar="N", help="jobs per transaction"
        )
        parser.add_argument("--dry-run", action="store_true", help="count what would be deleted, delete nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        older_than = timedelta(days=options["days"])
        now = timezone.now()
        cutoff = f"finished before {(now - older_than).isoformat(timespec='seconds')}"
        if options["dry_run"]:
            preview = jobs_prune_preview(older_than=older_than, now=now)
            self.stdout.write(
                f"would delete {preview.jobs} job(s) {cutoff} and {preview.payload_files} payload file(s) "
                "(dry run: nothing deleted)"
            )
            return
        result = jobs_prune(older_than=older_than, batch_size=options["batch_size"], now=now)
        self.stdout.write(f"deleted {result.jobs} job(s) {cutoff} and {result.payload_files} payload file(s)")
