"""Policy mirrored into Redis: signals, bulk sync, full resync, the read cache and selectors."""

from __future__ import annotations

import time
from io import StringIO

import redis
from django.conf import settings
from django.core.management import call_command

from tenants import keys
from tenants.models import LatencyClass, PoolSettings, Shard, SubTenant, Tenant
from tenants.policy import CHECK_INTERVAL_SECONDS, policy_invalidate, policy_snapshot
from tenants.selectors import tenant_authenticate, tenant_live_state
from tenants.sync import policy_sync_all, tenant_policy_sync_on_commit
from tests.base import RedisTestCase


class PolicyTestCase(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.redis = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
        policy_invalidate()
        self.addCleanup(policy_invalidate)

    def create_tenant(self, slug: str = "acme", **fields: object) -> Tenant:
        fields.setdefault("shard", Shard.objects.get(name="default"))
        with self.captureOnCommitCallbacks(execute=True):
            return Tenant.objects.create(slug=slug, name=slug.title(), **fields)  # type: ignore[arg-type]

    def version(self) -> int:
        return int(self.redis.get(keys.VERSION_KEY) or 0)


class TenantSyncTests(PolicyTestCase):
    def test_saving_a_tenant_writes_its_hash_after_commit(self) -> None:
        high = LatencyClass.objects.get(name="high")
        with self.captureOnCommitCallbacks(execute=False) as callbacks:
            tenant = Tenant.objects.create(
                slug="acme",
                name="Acme",
                shard=Shard.objects.get(name="default"),
                floor=3,
                burst_floor=1,
                burst_pct=0.75,
                max_concurrency=9,
                dedicated=2,
                batch_enabled=True,
                default_latency_class=high,
                sub_tenant_share=0.4,
                max_fan_out=25,
            )
            self.assertFalse(self.redis.exists(keys.tenant_key("acme")), "nothing is written before commit")
        for callback in callbacks:
            callback()
        data = self.redis.hgetall(keys.tenant_key("acme"))
        self.assertEqual(
            data,
            {
                "slug": "acme",
                "name": "Acme",
                "active": "1",
                "shard": "default",
                "floor": "3",
                "burst_floor": "1",
                "burst_pct": "0.75",
                "max_concurrency": "9",
                "dedicated": "2",
                "batch_enabled": "1",
                "default_class": "high",
                "sub_tenant_share": "0.4",
                "max_fan_out": "25",
                "backlog_quota": "",
                "batch_backlog_quota": "",
                "submit_rate": "",
                "version": str(self.version()),
            },
        )
        self.assertEqual(self.redis.smembers(keys.TENANTS_INDEX), {"acme"})
        self.assertTrue(tenant.pk)

    def test_no_max_and_no_default_class_are_empty_strings(self) -> None:
        self.create_tenant()
        data = self.redis.hgetall(keys.tenant_key("acme"))
        self.assertEqual((data["max_concurrency"], data["default_class"]), ("", ""))

    def test_rolled_back_changes_are_not_written(self) -> None:
        with self.captureOnCommitCallbacks(execute=False) as callbacks:
            Tenant.objects.create(slug="acme", name="A", shard=Shard.objects.get(name="default"))
        # TestCase never commits: dropping the callbacks is what a rollback does. Two wait
        # for the commit: the sync, and the change's marker on the dashboard's charts.
        self.assertEqual(len(callbacks), 2)
        self.assertFalse(self.redis.exists(keys.tenant_key("acme"), keys.CHANGE_MARKERS_KEY))

    def test_every_change_increases_the_version(self) -> None:
        tenant = self.create_tenant()
        versions = [self.version()]
        for floor in (3, 4, 5):
            tenant.floor = floor
            with self.captureOnCommitCallbacks(execute=True):
                tenant.save()
            versions.append(self.version())
            self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "floor"), str(floor))
            self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "version"), str(self.version()))
        self.assertEqual(versions, sorted(set(versions)))

    def test_one_transaction_is_one_version(self) -> None:
        tenant = self.create_tenant()
        before = self.version()
        with self.captureOnCommitCallbacks(execute=True):
            tenant.floor = 5
            tenant.save()
            SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=2)
            SubTenant.objects.create(tenant=tenant, external_id="h2", max_concurrency=3)
        self.assertEqual(self.version(), before + 1)
        self.assertEqual(self.redis.hgetall(keys.subtenants_key("acme")), {"h1": "2", "h2": "3"})

    def test_key_rotation_alone_does_not_touch_policy(self) -> None:
        tenant = self.create_tenant()
        before = self.version()
        tenant.rotate_api_key()
        with self.captureOnCommitCallbacks(execute=True):
            tenant.save(update_fields=["api_key_prefix", "api_key_hash", "api_key_rotated_at", "updated_at"])
        self.assertEqual(self.version(), before)

    def test_deleting_a_tenant_removes_its_keys(self) -> None:
        tenant = self.create_tenant()
        with self.captureOnCommitCallbacks(execute=True):
            SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=2)
        self.assertTrue(self.redis.exists(keys.subtenants_key("acme")))
        before = self.version()
        with self.captureOnCommitCallbacks(execute=True):
            tenant.delete()
        self.assertFalse(self.redis.exists(keys.tenant_key("acme")))
        self.assertFalse(self.redis.exists(keys.subtenants_key("acme")))
        self.assertNotIn("acme", self.redis.smembers(keys.TENANTS_INDEX))
        self.assertGreater(self.version(), before)

    def test_renaming_a_tenant_moves_its_keys(self) -> None:
        tenant = self.create_tenant()
        tenant.slug = "acme-corp"
        with self.captureOnCommitCallbacks(execute=True):
            tenant.save()
        self.assertFalse(self.redis.exists(keys.tenant_key("acme")))
        self.assertEqual(self.redis.hget(keys.tenant_key("acme-corp"), "slug"), "acme-corp")
        self.assertEqual(self.redis.smembers(keys.TENANTS_INDEX), {"acme-corp"})

    def test_sub_tenant_changes_resync_the_hash(self) -> None:
        tenant = self.create_tenant()
        with self.captureOnCommitCallbacks(execute=True):
            sub = SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=2)
        self.assertEqual(self.redis.hgetall(keys.subtenants_key("acme")), {"h1": "2"})
        sub.max_concurrency = 7
        with self.captureOnCommitCallbacks(execute=True):
            sub.save()
        self.assertEqual(self.redis.hgetall(keys.subtenants_key("acme")), {"h1": "7"})
        with self.captureOnCommitCallbacks(execute=True):
            sub.delete()
        self.assertFalse(self.redis.exists(keys.subtenants_key("acme")))
        self.assertTrue(self.redis.exists(keys.tenant_key("acme")))

    def test_bulk_update_syncs_explicitly(self) -> None:
        self.create_tenant("a")
        self.create_tenant("b")
        with self.captureOnCommitCallbacks(execute=True):
            Tenant.objects.update(active=False)  # no signals
            tenant_policy_sync_on_commit(tenant_ids=Tenant.objects.values_list("pk", flat=True))
        self.assertEqual(self.redis.hget(keys.tenant_key("a"), "active"), "0")
        self.assertEqual(self.redis.hget(keys.tenant_key("b"), "active"), "0")


