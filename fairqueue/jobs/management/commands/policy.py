"""``python manage.py policy export [--format yaml|json] [FILE]`` and
``python manage.py policy apply FILE [--dry-run] [--confirm-moves] [--prune]``: the whole
policy as a file to keep and review in version control, and that file applied back in one
transaction (tenants.policy_file). A dry run prints the diff, the tenants whose limit would
change at today's load (old -> new) and the what-if replay's effect on waits, and writes
nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from fairqueue.jobs.limits_preview import limits_compare
from fairqueue.jobs.management.commands.whatif import comparison_lines
from fairqueue.jobs.whatif import whatif_compare
from tenants.history import REASON_MAX_LENGTH
from tenants.policy_file import (
    PolicyFileError,
    PolicyPlan,
    policy_apply,
    policy_dump,
    policy_export,
    policy_load,
    policy_plan,
)
from tenants.whatif import DEFAULT_HOURS, WhatIfError, WhatIfRequest, hours_parse, policy_changes

FORMATS = ("yaml", "json")


def _format(options: dict[str, Any], path: str | None) -> str:
    if options.get("format"):
        return str(options["format"])
    return "json" if path and path.lower().endswith(".json") else "yaml"


class Command(BaseCommand):
    help = "Export the whole policy to a YAML or JSON file, or apply such a file (with --dry-run: preview it)."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="{export,apply}")
        export = actions.add_parser("export", help="write the whole policy (no secrets) to FILE or stdout")
        export.add_argument("file", nargs="?", help="where to write it (default: stdout)")
        export.add_argument("--format", choices=FORMATS, help="yaml or json (default: by FILE's extension, else yaml)")
        apply = actions.add_parser("apply", help="apply a policy file in one transaction")
        apply.add_argument("file")
        apply.add_argument("--format", choices=FORMATS, help="yaml or json (default: by FILE's extension, else yaml)")
        apply.add_argument(
            "--dry-run",
            action="store_true",
            help="print the diff, the limits that would change at today's load and the what-if; write nothing",
        )
        apply.add_argument(
            "--confirm-moves",
            action="store_true",
            help="go ahead although the file moves tenants with unfinished jobs (the dry run says what befalls them)",
        )
        apply.add_argument(
            "--prune",
            action="store_true",
            help="delete what a section of the file leaves out (default: keep it)",
        )
        apply.add_argument("--reason", default="", help="kept in the policy history with each change")
        apply.add_argument("--user", default="", help="the username the history records the change under")
        apply.add_argument(
            "--hours", default=str(DEFAULT_HOURS), help="the what-if replays this many of the last hours"
        )
        apply.add_argument("--no-whatif", action="store_true", help="leave the what-if replay out of the dry run")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "export":
            self.export(options)
        else:
            self.apply(options)

    def export(self, options: dict[str, Any]) -> None:
        path = options.get("file")
        text = policy_dump(policy_export(), fmt=_format(options, path))
        if not path:
            self.stdout.write(text, ending="")
            return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        self.stdout.write(f"Wrote the policy to {path}.")

    def apply(self, options: dict[str, Any]) -> None:
        path = options["file"]
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise CommandError(f"Cannot read {path}: {exc.strerror or exc}.") from None
        user = None
        if options["user"]:
            user = get_user_model().objects.filter(**{get_user_model().USERNAME_FIELD: options["user"]}).first()
            if user is None:
                raise CommandError(f"No user {options['user']!r}; nothing was written.")
        if len(options["reason"]) > REASON_MAX_LENGTH:
            raise CommandError(f"--reason is longer than {REASON_MAX_LENGTH} characters; nothing was written.")
        try:
            hours = hours_parse(options["hours"])
        except WhatIfError as exc:
            raise CommandError(f"--hours: {exc}") from None
        try:
            plan = policy_plan(
                policy_load(text, fmt=_format(options, path), name=path), name=path, prune=options["prune"]
            )
        except PolicyFileError as exc:
            raise CommandError(
                "The policy file has problems; nothing was written.\n" + "\n".join(exc.problems)
            ) from None
        self.describe(plan)
        if options["dry_run"]:
            if plan.changed:
                self.limits(plan)
                if not options["no_whatif"]:
                    self.whatif(plan, hours)
            self.stdout.write("Dry run: nothing was written.")
            return
        if not plan.changed:
            self.stdout.write("Nothing to apply: the database holds this policy already.")
            return
        reason = options["reason"] or f"policy apply {Path(path).name}"
        try:
            written = policy_apply(plan, reason=reason, user=user, confirm_moves=options["confirm_moves"])
        except PolicyFileError as exc:
            moves = "\n".join(exc.problems)
            raise CommandError(f"{moves}\nConfirm the moves with --confirm-moves; nothing was written.") from None
        self.stdout.write(
            f"Applied: {written} row(s) written in one transaction, recorded in the policy history "
            "(source: policy file); running processes pick the change up within a second."
        )

    def describe(self, plan: PolicyPlan) -> None:
        self.stdout.write(f"{plan.source} against the database:")
        for line in plan.lines() or ["no changes"]:
            self.stdout.write(f"  {line}")
        if plan.kept:
            self.stdout.write(f"Not in the file, kept (--prune deletes them): {', '.join(plan.kept)}")
        for move in plan.moves:
            self.stdout.write(f"Move: {move} (applying needs --confirm-moves)")

    def limits(self, plan: PolicyPlan) -> None:
        assert plan.current is not None and plan.proposed is not None
        self.stdout.write("")
        try:
            changes, slots = limits_compare(plan.current, plan.proposed)
        except redis.RedisError as exc:
            self.stdout.write(f"Limits at today's load: unknown (Redis: {exc}).")
            return
        self.stdout.write(
            f"Limits at today's load ({slots} live slots; the tick's formula with fair and idle shares, "
            "without shard caps), old -> new:"
        )
        if not changes:
            self.stdout.write("  no tenant's limit changes")
        for c in changes:
            before = "-" if c.before is None else str(c.before)
            after = "-" if c.after is None else str(c.after)
            self.stdout.write(f"  {c.tenant}: {before} -> {after} ({c.rate_per_min:g} jobs/min, {c.held} running)")

    def whatif(self, plan: PolicyPlan, hours: float) -> None:
        assert plan.current is not None and plan.proposed is not None
        changes = policy_changes(plan.current, plan.proposed)
        for shard in sorted(plan.affected_shards):
            self.stdout.write("")
            request = WhatIfRequest(
                shard=shard, hours=hours, current=plan.current, proposed=plan.proposed, changes=changes
            )
            try:
                comparison = whatif_compare(request)
            except WhatIfError as exc:
                self.stdout.write(f"What-if on shard {shard}: {exc}")
                continue
            except redis.RedisError as exc:  # the fleet's live slots are read there
                self.stdout.write(f"What-if on shard {shard}: unknown (Redis: {exc}).")
                continue
            for line in comparison_lines(comparison):
                self.stdout.write(line)
