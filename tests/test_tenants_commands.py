"""create_tenant, sync_policies and seed_demo."""

from __future__ import annotations

import json
import tempfile
from io import StringIO
from pathlib import Path

import redis
from django.conf import settings
from django.contrib.auth import authenticate
from django.core.management import CommandError, call_command

from tenants import keys
from tenants.models import Shard, SubTenant, Tenant
from tenants.selectors import tenant_authenticate
from tests.base import RedisTestCase


class CommandTestCase(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.redis = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)

    def run_command(self, *args: str) -> str:
        out = StringIO()
        with self.captureOnCommitCallbacks(execute=True):
            call_command(*args, stdout=out)
        return out.getvalue()


class CreateTenantTests(CommandTestCase):
    def test_prints_a_key_alone_on_the_last_line_that_authenticates(self) -> None:
        out = self.run_command("create_tenant", "acme", "--floor", "3", "--max", "9", "--batch", "--shard", "eu-1")
        raw_key = out.rstrip("\n").splitlines()[-1]
        self.assertEqual(raw_key.strip(), raw_key)
        self.assertTrue(raw_key.startswith("fq_"))
        tenant = Tenant.objects.get(slug="acme")
        self.assertEqual(tenant_authenticate(raw_key=raw_key), tenant)
        self.assertNotEqual(tenant.api_key_hash, raw_key)
        self.assertNotIn(raw_key, json.dumps(Tenant.objects.values().get(), default=str))
        self.assertEqual((tenant.floor, tenant.max_concurrency, tenant.batch_enabled), (3, 9, True))
        self.assertTrue(Shard.objects.filter(name="eu-1").exists(), "missing shard is created")
        data = self.redis.hgetall(keys.tenant_key("acme"))
        self.assertEqual((data["floor"], data["shard"], data["batch_enabled"]), ("3", "eu-1", "1"))
        self.assertTrue(self.redis.exists(keys.shard_key("eu-1")))

    def test_all_options(self) -> None:
        self.run_command(
            "create_tenant",
            "acme",
            "--name",
            "Acme Corp",
            "--floor",
            "2",
            "--burst-floor",
            "3",
            "--burst-pct",
            "1.5",
            "--dedicated",
            "4",
            "--sub-tenant-share",
            "0.25",
            "--fan-out",
            "7",
        )
        tenant = Tenant.objects.get(slug="acme")
        self.assertEqual(tenant.max_fan_out, 7)
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "max_fan_out"), "7")
        self.assertEqual(tenant.name, "Acme Corp")
        self.assertEqual(tenant.shard.name, "default")
        self.assertEqual(
            (tenant.burst_floor, tenant.burst_pct, tenant.dedicated, tenant.sub_tenant_share), (3, 1.5, 4, 0.25)
        )

    def test_rerun_updates_and_rotates(self) -> None:
        first = self.run_command("create_tenant", "acme", "--floor", "2", "--max", "5").splitlines()[-1]
        second = self.run_command("create_tenant", "acme", "--floor", "4", "--no-batch").splitlines()[-1]
        self.assertNotEqual(first, second)
        self.assertIsNone(tenant_authenticate(raw_key=first))
        tenant = tenant_authenticate(raw_key=second)
        assert tenant is not None
        self.assertEqual((tenant.floor, tenant.max_concurrency), (4, 5), "options not given are kept")
        self.assertEqual(Tenant.objects.count(), 1)
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "floor"), "4")
        self.run_command("create_tenant", "acme", "--max", "none")
        self.assertIsNone(Tenant.objects.get().max_concurrency)

    def test_bad_values_are_clear_errors_and_change_nothing(self) -> None:
        cases = [
            (["--floor", "5", "--max", "4"], "above the hard max"),
            (["--max", "0"], "hard max of 0"),
            (["--burst-pct", "11"], "burst_pct"),
            (["--floor", "-1"], "floor"),
            (["--sub-tenant-share", "0"], "sub_tenant_share"),
            (["--fan-out", "0"], "max_fan_out"),
            (["--shard", "Bad Name"], "name"),
        ]
        for extra, fragment in cases:
            with self.subTest(extra=extra), self.assertRaises(CommandError) as ctx:
                call_command("create_tenant", "acme", *extra, stdout=StringIO())
            self.assertIn(fragment, str(ctx.exception))
        self.assertFalse(Tenant.objects.exists())
        with self.assertRaises(CommandError):
            call_command("create_tenant", "Not A Slug", stdout=StringIO())
        self.assertEqual(self.redis.dbsize(), 0)

    def test_failed_update_keeps_the_old_key_and_the_new_shard_is_rolled_back(self) -> None:
        raw_key = self.run_command("create_tenant", "acme").splitlines()[-1]
        with self.assertRaises(CommandError):
            call_command("create_tenant", "acme", "--shard", "new", "--max", "0", stdout=StringIO())
        self.assertIsNotNone(tenant_authenticate(raw_key=raw_key))
        self.assertFalse(Shard.objects.filter(name="new").exists())