class OtherPolicySyncTests(PolicyTestCase):
    def test_shard_save_rename_and_delete(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            shard = Shard.objects.create(name="eu-1", capacity=24)
        self.assertEqual(self.redis.hget(keys.shard_key("eu-1"), "capacity"), "24")
        self.assertIn("eu-1", self.redis.smembers(keys.SHARDS_INDEX))
        self.create_tenant(shard=shard)
        shard.name = "eu-2"
        with self.captureOnCommitCallbacks(execute=True):
            shard.save()
        self.assertFalse(self.redis.exists(keys.shard_key("eu-1")))
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "shard"), "eu-2", "tenant hashes follow")
        Tenant.objects.all().delete()
        with self.captureOnCommitCallbacks(execute=True):
            shard.delete()
        self.assertFalse(self.redis.exists(keys.shard_key("eu-2")))
        self.assertNotIn("eu-2", self.redis.smembers(keys.SHARDS_INDEX))

    def test_latency_class_save_and_delete(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            urgent = LatencyClass.objects.create(name="urgent", objective_seconds=30, rank=50)
        data = self.redis.hgetall(keys.class_key("urgent"))
        self.assertEqual((data["objective_seconds"], data["rank"]), ("30", "50"))
        self.assertEqual(data["version"], str(self.version()))
        with self.captureOnCommitCallbacks(execute=True):
            urgent.delete()
        self.assertFalse(self.redis.exists(keys.class_key("urgent")))
        self.assertNotIn("urgent", self.redis.smembers(keys.CLASSES_INDEX))

    def test_pool_save(self) -> None:
        pool = PoolSettings.load()
        pool.f_max = 3.0
        with self.captureOnCommitCallbacks(execute=True):
            pool.save()
        data = self.redis.hgetall(keys.POOL_KEY)
        self.assertEqual(float(data["f_max"]), 3.0)
        self.assertEqual(int(data["batch_objective_seconds"]), 12 * 3600)
        self.assertEqual(data["version"], str(self.version()))


class FullResyncTests(PolicyTestCase):
    def seed(self) -> None:
        tenant = self.create_tenant(floor=3)
        with self.captureOnCommitCallbacks(execute=True):
            SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=2)

    def assert_everything_in_redis(self) -> None:
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "floor"), "3")
        self.assertEqual(self.redis.hgetall(keys.subtenants_key("acme")), {"h1": "2"})
        self.assertEqual(self.redis.smembers(keys.TENANTS_INDEX), {"acme"})
        self.assertEqual(self.redis.smembers(keys.SHARDS_INDEX), {"default"})
        self.assertEqual(self.redis.smembers(keys.CLASSES_INDEX), {"critical", "high", "default", "low"})
        self.assertEqual(self.redis.hget(keys.class_key("critical"), "objective_seconds"), "60")
        self.assertEqual(self.redis.hget(keys.shard_key("default"), "capacity"), "100")
        self.assertTrue(self.redis.exists(keys.POOL_KEY))
        self.assertTrue(self.redis.exists(keys.SYNCED_KEY))

    def test_sync_policies_restores_everything_after_flushdb(self) -> None:
        self.seed()
        self.redis.flushdb()
        out = StringIO()
        call_command("sync_policies", stdout=out)
        self.assert_everything_in_redis()
        self.assertIn("tenants:         1 (with 1 sub-tenants)", out.getvalue())
        self.assertIn("Policy version", out.getvalue())

    def test_full_sync_drops_stale_keys_and_keeps_the_counter_monotonic(self) -> None:
        self.seed()
        self.redis.set(keys.VERSION_KEY, 100)
        self.redis.hset(keys.tenant_key("ghost"), mapping={"slug": "ghost"})
        self.redis.sadd(keys.TENANTS_INDEX, "ghost")
        result = policy_sync_all()
        self.assertEqual(result.version, 101)
        self.assertEqual(self.version(), 101)
        self.assertFalse(self.redis.exists(keys.tenant_key("ghost")))
        self.assert_everything_in_redis()
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "version"), "101")

    def test_snapshot_resyncs_by_itself_after_flushdb(self) -> None:
        self.seed()
        policy_sync_all()
        self.assertEqual(policy_snapshot().tenants["acme"].floor, 3)  # a running process
        self.redis.flushdb()  # Redis restarted with nothing on disk
        time.sleep(CHECK_INTERVAL_SECONDS + 0.05)
        with self.assertLogs("fairqueue.tenants.policy", "WARNING") as logs:
            snapshot = policy_snapshot()  # no command, no invalidate
        self.assertIn("lost its data", logs.output[0])
        self.assertEqual(snapshot.tenants["acme"].floor, 3)
        self.assertEqual(snapshot.subtenants["acme"], {"h1": 2})
        self.assert_everything_in_redis()
        self.assertFalse(self.redis.exists(keys.RESYNC_LOCK_KEY), "the resync lock is released")

    def test_a_fresh_process_resyncs_an_empty_redis(self) -> None:
        self.seed()
        self.redis.flushdb()
        with self.assertLogs("fairqueue.tenants.policy", "WARNING"):
            snapshot = policy_snapshot()
        self.assertIn("acme", snapshot.tenants)
        self.assert_everything_in_redis()

    def test_only_the_lock_holder_resyncs(self) -> None:
        self.seed()
        policy_sync_all()
        cached = policy_snapshot()
        self.redis.flushdb()
        self.redis.set(keys.RESYNC_LOCK_KEY, "another-process", ex=5)
        time.sleep(CHECK_INTERVAL_SECONDS + 0.05)
        self.assertIs(policy_snapshot(), cached, "keeps scheduling on the last good policy meanwhile")
        self.assertFalse(self.redis.exists(keys.SYNCED_KEY), "did not resync behind the holder's back")
        self.redis.delete(keys.RESYNC_LOCK_KEY)
        time.sleep(CHECK_INTERVAL_SECONDS + 0.05)
        with self.assertLogs("fairqueue.tenants.policy", "WARNING"):
            self.assertIn("acme", policy_snapshot().tenants)
        self.assertTrue(self.redis.exists(keys.SYNCED_KEY))


