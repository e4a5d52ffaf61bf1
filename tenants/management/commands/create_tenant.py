"""Create or update a tenant from a script and print its new API key alone on the last line."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from tenants.models import Shard, Tenant

NO_MAX = "none"


def _max_value(value: str) -> int | str:
    if value.strip().lower() in (NO_MAX, ""):
        return NO_MAX  # distinct from "option not given" (None): clears the hard max
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'none', got {value!r}") from None


class Command(BaseCommand):
    help = (
        "Create a tenant (or update an existing one), rotate its API key and print the new key "
        "alone on the last line of stdout. Options not given keep their current (or default) values."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug")
        parser.add_argument("--name", help="Display name (default: the slug).")
        parser.add_argument("--floor", type=int, help="Guaranteed concurrency.")
        parser.add_argument("--max", dest="max_concurrency", type=_max_value, help="Hard max, or 'none'.")
        parser.add_argument("--burst-floor", type=int)
        parser.add_argument("--burst-pct", type=float, help="Burst as a fraction of base (0-10).")
        parser.add_argument("--dedicated", type=int, help="Paid-for capacity added on top.")
        parser.add_argument(
            "--batch", action=argparse.BooleanOptionalAction, default=None, help="Opt in to (or out of) batch."
        )
        parser.add_argument("--shard", help="Shard name; created if missing (default: 'default').")
        parser.add_argument("--sub-tenant-share", type=float, help="Cap of unregistered sub-tenants (0.01-1).")
        parser.add_argument("--fan-out", dest="max_fan_out", type=int, help="Max fan-out per job (children at once).")

    def handle(self, *args: Any, **options: Any) -> None:
        slug: str = options["slug"]
        try:
            with transaction.atomic():
                tenant, raw_key, created, shard_created = self._apply(slug, options)
        except ValidationError as exc:
            raise CommandError(_describe(exc)) from None
        verb = "Created" if created else "Updated"
        if shard_created:
            self.stdout.write(f"Created shard {tenant.shard.name} (capacity {tenant.shard.capacity}).")
        self.stdout.write(
            f"{verb} tenant {tenant.slug} on shard {tenant.shard.name}: floor {tenant.floor}, "
            f"max {tenant.max_concurrency if tenant.max_concurrency is not None else 'none'}, "
            f"burst floor {tenant.burst_floor}, burst {tenant.burst_pct}, dedicated {tenant.dedicated}, "
            f"fan-out {tenant.max_fan_out}, batch {'on' if tenant.batch_enabled else 'off'}. New API key (shown once):"
        )
        self.stdout.write(raw_key)

    def _apply(self, slug: str, options: dict[str, Any]) -> tuple[Tenant, str, bool, bool]:
        tenant = Tenant.objects.select_related("shard").filter(slug=slug).first()
        created = tenant is None
        shard_created = False
        shard_name = options["shard"] or (None if tenant else "default")
        if tenant is None:
            tenant = Tenant(slug=slug, name=slug)
        if shard_name is not None:
            shard = Shard.objects.filter(name=shard_name).first()
            if shard is None:
                shard = Shard(name=shard_name)
                shard.full_clean()
                shard.save()
                shard_created = True
            tenant.shard = shard
        fields = {
            "name": options["name"],
            "floor": options["floor"],
            "burst_floor": options["burst_floor"],
            "burst_pct": options["burst_pct"],
            "dedicated": options["dedicated"],
            "batch_enabled": options["batch"],
            "sub_tenant_share": options["sub_tenant_share"],
            "max_fan_out": options["max_fan_out"],
        }
        for field, value in fields.items():
            if value is not None:
                setattr(tenant, field, value)
        max_value = options["max_concurrency"]
        if max_value is not None:
            tenant.max_concurrency = None if max_value == NO_MAX else int(max_value)
        raw_key = tenant.rotate_api_key()
        tenant.full_clean()
        tenant.save()
        return tenant, raw_key, created, shard_created


def _describe(exc: ValidationError) -> str:
    if hasattr(exc, "error_dict"):
        parts = [f"{field}: {' '.join(msgs)}" for field, msgs in exc.message_dict.items()]
        return "Invalid tenant: " + "; ".join(parts)
    return "Invalid tenant: " + " ".join(exc.messages)
