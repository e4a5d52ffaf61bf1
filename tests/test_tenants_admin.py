"""The tenant policy admin: pages, validation errors, key rotation, bulk actions, Redis sync."""

from __future__ import annotations

import re
from contextlib import nullcontext
from typing import Any

import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.urls import reverse

from tenants import keys
from tenants.models import LatencyClass, PoolSettings, Shard, SubTenant, Tenant
from tenants.selectors import tenant_authenticate
from tenants.sync import policy_sync_all
from tests.base import RedisTestCase

KEY_RE = re.compile(r'<code class="fq-api-key">(fq_[^<]+)</code>')


def tenant_form(**overrides: Any) -> dict[str, Any]:
    """POST data for the tenant add/change form, including an empty sub-tenant inline."""
    data: dict[str, Any] = {
        "slug": "acme",
        "name": "Acme",
        "active": "on",
        "shard": Shard.objects.get(name="default").pk,
        "floor": "2",
        "burst_floor": "2",
        "burst_pct": "0.5",
        "max_concurrency": "",
        "dedicated": "0",
        "default_latency_class": "",
        "sub_tenant_share": "0.5",
        "max_fan_out": "10",
        "sub_tenants-TOTAL_FORMS": "0",
        "sub_tenants-INITIAL_FORMS": "0",
        "sub_tenants-MIN_NUM_FORMS": "0",
        "sub_tenants-MAX_NUM_FORMS": "1000",
    }
    data.update(overrides)
    return {k: v for k, v in data.items() if v is not None}


def with_sub_tenants(data: dict[str, Any], rows: list[tuple[str, int]]) -> dict[str, Any]:
    data = dict(data)
    data["sub_tenants-TOTAL_FORMS"] = str(len(rows))
    for i, (external_id, cap) in enumerate(rows):
        data[f"sub_tenants-{i}-external_id"] = external_id
        data[f"sub_tenants-{i}-max_concurrency"] = str(cap)
    return data