class SnapshotTests(PolicyTestCase):
    def setUp(self) -> None:
        super().setUp()
        policy_sync_all()  # a Redis that has been synced before, as in production

    def test_snapshot_contents(self) -> None:
        tenant = self.create_tenant(floor=3, max_concurrency=8, burst_pct=1.0, batch_enabled=True)
        with self.captureOnCommitCallbacks(execute=True):
            SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=2)
        snap = policy_snapshot()
        acme = snap.tenants["acme"]
        self.assertEqual((acme.floor, acme.max_concurrency, acme.burst_pct), (3, 8, 1.0))
        self.assertTrue(acme.active and acme.batch_enabled)
        self.assertEqual(acme.default_class, "default")
        self.assertEqual(acme.shard, "default")
        self.assertEqual(snap.subtenant_cap("acme", "h1"), 2)
        self.assertIsNone(snap.subtenant_cap("acme", "nobody"))
        self.assertEqual(snap.shards["default"].capacity, 100)
        self.assertEqual(snap.classes["critical"].rank, 40)
        self.assertEqual(snap.classes["low"].objective_seconds, 86400)
        self.assertEqual(snap.pool.batch_objective_seconds, 12 * 3600)
        self.assertEqual(snap.version, self.version())

    def test_an_edit_reaches_a_running_process_within_the_check_interval(self) -> None:
        tenant = self.create_tenant(floor=2)
        self.assertEqual(policy_snapshot().tenants["acme"].floor, 2)
        tenant.floor = 6
        with self.captureOnCommitCallbacks(execute=True):
            tenant.save()
        deadline = time.monotonic() + CHECK_INTERVAL_SECONDS + 0.2
        while policy_snapshot().tenants["acme"].floor != 6:
            self.assertLess(time.monotonic(), deadline, "the change never reached the cache")
            time.sleep(0.02)

    def test_cache_is_not_reread_within_the_interval(self) -> None:
        self.create_tenant()
        first = policy_snapshot()
        self.redis.incr(keys.VERSION_KEY)
        self.assertIs(policy_snapshot(), first)
        time.sleep(CHECK_INTERVAL_SECONDS + 0.05)
        self.assertIsNot(policy_snapshot(), first)

    def test_unchanged_version_keeps_the_same_snapshot(self) -> None:
        self.create_tenant()
        first = policy_snapshot()
        time.sleep(CHECK_INTERVAL_SECONDS + 0.05)
        self.assertIs(policy_snapshot(), first)

    def test_deleted_tenant_leaves_the_snapshot(self) -> None:
        tenant = self.create_tenant()
        self.assertIn("acme", policy_snapshot().tenants)
        with self.captureOnCommitCallbacks(execute=True):
            tenant.delete()
        policy_invalidate()
        self.assertNotIn("acme", policy_snapshot().tenants)


