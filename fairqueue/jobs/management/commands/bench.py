"""``python manage.py bench <name>``: benchmarks, one subcommand each (``engine``,
``engine-ab``, ``noisy``, ``submit``, ``throughput``, ``whatif``, ``backoff``, ``fleet``, ``job-list``,
``parked-memory``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from fairqueue.bench import (
    backoff_bench,
    documents,
    engine_bench,
    fleet_bench,
    joblist_bench,
    noisy,
    parked_memory,
    submit,
    throughput,
    whatif_bench,
)
from fairqueue.bench.engine_bench import AB_OPERATIONS


class Command(BaseCommand):
    help = "Run a FairQueue benchmark and print (and optionally write as JSON) its figures."

    def add_arguments(self, parser: CommandParser) -> None:
        subparsers = parser.add_subparsers(
            dest="bench",
            required=True,
            metavar="{engine,engine-ab,noisy,submit,throughput,whatif,backoff,fleet,job-list,parked-memory}",
        )
        engine = subparsers.add_parser("engine", help="cost of one engine decision against real Redis")
        engine.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
        engine.add_argument(
            "--redis-url", default="redis://127.0.0.1:6379/12", help="an EMPTY Redis database (flushed afterwards)"
        )
        engine.add_argument("--quick", action="store_true", help="tiny sizes (smoke test): shape, not figures")
        ab = subparsers.add_parser("engine-ab", help="A/B versions of lua/ on the same data, alternating batches")
        ab.add_argument("--lua", dest="lua_dirs", action="append", required=True, help="a lua/ directory (repeat)")
        ab.add_argument("--op", dest="operation", choices=AB_OPERATIONS, default="release")
        ab.add_argument("--calls", type=int, default=40_000, help="calls in all, shared out between versions")
        ab.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
        ab.add_argument("--redis-url", default="redis://127.0.0.1:6379/12", help="an EMPTY Redis database")
        noisy.add_arguments(subparsers.add_parser("noisy", help="noisy neighbour: fifo vs isolation vs fair"))
        submit.add_arguments(subparsers.add_parser("submit", help="jobs accepted/s: REST single, bulk, send_task"))
        throughput.add_arguments(
            subparsers.add_parser(
                "throughput", help="submit path and no-op jobs/s against plain Celery, on the real stack"
            )
        )
        fleet_bench.add_arguments(
            subparsers.add_parser("fleet", help="duties, snapshot, /metrics and admit cost by workers x tenants")
        )
        joblist_bench.add_arguments(
            subparsers.add_parser("job-list", help="GET /api/v1/jobs at a million jobs: pages, cursor, filters (P99)")
        )
        parked_memory.add_arguments(
            subparsers.add_parser("parked-memory", help="bytes per parked job in the engine's Redis, by structure")
        )
        whatif = subparsers.add_parser("whatif", help="the what-if model's speed on a synthetic day of a busy shard")
        whatif.add_argument("--quick", action="store_true", help="one hour instead of a day (smoke test)")
        whatif.add_argument("--hours", type=float, default=None, help="simulated hours (default 24; 1 with --quick)")
        whatif.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
        backoff_bench.add_arguments(
            subparsers.add_parser("backoff", help="AIMD on a resource key against a fake upstream that answers 429")
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["bench"] == "engine":
            try:
                result = engine_bench.run(options["redis_url"], quick=options["quick"], log=self.stdout.write)
            except RuntimeError as exc:
                raise CommandError(str(exc)) from exc
        elif options["bench"] == "engine-ab":
            try:
                result = engine_bench.run_ab(
                    options["redis_url"],
                    [Path(d) for d in options["lua_dirs"]],
                    options["operation"],
                    options["calls"],
                    log=self.stdout.write,
                )
            except RuntimeError as exc:
                raise CommandError(str(exc)) from exc
        elif options["bench"] == "whatif":
            if options["hours"] is not None and not 0 < options["hours"] <= 24 * 7:
                raise CommandError(f"--hours must be more than 0 and at most 168, not {options['hours']}")
            result = whatif_bench.run(quick=options["quick"], hours=options["hours"], log=self.stdout.write)
        elif options["bench"] in ("noisy", "submit", "throughput", "backoff", "fleet", "job-list", "parked-memory"):
            modules = {
                "noisy": noisy,
                "submit": submit,
                "throughput": throughput,
                "backoff": backoff_bench,
                "fleet": fleet_bench,
                "job-list": joblist_bench,
                "parked-memory": parked_memory,
            }
            module = modules[options["bench"]]
            if options["bench"] == "noisy" and options.get("documents"):
                module = documents  # the fan-out workload (--documents)
            try:
                result = module.run_command(options, log=self.stdout.write)
            except RuntimeError as exc:
                raise CommandError(str(exc)) from exc
        else:  # pragma: no cover - argparse rejects unknown names
            raise CommandError(f"unknown benchmark {options['bench']!r}")
        if options.get("json_path"):
            path = Path(options["json_path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=2) + "\n")
            self.stdout.write(f"wrote {path}")