class AdminTestCase(RedisTestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.staff = get_user_model().objects.create_superuser("boss", "boss@example.com", "pw-not-used-123")

    def setUp(self) -> None:
        super().setUp()
        self.redis = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
        self.client.force_login(self.staff)

    def make_tenant(self, slug: str = "acme", **fields: Any) -> Tenant:
        fields.setdefault("shard", Shard.objects.get(name="default"))
        with self.captureOnCommitCallbacks(execute=True):
            return Tenant.objects.create(slug=slug, name=slug.title(), **fields)

    def assert_form_error(self, response: Any, field: str | None, fragment: str) -> None:
        self.assertEqual(response.status_code, 200, "an invalid form re-renders instead of redirecting")
        html = response.content.decode()
        self.assertIn("errornote", html)
        self.assertIn(fragment, html)
        if field is not None:
            self.assertIn(fragment, " ".join(response.context["adminform"].form.errors.get(field, [])))


class PagesTests(AdminTestCase):
    def objects(self) -> dict[str, Any]:
        tenant = self.make_tenant()
        sub = SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=2)
        return {
            "tenant": tenant,
            "subtenant": sub,
            "shard": Shard.objects.get(name="default"),
            "latencyclass": LatencyClass.objects.get(name="high"),
            "poolsettings": PoolSettings.load(),
        }

    def test_every_model_lists_adds_and_changes_for_staff(self) -> None:
        for model, obj in self.objects().items():
            with self.subTest(model=model):
                changelist = self.client.get(reverse(f"admin:tenants_{model}_changelist"), follow=True)
                self.assertEqual(changelist.status_code, 200)
                self.assertContains(changelist, str(obj))
                change = self.client.get(reverse(f"admin:tenants_{model}_change", args=[obj.pk]))
                self.assertEqual(change.status_code, 200)
                with self.assertLogs("django.request", "WARNING") if model == "poolsettings" else nullcontext():
                    add = self.client.get(reverse(f"admin:tenants_{model}_add"))
                self.assertEqual(add.status_code, 403 if model == "poolsettings" else 200)

    def test_search_and_filters_render(self) -> None:
        self.objects()
        url = reverse("admin:tenants_tenant_changelist")
        self.assertContains(self.client.get(url, {"q": "h1"}), "acme")
        self.assertContains(self.client.get(url, {"active__exact": "1", "batch_enabled__exact": "0"}), "acme")
        self.assertContains(self.client.get(reverse("admin:tenants_subtenant_changelist"), {"q": "acme"}), "h1")

    def test_anonymous_users_are_sent_to_login(self) -> None:
        objects = self.objects()
        self.client.logout()
        for model, obj in objects.items():
            for url in (
                reverse(f"admin:tenants_{model}_changelist"),
                reverse(f"admin:tenants_{model}_add"),
                reverse(f"admin:tenants_{model}_change", args=[obj.pk]),
            ):
                with self.subTest(url=url):
                    response = self.client.get(url)
                    self.assertEqual(response.status_code, 302)
                    self.assertIn(reverse("admin:login"), response["Location"])
        response = self.client.post(reverse("admin:tenants_tenant_add"), tenant_form(slug="sneaky"))
        self.assertEqual(response.status_code, 302)
        self.assertFalse(Tenant.objects.filter(slug="sneaky").exists())

    def test_non_staff_users_are_refused(self) -> None:
        user = get_user_model().objects.create_user("customer", password="pw-not-used-123")
        self.client.force_login(user)
        response = self.client.get(reverse("admin:tenants_tenant_changelist"))
        self.assertEqual(response.status_code, 302)

    def test_saving_each_simple_model(self) -> None:
        cases = [
            ("shard", Shard.objects.get(name="default"), {"name": "default", "capacity": "80"}, "capacity", 80),
            (
                "latencyclass",
                LatencyClass.objects.get(name="high"),
                {"name": "high", "rank": "30", "objective_seconds": "240"},
                "objective_seconds",
                240,
            ),
            (
                "poolsettings",
                PoolSettings.load(),
                {
                    "target_utilisation": "0.9",
                    "f_min": "0.5",
                    "f_max": "2.0",
                    "rate_window_seconds": "120",
                    "default_job_seconds": "2.5",
                    "batch_objective_seconds": "43200",
                    "floor_headroom": "0",
                    "quarantine_after_losses": "1",
                    "quarantine_poison_losses": "2",
                    "quarantine_slots": "1",
                    "backlog_quota": "100000",
                    "batch_backlog_quota": "1000000",
                    "submit_rate": "0",
                    "submit_burst": "1000",
                    "memory_guard_pct": "80",
                },
                "f_max",
                2.0,
            ),
        ]
        for model, obj, data, field, expected in cases:
            with self.subTest(model=model), self.captureOnCommitCallbacks(execute=True):
                response = self.client.post(reverse(f"admin:tenants_{model}_change", args=[obj.pk]), data)
                self.assertEqual(response.status_code, 302, getattr(response, "context", None) and response.content)
            obj.refresh_from_db()
            self.assertEqual(getattr(obj, field), expected)
        self.assertEqual(self.redis.hget(keys.shard_key("default"), "capacity"), "80")
        self.assertEqual(self.redis.hget(keys.class_key("high"), "objective_seconds"), "240")
        self.assertEqual(float(self.redis.hget(keys.POOL_KEY, "f_max") or 0), 2.0)

    def test_sub_tenant_add_page_saves(self) -> None:
        tenant = self.make_tenant()
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(
                reverse("admin:tenants_subtenant_add"),
                {"tenant": tenant.pk, "external_id": "clinic-9", "max_concurrency": "4"},
            )
        self.assertEqual(response.status_code, 302)
        self.assertEqual(self.redis.hgetall(keys.subtenants_key("acme")), {"clinic-9": "4"})

    def test_pool_settings_cannot_be_added_twice_or_deleted(self) -> None:
        pool = PoolSettings.load()
        with self.assertLogs("django.request", "WARNING"):
            self.assertEqual(self.client.post(reverse("admin:tenants_poolsettings_add"), {}).status_code, 403)
        with self.assertLogs("django.request", "WARNING"):
            delete = self.client.post(reverse("admin:tenants_poolsettings_delete", args=[pool.pk]), {"post": "yes"})
        self.assertEqual(delete.status_code, 403)
        self.assertEqual(PoolSettings.objects.count(), 1)

    def test_default_latency_class_cannot_be_deleted(self) -> None:
        default = LatencyClass.objects.get(name="default")
        with self.assertLogs("django.request", "WARNING"):
            response = self.client.post(
                reverse("admin:tenants_latencyclass_delete", args=[default.pk]), {"post": "yes"}
            )
        self.assertEqual(response.status_code, 403)
        self.assertTrue(LatencyClass.objects.filter(name="default").exists())


