"""``python manage.py explain_queries [--seed ROWS --waiting N]``: the plan and time of
every job-table query the tick, the cells audit and the API list run; fails if one scans
the job table or takes over 20 ms (fairqueue.jobs.query_plans)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from fairqueue.jobs.models import Job
from fairqueue.jobs.query_plans import MAX_MS, checks, seed
from tenants.models import Shard, Tenant


class Command(BaseCommand):
    help = "EXPLAIN the tick's, the cells audit's and the API list's job queries; fail on a scan or a slow one."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--seed", type=int, default=0, help="first add this many job rows (most finished)")
        parser.add_argument("--waiting", type=int, default=0, help="of the seeded rows, this many waiting")
        parser.add_argument("--max-ms", type=float, default=MAX_MS, help=f"slowest query allowed (default {MAX_MS:g})")
        parser.add_argument("--tenant", default="explain", help="the tenant the seeded rows and the API list use")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["seed"] < 0 or not 0 <= options["waiting"] <= options["seed"]:
            raise CommandError("--seed must be >= 0 and --waiting between 0 and --seed")
        shard, _ = Shard.objects.get_or_create(name="explain", defaults={"capacity": 10})
        tenant, _ = Tenant.objects.get_or_create(slug=options["tenant"], defaults={"name": "explain", "shard": shard})
        if options["seed"]:
            seed(rows=options["seed"], waiting=options["waiting"], tenant=tenant, log=self.stdout.write)
        self.stdout.write(f"{Job.objects.count()} job rows")
        failed = []
        for result in checks(tenant):
            ok = result.uses_index and result.ms <= options["max_ms"]
            verdict = "ok" if ok else "FAIL"
            self.stdout.write(
                f"\n== {result.name}: {result.ms} ms, index {'yes' if result.uses_index else 'NO'} [{verdict}]"
            )
            self.stdout.write(result.plan)
            if not ok:
                failed.append(result.name)
        if failed:
            raise CommandError(
                f"{len(failed)} query(ies) scan the job table or take over {options['max_ms']:g} ms: "
                + ", ".join(failed)
            )
        self.stdout.write(f"\nall queries use an index and take at most {options['max_ms']:g} ms")
