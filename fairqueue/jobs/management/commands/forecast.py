"""`manage.py forecast`: replay a recorded week against utilisation-only scaling and
`fairqueue_slots_desired` (fairqueue.jobs.forecast_replay says how), print the figures,
and write them as JSON with `--json PATH`.

    python manage.py forecast --synthetic --json var/forecast.json
    python manage.py forecast --from-trace jobs.csv --warmup-minutes 15
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from fairqueue.conf import fq_settings
from fairqueue.jobs.forecast_replay import TraceError, replay, trace_read, trace_synthetic, trace_write

DEFAULT_TARGET = 0.85  # the pool's default target utilisation (tenants.models.PoolSettings)
SYNTHETIC_WEEKS = 5  # four weeks of history and the replayed one
QUICK_WEEKS = 2
QUICK_PEAK_SLOTS = 24.0
SYNTHETIC_PEAK_SLOTS = 48.0


class Command(BaseCommand):
    help = "Replay a recorded week: how much earlier the forecast scales up than utilisation alone, and at what cost."

    def add_arguments(self, parser: CommandParser) -> None:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--from-trace", type=Path, help="CSV of submitted_at,duration_s[,latency_class]")
        source.add_argument("--synthetic", action="store_true", help="a generated trace with a daily and weekly shape")
        parser.add_argument("--json", type=Path, help="write the figures here")
        parser.add_argument("--write-trace", type=Path, help="save the synthetic trace as CSV")
        parser.add_argument("--quick", action="store_true", help="synthetic: two smaller weeks (the test suite's run)")
        parser.add_argument("--weeks", type=int, default=SYNTHETIC_WEEKS, help="synthetic: weeks generated")
        parser.add_argument("--seed", type=int, default=1, help="synthetic: random seed")
        conf = fq_settings().FORECAST
        parser.add_argument(
            "--warmup-minutes", type=float, default=conf.WARMUP_SECONDS / 60, help="time until a new worker serves"
        )
        parser.add_argument("--target", type=float, default=DEFAULT_TARGET, help="target utilisation")
        parser.add_argument("--worker-slots", type=int, default=settings.CELERY_WORKER_CONCURRENCY)
        parser.add_argument("--min-slots", type=int, default=None, help="the fleet's minimum (default: one worker)")
        parser.add_argument("--spread", type=float, default=conf.SPREAD_SIGMAS, help="forecast headroom (sigmas)")
        parser.add_argument("--profile-weeks", type=int, default=conf.WEEKS, help="weeks the profile smooths over")
        parser.add_argument("--decay", type=float, default=conf.DECAY, help="weight of each older week")

    def handle(self, *args: Any, **opts: Any) -> None:
        if not 0 < opts["target"] <= 1:
            raise CommandError("--target must be in (0, 1]")
        if opts["warmup_minutes"] <= 0 or opts["worker_slots"] < 1 or opts["profile_weeks"] < 1:
            raise CommandError("--warmup-minutes, --worker-slots and --profile-weeks must be positive")
        if not 0 < opts["decay"] <= 1 or opts["spread"] < 0:
            raise CommandError("--decay must be in (0, 1] and --spread >= 0")
        if opts["synthetic"]:
            weeks = QUICK_WEEKS if opts["quick"] else opts["weeks"]
            peak = QUICK_PEAK_SLOTS if opts["quick"] else SYNTHETIC_PEAK_SLOTS
            if weeks < 2:
                raise CommandError("--weeks must be at least 2: the forecast learns from the weeks before the last")
            jobs = trace_synthetic(weeks=weeks, seed=opts["seed"], peak_slots=peak)
            if opts["write_trace"]:
                trace_write(opts["write_trace"], jobs)
        else:
            path: Path = opts["from_trace"]
            if not path.is_file():
                raise CommandError(f"no trace file at {path}")
            try:
                jobs = trace_read(path)
            except TraceError as exc:
                raise CommandError(str(exc)) from exc
        try:
            report = replay(
                jobs,
                warmup_seconds=opts["warmup_minutes"] * 60,
                target_utilisation=opts["target"],
                worker_slots=opts["worker_slots"],
                min_slots=opts["min_slots"] or opts["worker_slots"],
                weeks=opts["profile_weeks"],
                decay=opts["decay"],
                spread_sigmas=opts["spread"],
            )
        except TraceError as exc:
            raise CommandError(str(exc)) from exc
        report["trace"]["source"] = "synthetic" if opts["synthetic"] else str(opts["from_trace"])
        self._print(report)
        if opts["json"]:
            opts["json"].parent.mkdir(parents=True, exist_ok=True)
            opts["json"].write_text(json.dumps(report, indent=2) + "\n")
            self.stdout.write(f"wrote {opts['json']}")

    def _print(self, r: dict[str, Any]) -> None:
        t, s = r["trace"], r["settings"]
        self.stdout.write(
            f"replayed {t['replayed_from']} .. {t['replayed_to']} of {t['jobs']} jobs ({t['source']}); "
            f"warm-up {s['warmup_minutes']} min, target {s['target_utilisation']}, {s['worker_slots']} slots a worker"
        )
        self.stdout.write(
            f"demand {r['demand_slot_hours']} slot-hours, peak {r['peak_demand_slots']} busy slots; "
            f"{r['scale_up_steps']} steps up by utilisation"
        )
        self.stdout.write(
            f"forecast asked earlier by a median of {r['minutes_earlier_median']} min "
            f"(min {r['minutes_earlier_min']}, max {r['minutes_earlier_max']}; later on "
            f"{r['scale_up_steps_forecast_later']}, never on {r['scale_up_steps_forecast_never_reached']})"
        )
        rows = [("", "slot-hours", "over", "under", "unserved")]
        for name, prefix in (("slots desired", ""), ("utilisation alone", "utilisation_")):
            rows.append(
                (
                    name,
                    str(r[f"{prefix}slot_hours"]),
                    str(r[f"{prefix}overprovisioned_slot_hours"]),
                    str(r[f"{prefix}underprovisioned_slot_hours"]),
                    str(r[f"{prefix}unserved_slot_hours"]),
                )
            )
        for row in rows:
            self.stdout.write(f"{row[0]:<18}" + "".join(f"{c:>12}" for c in row[1:]))