class TenantValidationTests(AdminTestCase):
    def post_add(self, **overrides: Any) -> Any:
        return self.client.post(reverse("admin:tenants_tenant_add"), tenant_form(**overrides))

    def test_each_rule_is_a_clear_form_error(self) -> None:
        cases = [
            ({"floor": "-1"}, "floor", "greater than or equal to 0"),
            ({"burst_floor": "-2"}, "burst_floor", "greater than or equal to 0"),
            ({"dedicated": "-3"}, "dedicated", "greater than or equal to 0"),
            ({"max_concurrency": "-1"}, "max_concurrency", "greater than or equal to 0"),
            ({"burst_pct": "-0.1"}, "burst_pct", "between 0 and 10"),
            ({"burst_pct": "12"}, "burst_pct", "between 0 and 10"),
            ({"floor": "5", "max_concurrency": "4"}, "floor", "above the hard max"),
            ({"max_concurrency": "0"}, "max_concurrency", "hard max of 0"),
            ({"floor": "101"}, "floor", "capacity of shard default"),
            ({"sub_tenant_share": "0"}, "sub_tenant_share", "greater than or equal to 0.01"),
            ({"sub_tenant_share": "2"}, "sub_tenant_share", "less than or equal to 1.0"),
            ({"max_fan_out": "0"}, "max_fan_out", "greater than or equal to 1"),
            ({"slug": "Not A Slug"}, "slug", "lowercase"),
        ]
        for overrides, field, fragment in cases:
            with self.subTest(overrides=overrides):
                self.assert_form_error(self.post_add(**overrides), field, fragment)
        self.assertFalse(Tenant.objects.exists())
        self.assertEqual(self.redis.dbsize(), 0)

    def test_duplicate_slug(self) -> None:
        self.make_tenant()
        self.assert_form_error(self.post_add(), "slug", "already exists")

    def test_duplicate_sub_tenant_ids_inside_the_inline(self) -> None:
        data = with_sub_tenants(tenant_form(), [("h1", 2), ("h1", 3)])
        response = self.client.post(reverse("admin:tenants_tenant_add"), data)
        self.assertEqual(response.status_code, 200)
        self.assertContains(response, "Sub-tenant id &#x27;h1&#x27; appears twice")
        self.assertFalse(Tenant.objects.exists())

    def test_duplicate_of_an_existing_sub_tenant_on_change(self) -> None:
        tenant = self.make_tenant()
        existing = SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=2)
        data = with_sub_tenants(tenant_form(), [("h1", 2), ("h1", 5)])
        data["sub_tenants-INITIAL_FORMS"] = "1"
        data["sub_tenants-0-id"] = str(existing.pk)
        data["sub_tenants-0-tenant"] = str(tenant.pk)
        response = self.client.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]), data)
        self.assertEqual(response.status_code, 200)
        self.assertContains(response, "Tenant acme already has a sub-tenant &#x27;h1&#x27;.")
        self.assertEqual(SubTenant.objects.get().max_concurrency, 2)

    def test_duplicate_in_the_sub_tenant_admin(self) -> None:
        tenant = self.make_tenant()
        SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=2)
        response = self.client.post(
            reverse("admin:tenants_subtenant_add"), {"tenant": tenant.pk, "external_id": "h1", "max_concurrency": "3"}
        )
        self.assertEqual(response.status_code, 200)
        self.assertContains(response, "already has a sub-tenant")

    def test_sub_tenant_cap_of_zero(self) -> None:
        data = with_sub_tenants(tenant_form(), [("h1", 0)])
        response = self.client.post(reverse("admin:tenants_tenant_add"), data)
        self.assertEqual(response.status_code, 200)
        self.assertContains(response, "greater than or equal to 1")

    def test_pool_f_min_above_f_max(self) -> None:
        pool = PoolSettings.load()
        data = {
            "target_utilisation": "0.85",
            "f_min": "3",
            "f_max": "2",
            "rate_window_seconds": "300",
            "default_job_seconds": "1",
            "batch_objective_seconds": "43200",
            "floor_headroom": "0",
            "quarantine_after_losses": "1",
            "quarantine_poison_losses": "2",
            "quarantine_slots": "1",
            "backlog_quota": "100000",
            "batch_backlog_quota": "1000000",
            "submit_rate": "0",
            "submit_burst": "1000",
            "memory_guard_pct": "80",
        }
        response = self.client.post(reverse("admin:tenants_poolsettings_change", args=[pool.pk]), data)
        self.assert_form_error(response, "f_min", "must not exceed f_max")
        for field, value, fragment in (
            ("target_utilisation", "1.5", "less than or equal to 1.0"),
            ("f_max", "-1", "greater than or equal to 0.01"),
            ("rate_window_seconds", "-5", "greater than or equal to"),
        ):
            with self.subTest(field=field):
                bad = {**data, "f_min": "0.25", "f_max": "4", field: value}
                url = reverse("admin:tenants_poolsettings_change", args=[pool.pk])
                self.assert_form_error(self.client.post(url, bad), field, fragment)

    def test_shard_and_class_rules(self) -> None:
        response = self.client.post(reverse("admin:tenants_shard_add"), {"name": "eu-1", "capacity": "0"})
        self.assert_form_error(response, "capacity", "greater than or equal to 1")
        response = self.client.post(reverse("admin:tenants_shard_add"), {"name": "default", "capacity": "5"})
        self.assert_form_error(response, "name", "already exists")
        url = reverse("admin:tenants_latencyclass_add")
        for data, field, fragment in (
            ({"name": "urgent", "rank": "40", "objective_seconds": "30"}, "rank", "already exists"),
            ({"name": "urgent", "rank": "251", "objective_seconds": "30"}, "rank", "less than or equal to 250"),
            ({"name": "urgent", "rank": "45", "objective_seconds": "0"}, "objective_seconds", "greater than or equal"),
        ):
            with self.subTest(data=data):
                self.assert_form_error(self.client.post(url, data), field, fragment)


