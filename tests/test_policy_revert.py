"""Reverting a policy change from its history: through the admin's validation, move
confirmation and Redis sync, recorded as a change of its own; restoring a deleted object."""

from __future__ import annotations

from typing import Any

from django.urls import reverse

from fairqueue.jobs.models import Job
from tenants import keys
from tenants.models import PoolSettings, Shard, SubTenant, Tenant
from tenants.selectors import tenant_authenticate
from tests.test_policy_history import HistoryTestCase
from tests.test_tenants_admin import KEY_RE


class RevertTests(HistoryTestCase):
    def change_of(self, row: Any, **fields: Any) -> int:
        """Make a change through the ORM; its history id."""
        for name, value in fields.items():
            setattr(row, name, value)
        with self.captureOnCommitCallbacks(execute=True):
            row.save()
        return int(type(row).history.filter(id=row.pk).latest("history_date").history_id)

    def revert(self, model: str, pk: int, history_id: int, **data: Any) -> Any:
        with self.captureOnCommitCallbacks(execute=True):
            return self.client.post(reverse(f"admin:tenants_{model}_revert", args=[pk, history_id]), data)

    def test_one_click_puts_the_old_values_back_syncs_redis_and_is_a_change_of_its_own(self) -> None:
        tenant = self.make_tenant(floor=2)
        response = self.post_change(tenant, floor="9", burst_pct="1.5", change_reason="3 a.m. experiment")
        self.assertEqual(response.status_code, 302)
        bad = self.latest(tenant).history_id
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "floor"), "9")
        timeline = self.client.get(reverse("admin:tenants_policychange_changelist")).content.decode()
        revert_url = reverse("admin:tenants_tenant_revert", args=[tenant.pk, bad])
        self.assertIn(f'action="{revert_url}"', timeline, "a Revert button on the change")

        response = self.revert("tenant", tenant.pk, bad)
        self.assertEqual(response.status_code, 302)
        self.assertEqual(response["Location"], reverse("admin:tenants_tenant_history", args=[tenant.pk]))
        tenant.refresh_from_db()
        self.assertEqual((tenant.floor, tenant.burst_pct), (2, 0.5))
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "floor"), "2")
        record = self.latest(tenant)
        self.assertEqual((record.history_type, record.history_user, record.history_source), ("~", self.boss, "admin"))
        self.assertTrue(record.history_change_reason.startswith(f"Revert of change {bad} (boss, "))
        self.assertEqual(record.prev_record.history_id, bad)

    def test_a_reason_given_with_the_revert_is_kept(self) -> None:
        tenant = self.make_tenant()
        bad = self.change_of(tenant, floor=7)
        self.revert("tenant", tenant.pk, bad, change_reason="paged at 3:05")
        self.assertTrue(self.latest(tenant).history_change_reason.endswith(": paged at 3:05"))

    def test_only_the_fields_of_that_change_are_reverted(self) -> None:
        tenant = self.make_tenant(floor=2, dedicated=0)
        floor_change = self.change_of(tenant, floor=6)
        self.change_of(tenant, dedicated=3)
        self.revert("tenant", tenant.pk, floor_change)
        tenant.refresh_from_db()
        self.assertEqual((tenant.floor, tenant.dedicated), (2, 3))

    def test_a_value_changed_again_since_asks_before_it_is_put_back(self) -> None:
        tenant = self.make_tenant(floor=2)
        first = self.change_of(tenant, floor=6)
        self.change_of(tenant, floor=8)
        page = self.revert("tenant", tenant.pk, first)
        self.assertEqual(page.status_code, 200)
        self.assertContains(page, "Changed again since this change: floor")
        self.assertEqual(Tenant.objects.get(pk=tenant.pk).floor, 8)
        done = self.revert("tenant", tenant.pk, first, confirm="on")
        self.assertEqual(done.status_code, 302)
        self.assertEqual(Tenant.objects.get(pk=tenant.pk).floor, 2)

    def test_a_revert_the_validation_refuses_changes_nothing(self) -> None:
        tenant = self.make_tenant(floor=10)
        lowered = self.change_of(tenant, floor=2)
        self.change_of(Shard.objects.get(name="default"), capacity=5)
        version = self.redis.get(keys.VERSION_KEY)
        refused = self.revert("tenant", tenant.pk, lowered, confirm="on")
        self.assertContains(refused, "Floor (10) is above the capacity of shard default (5)", status_code=400)
        self.assertNotContains(refused, 'type="submit" value="Revert"', status_code=400)
        self.assertEqual(Tenant.objects.get(pk=tenant.pk).floor, 2)
        self.assertEqual(self.latest(tenant).history_id, lowered, "no change recorded")
        self.assertEqual(self.redis.get(keys.VERSION_KEY), version, "nothing reached Redis")

    def test_a_revert_that_moves_unfinished_jobs_asks_for_the_move_confirmation(self) -> None:
        tenant = self.make_tenant()
        east = Shard.objects.create(name="east", capacity=40)
        moved = self.change_of(tenant, shard=east)
        Job.objects.create(tenant=tenant, task="demo.sleep", latency_class="default")
        page = self.revert("tenant", tenant.pk, moved)
        self.assertEqual(page.status_code, 200)
        self.assertContains(page, "Moving acme from shard east to default")
        self.assertContains(page, "waiting job(s) will be re-admitted at the new place")
        self.assertEqual(Tenant.objects.get(pk=tenant.pk).shard, east)
        done = self.revert("tenant", tenant.pk, moved, confirm="on")
        self.assertEqual(done.status_code, 302)
        self.assertEqual(Tenant.objects.get(pk=tenant.pk).shard.name, "default")
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "shard"), "default")

    def test_reverting_a_deletion_restores_the_tenant_with_a_new_key_shown_once(self) -> None:
        tenant = self.make_tenant(floor=3)
        pk = tenant.pk
        with self.captureOnCommitCallbacks(execute=True):
            self.client.post(reverse("admin:tenants_tenant_delete", args=[pk]), {"post": "yes"})
        deletion = int(Tenant.history.filter(id=pk, history_type="-").get().history_id)  # type: ignore[attr-defined]
        page = self.client.get(reverse("admin:tenants_tenant_history", args=[pk]))
        self.assertContains(page, 'value="Restore"')
        response = self.revert("tenant", pk, deletion)
        self.assertEqual(response.status_code, 200)
        self.assertIn("no-store", response["Cache-Control"])
        raw_key = KEY_RE.findall(response.content.decode())[0]
        restored = Tenant.objects.get(pk=pk)
        self.assertEqual((restored.slug, restored.floor), ("acme", 3))
        self.assertEqual(tenant_authenticate(raw_key=raw_key), restored)
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "floor"), "3")
        record = self.latest(restored)
        self.assertEqual((record.history_type, record.history_source), ("+", "admin"))
        self.assertIn(f"Revert of change {deletion}", record.history_change_reason)

    def test_a_deleted_sub_tenant_comes_back(self) -> None:
        tenant = self.make_tenant()
        sub = SubTenant.objects.create(tenant=tenant, external_id="h1", max_concurrency=3)
        pk = sub.pk
        with self.captureOnCommitCallbacks(execute=True):
            sub.delete()
        deletion = int(SubTenant.history.get(id=pk, history_type="-").history_id)  # type: ignore[attr-defined]
        response = self.revert("subtenant", pk, deletion)
        self.assertEqual(response.status_code, 302)
        self.assertEqual(SubTenant.objects.get(pk=pk).max_concurrency, 3)
        self.assertEqual(self.redis.hgetall(keys.subtenants_key("acme")), {"h1": "3"})

    def test_pool_settings_and_shards_revert_too(self) -> None:
        pool = PoolSettings.load()
        change = self.change_of(pool, f_max=2.0)
        self.assertEqual(self.revert("poolsettings", pool.pk, change).status_code, 302)
        self.assertEqual(PoolSettings.load().f_max, 4.0)
        self.assertEqual(float(self.redis.hget(keys.POOL_KEY, "f_max") or 0), 4.0)
        shard = Shard.objects.get(name="default")
        change = self.change_of(shard, capacity=70)
        self.assertEqual(self.revert("shard", shard.pk, change).status_code, 302)
        self.assertEqual(self.redis.hget(keys.shard_key("default"), "capacity"), "100")

    def test_what_cannot_be_reverted_says_why(self) -> None:
        tenant = self.make_tenant()
        created = int(self.latest(tenant).history_id)
        response = self.revert("tenant", tenant.pk, created)
        self.assertEqual(response.status_code, 302)
        messages = [str(m) for m in response.wsgi_request._messages]  # type: ignore[attr-defined]
        self.assertTrue(any("delete the object" in m for m in messages), messages)
        rotation = self.change_of(tenant, api_key_prefix="abcd1234")
        response = self.revert("tenant", tenant.pk, rotation)
        messages = [str(m) for m in response.wsgi_request._messages]  # type: ignore[attr-defined]
        self.assertTrue(any("changed nothing the admin sets (api key prefix)" in m for m in messages), messages)
        self.assertEqual(Tenant.objects.get(pk=tenant.pk).api_key_prefix, "abcd1234")

    def test_a_revert_is_a_post(self) -> None:
        tenant = self.make_tenant()
        change = self.change_of(tenant, floor=5)
        response = self.client.get(reverse("admin:tenants_tenant_revert", args=[tenant.pk, change]))
        self.assertEqual(response.status_code, 405)
        self.assertEqual(Tenant.objects.get(pk=tenant.pk).floor, 5)
        wrong_object = self.revert("tenant", tenant.pk + 1000, change)
        self.assertEqual(wrong_object.status_code, 404)
