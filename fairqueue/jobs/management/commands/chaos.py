"""`python manage.py chaos [--quick] [--json PATH]`: load through the REST API while workers
are SIGKILLed and Redis is flushed, then check that every accepted job ran exactly once,
within its limits, and that nothing was left behind. Logic in fairqueue.chaos."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from fairqueue.bench.cluster import parse_ports
from fairqueue.chaos import DEFAULT_REDIS_URL, RESTARTS, ChaosConfig, report_lines, run


def _restarts(value: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = sorted(set(names) - set(RESTARTS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}: choose from {', '.join(RESTARTS)}")
    return names


class Command(BaseCommand):
    help = (
        "Chaos run: real workers and daphne on a fresh SQLite file and a dedicated Redis database; "
        "random SIGKILLs and one Redis flush (or, with --cluster, a failover and a primary's data loss) "
        "under load; exits non-zero unless every check passes."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--quick", action="store_true", help="short variant for the test suite (~40 s)")
        parser.add_argument("--json", dest="json_path", help="also write the counts to this JSON file")
        parser.add_argument(
            "--redis-url", default=DEFAULT_REDIS_URL, help="an EMPTY Redis database, flushed at start and end"
        )
        parser.add_argument("--force", action="store_true", help="flush the Redis database even if it holds data")
        parser.add_argument("--seed", type=int, help="random seed (printed, so a run can be replayed)")
        parser.add_argument("--seconds", dest="load_seconds", type=float, help="seconds of load")
        parser.add_argument("--kills", type=int, help="number of worker SIGKILLs")
        parser.add_argument("--workers", type=int, help="worker processes alive at any time")
        parser.add_argument("--slots", type=int, help="slots (threads) per worker")
        parser.add_argument("--rate", dest="requests_per_second", type=float, help="HTTP requests per second")
        parser.add_argument(
            "--quiet-timeout", type=float, help="how long to wait for every job to finish after the load (s)"
        )
        parser.add_argument("--min-seconds", type=float, help="shortest job (default 0.05)")
        parser.add_argument("--max-seconds", type=float, help="longest job (default 0.5)")
        parser.add_argument(
            "--cluster",
            action="store_true",
            help="the engine on a Redis Cluster the run starts (3 primaries + 3 replicas): a failover and a "
            "primary's data loss instead of the Redis flush",
        )
        parser.add_argument(
            "--cluster-ports", type=parse_ports, help="the cluster nodes' ports, e.g. 7111-7116 (default: free ones)"
        )
        parser.add_argument(
            "--restart",
            dest="restarts",
            type=_restarts,
            help=f"dependencies to restart under load, comma-separated ({', '.join(RESTARTS)}), each on a server "
            "of the run's own (the database on a private PostgreSQL)",
        )
        parser.add_argument(
            "--replication-cut-ms",
            type=float,
            help="how long before the primary's SIGKILL its replica stops receiving writes (default 500; 0: none)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        config = ChaosConfig.make(
            quick=options["quick"],
            redis_url=options["redis_url"],
            force=options["force"],
            seed=options["seed"],
            load_seconds=options["load_seconds"],
            kills=options["kills"],
            workers=options["workers"],
            slots=options["slots"],
            requests_per_second=options["requests_per_second"],
            quiet_timeout=options["quiet_timeout"],
            min_seconds=options["min_seconds"],
            max_seconds=options["max_seconds"],
            cluster=options["cluster"] or None,
            cluster_ports=options["cluster_ports"],
            replication_cut_ms=options["replication_cut_ms"],
            restarts=options["restarts"],
        )
        try:
            report = run(config, log=self.stdout.write)
        except RuntimeError as exc:
            raise CommandError(str(exc)) from exc
        for line in report_lines(report):
            self.stdout.write(line)
        if options["json_path"]:
            path = Path(options["json_path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2) + "\n")
            self.stdout.write(f"wrote {path}")
        if not report["ok"]:
            raise CommandError("chaos checks failed (see the counts above)")