class TenantAdminFlowTests(AdminTestCase):
    def test_add_shows_a_key_once_that_authenticates_and_syncs(self) -> None:
        data = with_sub_tenants(tenant_form(floor="3", max_concurrency="10"), [("h1", 2), ("h2", 3)])
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(reverse("admin:tenants_tenant_add"), data)
        self.assertEqual(response.status_code, 200)
        self.assertIn("no-store", response["Cache-Control"])
        raw_key = KEY_RE.findall(response.content.decode())[0]
        tenant = Tenant.objects.get(slug="acme")
        self.assertEqual(tenant_authenticate(raw_key=raw_key), tenant)
        self.assertNotEqual(tenant.api_key_hash, raw_key)
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "floor"), "3")
        self.assertEqual(self.redis.hgetall(keys.subtenants_key("acme")), {"h1": "2", "h2": "3"})
        # Never shown again.
        page = self.client.get(reverse("admin:tenants_tenant_change", args=[tenant.pk])).content.decode()
        self.assertNotIn(raw_key, page)

    def test_change_updates_redis(self) -> None:
        tenant = self.make_tenant()
        before = int(self.redis.get(keys.VERSION_KEY) or 0)
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(
                reverse("admin:tenants_tenant_change", args=[tenant.pk]), tenant_form(floor="7", batch_enabled="on")
            )
        self.assertEqual(response.status_code, 302)
        data = self.redis.hgetall(keys.tenant_key("acme"))
        self.assertEqual((data["floor"], data["batch_enabled"]), ("7", "1"))
        self.assertEqual(int(self.redis.get(keys.VERSION_KEY) or 0), before + 1)

    def test_delete_removes_redis_keys(self) -> None:
        tenant = self.make_tenant()
        with self.captureOnCommitCallbacks(execute=True):
            SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=2)
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(reverse("admin:tenants_tenant_delete", args=[tenant.pk]), {"post": "yes"})
        self.assertEqual(response.status_code, 302)
        self.assertFalse(self.redis.exists(keys.tenant_key("acme"), keys.subtenants_key("acme")))
        self.assertNotIn("acme", self.redis.smembers(keys.TENANTS_INDEX))

    def test_rotate_action_confirms_then_shows_new_keys_once(self) -> None:
        a, b = self.make_tenant("a"), self.make_tenant("b")
        old_key = a.rotate_api_key()
        a.save()
        url = reverse("admin:tenants_tenant_changelist")
        confirm = self.client.post(url, {"action": "rotate_api_keys", "_selected_action": [a.pk, b.pk]})
        self.assertEqual(confirm.status_code, 200)
        self.assertContains(confirm, "Rotate API keys?")
        a.refresh_from_db()
        self.assertTrue(a.check_api_key(old_key), "nothing rotates before confirmation")

        response = self.client.post(
            url, {"action": "rotate_api_keys", "_selected_action": [a.pk, b.pk], "confirm": "yes"}
        )
        self.assertEqual(response.status_code, 200)
        raw_keys = KEY_RE.findall(response.content.decode())
        self.assertEqual(len(raw_keys), 2)
        authenticated = {tenant_authenticate(raw_key=k) for k in raw_keys}
        self.assertEqual(authenticated, {a, b})
        self.assertIsNone(tenant_authenticate(raw_key=old_key))
        for tenant in Tenant.objects.all():
            self.assertNotIn(tenant.api_key_hash, raw_keys)
            self.assertTrue(all(tenant.api_key_hash not in k for k in raw_keys))

    def test_bulk_activate_and_deactivate_sync_redis(self) -> None:
        a, b = self.make_tenant("a"), self.make_tenant("b")
        url = reverse("admin:tenants_tenant_changelist")
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(url, {"action": "deactivate", "_selected_action": [a.pk, b.pk]})
        self.assertEqual(response.status_code, 302)
        self.assertEqual(set(Tenant.objects.values_list("active", flat=True)), {False})
        self.assertEqual(self.redis.hget(keys.tenant_key("a"), "active"), "0")
        self.assertEqual(self.redis.hget(keys.tenant_key("b"), "active"), "0")
        with self.captureOnCommitCallbacks(execute=True):
            self.client.post(url, {"action": "activate", "_selected_action": [a.pk]})
        self.assertEqual(self.redis.hget(keys.tenant_key("a"), "active"), "1")
        self.assertEqual(self.redis.hget(keys.tenant_key("b"), "active"), "0")

    def test_change_page_shows_live_state_from_redis(self) -> None:
        tenant = self.make_tenant(floor=3)
        policy_sync_all()
        page = self.client.get(reverse("admin:tenants_tenant_change", args=[tenant.pk]))
        self.assertContains(page, "Live state (Redis)")
        self.assertContains(page, f"{keys.tenant_key('acme')} holds version")
        self.assertContains(page, "matches the database: yes")
        self.assertContains(page, "<dt>Synced policy</dt><dd>floor 3, burst floor 2,", html=False)
