"""Rebuild every policy key in Redis from the database."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from tenants.redis_client import engine_url
from tenants.sync import policy_sync_all


class Command(BaseCommand):
    help = "Full resync of tenant, shard, latency-class and pool policy from the database into Redis."

    def handle(self, *args: Any, **options: Any) -> None:
        result = policy_sync_all()
        self.stdout.write(f"Synced policy into {engine_url()}:")
        self.stdout.write(f"  tenants:         {result.tenants} (with {result.sub_tenants} sub-tenants)")
        self.stdout.write(f"  shards:          {result.shards}")
        self.stdout.write(f"  latency classes: {result.classes}")
        self.stdout.write(f"  resources:       {result.resources}")
        self.stdout.write("  pool settings:   1")
        self.stdout.write(f"  stale keys removed first: {result.deleted_keys}")
        self.stdout.write(self.style.SUCCESS(f"Policy version {result.version}"))