class SelectorTests(PolicyTestCase):
    def setUp(self) -> None:
        super().setUp()
        policy_sync_all()

    def test_authenticate(self) -> None:
        tenant = self.create_tenant()
        raw_key = tenant.rotate_api_key()
        tenant.save()
        self.assertEqual(tenant_authenticate(raw_key=raw_key), tenant)
        self.assertIsNone(tenant_authenticate(raw_key=raw_key[:-1] + ("A" if raw_key[-1] != "A" else "B")))
        self.assertIsNone(tenant_authenticate(raw_key=""))
        self.assertIsNone(tenant_authenticate(raw_key="fq_00000000_nothing"))
        self.assertIsNone(tenant_authenticate(raw_key=tenant.api_key_hash))

    def test_live_state_reports_what_redis_holds(self) -> None:
        tenant = self.create_tenant(floor=3)
        state = tenant_live_state(tenant=tenant)
        self.assertEqual(state["Matches database"], "yes")
        self.assertEqual(state["Synced policy"]["floor"], "3")
        self.assertEqual(state["Tenant policy version"], str(self.version()))
        self.assertEqual(state["Global policy version"], str(self.version()))
        Tenant.objects.filter(pk=tenant.pk).update(floor=4)  # no signal: Redis is now stale
        tenant.refresh_from_db()
        self.assertIn("floor", tenant_live_state(tenant=tenant)["Matches database"])
        self.redis.flushdb()
        self.assertIn("not in Redis", tenant_live_state(tenant=tenant)["Matches database"])