class SyncPoliciesTests(CommandTestCase):
    def test_restores_everything_after_flushdb(self) -> None:
        self.run_command("create_tenant", "acme", "--floor", "3")
        with self.captureOnCommitCallbacks(execute=True):
            SubTenant.objects.create(tenant=Tenant.objects.get(), external_id="h1", max_concurrency=2)
        self.redis.flushdb()
        out = self.run_command("sync_policies")
        self.assertIn("tenants:         1 (with 1 sub-tenants)", out)
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "floor"), "3")
        self.assertEqual(self.redis.hgetall(keys.subtenants_key("acme")), {"h1": "2"})
        self.assertEqual(len(self.redis.smembers(keys.CLASSES_INDEX)), 4)
        self.assertTrue(self.redis.exists(keys.POOL_KEY, keys.SYNCED_KEY, keys.shard_key("default")))


class SeedDemoTests(CommandTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.keys_file = Path(self.tmp.name) / "demo-keys.json"

    def seed(self) -> str:
        return self.run_command("seed_demo", "--keys-file", str(self.keys_file))

    def snapshot(self) -> dict[str, object]:
        return {
            "shards": sorted(Shard.objects.values_list("name", "capacity")),
            "tenants": sorted(
                Tenant.objects.values_list("slug", "shard__name", "floor", "burst_pct", "batch_enabled", "api_key_hash")
            ),
            "subs": sorted(SubTenant.objects.values_list("tenant__slug", "external_id", "max_concurrency")),
            "redis_tenants": sorted(self.redis.smembers(keys.TENANTS_INDEX)),
        }

    def test_seeds_everything_and_is_idempotent(self) -> None:
        out = self.seed()
        self.assertIn("Admin login: admin / fairqueue-demo", out)
        self.assertIn(str(self.keys_file), out)
        demo_keys = json.loads(self.keys_file.read_text())
        self.assertEqual(set(demo_keys), {"acme", "globex", "initech", "umbrella", "hooli"})
        for slug, raw_key in demo_keys.items():
            tenant = tenant_authenticate(raw_key=raw_key)
            self.assertIsNotNone(tenant)
            assert tenant is not None
            self.assertEqual(tenant.slug, slug)
        self.assertEqual(self.keys_file.stat().st_mode & 0o777, 0o600)

        tenants = {t.slug: t for t in Tenant.objects.all()}
        self.assertEqual((tenants["acme"].floor, tenants["globex"].floor), (4, 4))
        self.assertEqual((tenants["initech"].floor, tenants["initech"].burst_pct), (2, 1.0))
        self.assertTrue(tenants["hooli"].batch_enabled)
        self.assertEqual(
            dict(SubTenant.objects.filter(tenant__slug="umbrella").values_list("external_id", "max_concurrency")),
            {"hospital-a": 2, "hospital-b": 3},
        )
        self.assertEqual(
            dict(Shard.objects.filter(name__in=["eu-1", "us-1"]).values_list("name", "capacity")),
            {"eu-1": 24, "us-1": 24},
        )
        self.assertEqual(self.redis.hgetall(keys.subtenants_key("umbrella")), {"hospital-a": "2", "hospital-b": "3"})
        self.assertTrue(self.redis.exists(keys.SYNCED_KEY))
        user = authenticate(username="admin", password="fairqueue-demo")
        self.assertTrue(user is not None and user.is_staff and user.is_superuser)

        before = self.snapshot()
        out = self.seed()
        self.assertIn("nothing created", out)
        self.assertEqual(self.snapshot(), before)
        self.assertEqual(json.loads(self.keys_file.read_text()), demo_keys, "keys kept, none rotated")
        self.assertIsNotNone(authenticate(username="admin", password="fairqueue-demo"))

    def test_resets_the_demo_password_and_keeps_other_key_entries(self) -> None:
        self.keys_file.write_text(json.dumps({"other": "fq_kept"}))
        self.seed()
        user = authenticate(username="admin", password="fairqueue-demo")
        assert user is not None
        user.set_password("changed-it-123")
        user.save()
        Tenant.objects.filter(slug="acme").update(api_key_hash="", api_key_prefix=None)
        self.seed()
        self.assertIsNotNone(authenticate(username="admin", password="fairqueue-demo"))
        demo_keys = json.loads(self.keys_file.read_text())
        self.assertEqual(demo_keys["other"], "fq_kept")
        self.assertIsNotNone(tenant_authenticate(raw_key=demo_keys["acme"]), "a keyless demo tenant gets a key")
