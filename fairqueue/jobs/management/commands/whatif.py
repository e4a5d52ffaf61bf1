"""``python manage.py whatif --shard S --hours H --set acme.floor=8 ...``: replay the last
hours of a shard under the current policy and under the changed one, and compare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from fairqueue.jobs.whatif import whatif_compare
from tenants.models import Shard
from tenants.whatif import (
    DEFAULT_HOURS,
    POOL_FIELDS,
    SHARD_FIELDS,
    TENANT_FIELDS,
    WhatIfComparison,
    WhatIfError,
    WhatIfRequest,
    changes_apply,
    hours_parse,
    policy_changes,
    policy_from_database,
)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def comparison_lines(c: WhatIfComparison) -> list[str]:
    """The comparison as the command prints it."""
    lines = [
        f"What-if on shard {c.shard}: {c.jobs:,} jobs submitted in the {c.hours:g} h to "
        f"{c.end:%Y-%m-%d %H:%M:%S %Z}, on {c.slots} slots ({c.slots_source}).",
        "Changes: " + ("; ".join(c.changes) if c.changes else "none (both runs use the current policy)"),
        "",
        f"{'tenant':<24} {'jobs':>7} {'P50 now':>10} {'P50 new':>10} {'P99 now':>10} {'P99 new':>10}",
    ]
    for slug in c.tenants():
        now, new = c.current.waits.get(slug), c.proposed.waits.get(slug)
        either = now or new
        jobs = either.jobs if either is not None else 0
        lines.append(
            f"{slug:<24} {jobs:>7,} {_seconds(now.p50 if now else None):>10} {_seconds(new.p50 if new else None):>10} "
            f"{_seconds(now.p99 if now else None):>10} {_seconds(new.p99 if new else None):>10}"
        )
    lines += [
        "",
        f"pool utilisation: {_share(c.current.utilisation)} now, {_share(c.proposed.utilisation)} with the change; "
        f"while jobs waited: {_share(c.current.backlog_utilisation)} now, "
        f"{_share(c.proposed.backlog_utilisation)} with the change",
        f"most jobs waiting at once: {c.current.peak_waiting:,} now, {c.proposed.peak_waiting:,} with the change",
        "stack latencies measured on these jobs (medians): "
        + ", ".join(f"{k[:-6]} {_seconds(v)}" for k, v in c.latencies.items() if k.endswith("_p50_s") and v),
        f"simulated in {c.current.elapsed_s + c.proposed.elapsed_s:.2f} s",
    ]
    lines += [f"note: {n}" for n in c.notes]
    return lines


class Command(BaseCommand):
    help = "Compare a shard's recent waits under the current policy and a proposed change (a simulation)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--shard", required=True, help="the shard whose jobs are replayed")
        parser.add_argument("--hours", default=str(DEFAULT_HOURS), help="how many of the last hours to replay")
        parser.add_argument(
            "--set",
            dest="changes",
            action="append",
            default=[],
            metavar="X.FIELD=VALUE",
            help=f"a change: TENANT.FIELD ({', '.join(TENANT_FIELDS)}), pool.FIELD ({', '.join(POOL_FIELDS)}) "
            f"or shard.FIELD ({', '.join(SHARD_FIELDS)}); repeat for several",
        )
        parser.add_argument("--slots", type=int, default=None, help="worker slots (default: the fleet's live slots)")
        parser.add_argument("--seed", type=int, default=0, help="seed of the model's drawn latencies")
        parser.add_argument("--json", dest="json_path", help="also write the comparison to this JSON file")

    def handle(self, *args: Any, **options: Any) -> None:
        shard = Shard.objects.filter(name=options["shard"]).first()
        if shard is None:
            known = ", ".join(Shard.objects.values_list("name", flat=True)) or "none"
            raise CommandError(f"No shard {options['shard']!r} (shards: {known}).")
        if options["slots"] is not None and options["slots"] < 1:
            raise CommandError(f"--slots must be at least 1, not {options['slots']}.")
        try:
            hours = hours_parse(options["hours"])
            tenants, pool, shards = changes_apply(options["changes"], shard=shard)
            current = policy_from_database()
            proposed = policy_from_database(tenants=tenants, pool=pool, shards=shards)
            request = WhatIfRequest(
                shard=shard.name,
                hours=hours,
                current=current,
                proposed=proposed,
                slots=options["slots"],
                changes=policy_changes(current, proposed),
            )
            comparison = whatif_compare(request, seed=options["seed"])
        except WhatIfError as exc:
            raise CommandError(str(exc)) from exc
        for line in comparison_lines(comparison):
            self.stdout.write(line)
        if options["json_path"]:
            path = Path(options["json_path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(comparison.as_dict(), indent=2) + "\n")
            self.stdout.write(f"wrote {path}")
