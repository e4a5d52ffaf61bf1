"""Seed the demo: shards, tenants of every kind, a staff login. Safe to run again."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from tenants.models import PoolSettings, Shard, SubTenant, Tenant
from tenants.sync import policy_sync_all

DEMO_USERNAME = "admin"
DEMO_PASSWORD = "fairqueue-demo"
SHARDS = {"eu-1": 24, "us-1": 24}
# slug -> (shard, tenant fields); sub-tenants listed separately.
TENANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "acme": ("eu-1", {"name": "Acme Corp (steady)", "floor": 4}),
    "globex": ("us-1", {"name": "Globex (steady, documents)", "floor": 4, "max_fan_out": 8}),
    "initech": ("eu-1", {"name": "Initech (noisy, bursty)", "floor": 2, "burst_pct": 1.0}),
    "umbrella": ("us-1", {"name": "Umbrella Health (sub-tenants)", "floor": 4}),
    "hooli": ("eu-1", {"name": "Hooli (batch opt-in)", "floor": 2, "batch_enabled": True}),
}
DEFAULT_RATE_WINDOW, DEMO_RATE_WINDOW = 300, 60
SUB_TENANTS = {"umbrella": {"hospital-a": 2, "hospital-b": 3}}


class Command(BaseCommand):
    help = "Create the demo shards, tenants and staff login (idempotent; existing rows are left as they are)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--keys-file",
            default=str(Path(settings.BASE_DIR) / "var" / "demo-keys.json"),
            help="Where raw API keys created by this run are written (slug -> key; existing entries kept).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        keys_file = Path(options["keys_file"])
        with transaction.atomic():
            created, new_keys = self._seed()
            self._ensure_admin()
        if new_keys:
            self._write_keys(keys_file, new_keys)
        result = policy_sync_all()

        for line in created:
            self.stdout.write(line)
        if not created:
            self.stdout.write("Demo data already present; nothing created.")
        self.stdout.write(f"Policy synced into Redis: {result.tenants} tenants, version {result.version}.")
        for slug, raw_key in new_keys.items():
            self.stdout.write(f"  API key for {slug}: {raw_key}")
        self.stdout.write(f"Demo API keys (slug -> key): {keys_file}")
        self.stdout.write(f"Admin login: {DEMO_USERNAME} / {DEMO_PASSWORD}")

    def _seed(self) -> tuple[list[str], dict[str, str]]:
        created: list[str] = []
        shards: dict[str, Shard] = {}
        for name, capacity in SHARDS.items():
            shards[name], was_created = Shard.objects.get_or_create(name=name, defaults={"capacity": capacity})
            if was_created:
                created.append(f"Created shard {name} (capacity {capacity}).")
        pool = PoolSettings.load()
        if pool.rate_window_seconds == DEFAULT_RATE_WINDOW:
            # A demo lasts minutes: a one-minute window lets the rate column show within one.
            pool.rate_window_seconds = DEMO_RATE_WINDOW
            pool.save()
            created.append(f"Set the pool's rate window to {DEMO_RATE_WINDOW} s for the demo.")
        new_keys: dict[str, str] = {}
        for slug, (shard_name, fields) in TENANTS.items():
            tenant = Tenant.objects.filter(slug=slug).first()
            is_new = tenant is None
            if tenant is None:
                tenant = Tenant(slug=slug, shard=shards[shard_name], **fields)
                tenant.full_clean()
                created.append(f"Created tenant {slug} on {shard_name}.")
            if not tenant.api_key_hash:
                new_keys[slug] = tenant.rotate_api_key()
            if is_new or slug in new_keys:
                tenant.save()
            for external_id, cap in SUB_TENANTS.get(slug, {}).items():
                _, was_created = SubTenant.objects.get_or_create(
                    tenant=tenant, external_id=external_id, defaults={"max_concurrency": cap}
                )
                if was_created:
                    created.append(f"Created sub-tenant {slug}/{external_id} (cap {cap}).")
        return created, new_keys

    def _ensure_admin(self) -> None:
        user_model = get_user_model()
        user = user_model.objects.filter(username=DEMO_USERNAME).first()
        if user is None:
            user = user_model(username=DEMO_USERNAME, email="admin@example.com")
        user.is_staff = True
        user.is_superuser = True
        user.is_active = True
        user.set_password(DEMO_PASSWORD)
        user.save()

    def _write_keys(self, path: Path, new_keys: dict[str, str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        existing: dict[str, str] = {}
        if path.exists():
            try:
                existing = json.loads(path.read_text())
            except ValueError:
                self.stderr.write(f"Ignoring unreadable {path}; rewriting it.")
        existing.update(new_keys)
        # Raw keys: readable by the owner only.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(existing, handle, indent=2, sort_keys=True)
            handle.write("\n")
