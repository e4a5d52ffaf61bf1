"""Model validation rules (full_clean) and API key hashing."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import IntegrityError

from tenants.models import LatencyClass, PoolSettings, Shard, SubTenant, Tenant
from tests.base import RedisTestCase


def make_tenant(slug: str = "acme", **fields: object) -> Tenant:
    shard = fields.pop("shard", None) or Shard.objects.get(name="default")
    return Tenant(slug=slug, name=slug.title(), shard=shard, **fields)  # type: ignore[arg-type]


class TenantValidationTests(RedisTestCase):
    def assert_invalid(self, tenant: Tenant, field: str, fragment: str = "") -> None:
        with self.assertRaises(ValidationError) as ctx:
            tenant.full_clean()
        self.assertIn(field, ctx.exception.message_dict)
        if fragment:
            self.assertIn(fragment, " ".join(ctx.exception.message_dict[field]))

    def test_a_sensible_tenant_is_valid(self) -> None:
        make_tenant(floor=4, max_concurrency=10, burst_pct=1.0).full_clean()

    def test_negative_numbers_are_rejected(self) -> None:
        for field in ("floor", "burst_floor", "dedicated", "max_concurrency"):
            with self.subTest(field=field):
                self.assert_invalid(make_tenant(**{field: -1}), field)

    def test_burst_pct_out_of_range(self) -> None:
        self.assert_invalid(make_tenant(burst_pct=-0.1), "burst_pct")
        self.assert_invalid(make_tenant(burst_pct=10.5), "burst_pct")
        make_tenant(burst_pct=0.0).full_clean()
        make_tenant(burst_pct=10.0).full_clean()

    def test_floor_above_hard_max(self) -> None:
        self.assert_invalid(make_tenant(floor=5, max_concurrency=4), "floor", "above the hard max")
        make_tenant(floor=4, max_concurrency=4).full_clean()

    def test_hard_max_of_zero(self) -> None:
        self.assert_invalid(make_tenant(floor=0, max_concurrency=0), "max_concurrency", "of 0")
        self.assert_invalid(make_tenant(floor=3, max_concurrency=0), "max_concurrency", "of 0")

    def test_floor_above_shard_capacity(self) -> None:
        small = Shard.objects.create(name="small", capacity=3)
        self.assert_invalid(make_tenant(floor=4, shard=small), "floor", "capacity of shard small")

    def test_sub_tenant_share_range(self) -> None:
        self.assert_invalid(make_tenant(sub_tenant_share=0), "sub_tenant_share")
        self.assert_invalid(make_tenant(sub_tenant_share=1.5), "sub_tenant_share")

    def test_slug_format(self) -> None:
        for slug in ("Acme", "-acme", "a b", ""):
            with self.subTest(slug=slug):
                self.assert_invalid(make_tenant(slug=slug), "slug")

    def test_slug_is_unique(self) -> None:
        make_tenant().save()
        self.assert_invalid(make_tenant(), "slug", "already exists")


class ApiKeyTests(RedisTestCase):
    def test_rotate_stores_only_a_hash_and_checks_the_raw_key(self) -> None:
        tenant = make_tenant()
        raw_key = tenant.rotate_api_key()
        tenant.save()
        tenant.refresh_from_db()
        self.assertNotEqual(tenant.api_key_hash, raw_key)
        self.assertNotIn(raw_key, tenant.api_key_hash)
        self.assertEqual(Tenant.prefix_of(raw_key), tenant.api_key_prefix)
        self.assertTrue(tenant.check_api_key(raw_key))
        self.assertFalse(tenant.check_api_key(raw_key + "x"))

    def test_rotation_invalidates_the_old_key(self) -> None:
        tenant = make_tenant()
        old = tenant.rotate_api_key()
        new = tenant.rotate_api_key()
        self.assertFalse(tenant.check_api_key(old))
        self.assertTrue(tenant.check_api_key(new))

    def test_prefix_of_rejects_foreign_keys(self) -> None:
        for raw in ("", "abc", "fq_short_x", "xx_12345678_abc"):
            self.assertIsNone(Tenant.prefix_of(raw))

    def test_tenant_without_key_never_authenticates(self) -> None:
        self.assertFalse(make_tenant().check_api_key(""))


class OtherModelValidationTests(RedisTestCase):
    def test_shard_capacity_must_be_positive(self) -> None:
        with self.assertRaises(ValidationError) as ctx:
            Shard(name="s", capacity=0).full_clean()
        self.assertIn("capacity", ctx.exception.message_dict)

    def test_latency_class_rules(self) -> None:
        for fields, field in (
            ({"objective_seconds": 0, "rank": 5}, "objective_seconds"),
            ({"objective_seconds": 10, "rank": 251}, "rank"),
            ({"objective_seconds": 10, "rank": 40}, "rank"),  # taken by "critical"
            ({"objective_seconds": 10, "rank": -1}, "rank"),
        ):
            with self.subTest(fields=fields), self.assertRaises(ValidationError) as ctx:
                LatencyClass(name="urgent", **fields).full_clean()
            self.assertIn(field, ctx.exception.message_dict)

    def test_sub_tenant_cap_must_be_positive(self) -> None:
        tenant = make_tenant()
        tenant.save()
        with self.assertRaises(ValidationError) as ctx:
            SubTenant(tenant=tenant, external_id="h1", max_concurrency=0).full_clean()
        self.assertIn("max_concurrency", ctx.exception.message_dict)

    def test_duplicate_sub_tenant_is_a_clear_error_and_a_constraint(self) -> None:
        tenant = make_tenant()
        tenant.save()
        SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=2)
        with self.assertRaises(ValidationError) as ctx:
            SubTenant(tenant=tenant, external_id="h1", max_concurrency=3).full_clean()
        self.assertIn("already has a sub-tenant 'h1'", str(ctx.exception))
        other = make_tenant("other")
        other.save()
        SubTenant(tenant=other, external_id="h1", max_concurrency=3).full_clean()  # other tenant: fine
        with self.assertRaises(IntegrityError):
            SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=3)

    def test_pool_f_min_above_f_max(self) -> None:
        pool = PoolSettings.load()
        pool.f_min, pool.f_max = 2.0, 1.0
        with self.assertRaises(ValidationError) as ctx:
            pool.full_clean()
        self.assertIn("f_min", ctx.exception.message_dict)

    def test_pool_ranges(self) -> None:
        for field, value in (
            ("target_utilisation", 0.0),
            ("target_utilisation", 1.5),
            ("f_min", 0),
            ("rate_window_seconds", 5),
            ("default_job_seconds", 0),
            ("batch_objective_seconds", 0),
        ):
            pool = PoolSettings.load()
            setattr(pool, field, value)
            with self.subTest(field=field, value=value), self.assertRaises(ValidationError) as ctx:
                pool.full_clean()
            self.assertIn(field, ctx.exception.message_dict)

    def test_pool_settings_is_a_single_row(self) -> None:
        PoolSettings(target_utilisation=0.5).save()
        self.assertEqual(PoolSettings.objects.count(), 1)
        self.assertEqual(PoolSettings.load().target_utilisation, 0.5)
