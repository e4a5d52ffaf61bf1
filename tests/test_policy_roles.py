"""The operator roles (groups made by a migration), enforced on every admin view and action:
each role posts every kind of change and is refused what it may not do."""

from __future__ import annotations

from typing import Any

import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client
from django.urls import reverse

from tenants import keys
from tenants.models import LatencyClass, PoolSettings, Resource, Shard, SubTenant, Tenant
from tests.base import RedisTestCase
from tests.test_tenants_admin import tenant_form

VIEWER, EDITOR, KEY_MANAGER = "policy viewer", "policy editor", "key manager"
MODELS = ["tenant", "subtenant", "shard", "latencyclass", "resource", "poolsettings"]


class RolesTestCase(RedisTestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.users = {}
        for role in (VIEWER, EDITOR, KEY_MANAGER):
            user = get_user_model().objects.create_user(
                role.replace(" ", "-"), password="pw-not-used-123", is_staff=True
            )
            user.groups.add(Group.objects.get(name=role))
            cls.users[role] = user

    def setUp(self) -> None:
        super().setUp()
        self.redis = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
        with self.captureOnCommitCallbacks(execute=True):
            self.tenant = Tenant.objects.create(slug="acme", name="Acme", shard=Shard.objects.get(name="default"))
            self.raw_key = self.tenant.rotate_api_key()
            self.tenant.save()
            self.sub = SubTenant.objects.create(tenant=self.tenant, external_id="h1", max_concurrency=2)
            self.resource = Resource.objects.create(name="llm-a", limit=10)
        self.rows = {
            "tenant": self.tenant,
            "subtenant": self.sub,
            "shard": Shard.objects.get(name="default"),
            "latencyclass": LatencyClass.objects.get(name="high"),
            "resource": self.resource,
            "poolsettings": PoolSettings.load(),
        }

    def as_role(self, role: str) -> Client:
        client = Client()
        client.force_login(self.users[role])
        return client

    def change_data(self) -> dict[str, dict[str, Any]]:
        """A valid change of each model (what an editor's save posts)."""
        return {
            "tenant": tenant_form(floor="5"),
            "subtenant": {"tenant": self.tenant.pk, "external_id": "h1", "max_concurrency": "3"},
            "shard": {"name": "default", "capacity": "80"},
            "latencyclass": {"name": "high", "rank": "30", "objective_seconds": "240"},
            "resource": {
                "name": "llm-a",
                "limit": "4",
                "decrease_factor": "0.5",
                "increase_per_success": "0.2",
                "recovery_seconds": "10",
            },
            "poolsettings": {
                "target_utilisation": "0.9",
                "f_min": "0.25",
                "f_max": "2.0",
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
            },
        }

    def post(self, client: Client, url: str, data: dict[str, Any] | None = None) -> Any:
        with self.captureOnCommitCallbacks(execute=True):
            return client.post(url, data or {})

    def saved_values(self) -> dict[str, Any]:
        return {
            name: {
                f.name: getattr(type(row).objects.get(pk=row.pk), f.attname) for f in type(row)._meta.concrete_fields
            }
            for name, row in self.rows.items()
        }

    def action(self, client: Client, action: str, **extra: Any) -> Any:
        data = {"action": action, "_selected_action": [self.tenant.pk], **extra}
        return self.post(client, reverse("admin:tenants_tenant_changelist"), data)

    def a_change_to_revert(self) -> str:
        """A change of the tenant's floor (2 -> 7), made by the test; its revert URL."""
        tenant = Tenant.objects.get(pk=self.tenant.pk)
        tenant.floor = 7
        with self.captureOnCommitCallbacks(execute=True):
            tenant.save()
        change = Tenant.history.filter(id=tenant.pk).latest("history_date").history_id  # type: ignore[attr-defined]
        return reverse("admin:tenants_tenant_revert", args=[tenant.pk, change])


class GroupTests(RolesTestCase):
    def test_the_migration_made_the_three_roles(self) -> None:
        perms = {
            g.name: {f"{p.content_type.app_label}.{p.codename}" for p in g.permissions.all()}
            for g in Group.objects.all()
        }
        self.assertIn("tenants.view_tenant", perms[VIEWER])
        self.assertIn("tenants.view_policychange", perms[VIEWER])
        self.assertFalse({p for p in perms[VIEWER] if not p.split(".")[1].startswith("view_")})
        self.assertLessEqual({f"tenants.{v}_{m}" for m in MODELS for v in ("add", "change", "delete")}, perms[EDITOR])
        self.assertNotIn("tenants.rotate_keys", perms[EDITOR])
        self.assertEqual(
            perms[KEY_MANAGER], {"tenants.view_tenant", "tenants.rotate_keys", "tenants.view_policychange"}
        )


class ViewerTests(RolesTestCase):
    def test_sees_every_policy_page_the_timeline_and_the_dashboard(self) -> None:
        viewer = self.as_role(VIEWER)
        for name, row in self.rows.items():
            with self.subTest(model=name):
                self.assertEqual(viewer.get(reverse(f"admin:tenants_{name}_changelist"), follow=True).status_code, 200)
                self.assertEqual(viewer.get(reverse(f"admin:tenants_{name}_change", args=[row.pk])).status_code, 200)
                self.assertEqual(viewer.get(reverse(f"admin:tenants_{name}_history", args=[row.pk])).status_code, 200)
        self.assertEqual(viewer.get(reverse("admin:tenants_policychange_changelist")).status_code, 200)
        self.assertEqual(viewer.get(reverse("dashboard")).status_code, 200)

    def test_changes_nothing_whatever_it_posts(self) -> None:
        viewer = self.as_role(VIEWER)
        revert_url = self.a_change_to_revert()
        before = self.saved_values()
        version = self.redis.get(keys.VERSION_KEY)
        with self.assertLogs("django.request", "WARNING"):
            for name, data in self.change_data().items():
                row = self.rows[name]
                with self.subTest(model=name, view="change"):
                    response = self.post(viewer, reverse(f"admin:tenants_{name}_change", args=[row.pk]), data)
                    self.assertEqual(response.status_code, 403)
                with self.subTest(model=name, view="add"):
                    self.assertEqual(self.post(viewer, reverse(f"admin:tenants_{name}_add"), data).status_code, 403)
                with self.subTest(model=name, view="delete"):
                    url = reverse(f"admin:tenants_{name}_delete", args=[row.pk])
                    self.assertEqual(self.post(viewer, url, {"post": "yes"}).status_code, 403)
            self.assertEqual(self.post(viewer, revert_url).status_code, 403)
        for action in ("activate", "deactivate", "rotate_api_keys", "rotate_webhook_secrets", "delete_selected"):
            with self.subTest(action=action):
                self.action(viewer, action, confirm="yes", post="yes")
        self.assertEqual(self.saved_values(), before)
        self.assertTrue(Tenant.objects.get(pk=self.tenant.pk).check_api_key(self.raw_key))
        self.assertEqual(self.redis.get(keys.VERSION_KEY), version, "no policy write reached Redis")

    def test_may_preview_a_change_without_saving_it(self) -> None:
        viewer = self.as_role(VIEWER)
        url = reverse("admin:tenants_tenant_change", args=[self.tenant.pk])
        page = viewer.get(url).content.decode()
        self.assertIn('name="_whatif"', page)
        self.assertNotIn('name="_save"', page)
        self.assertIn('name="floor"', page, "the form is editable, for the preview")
        preview = self.post(viewer, url, tenant_form(floor="9", _whatif="Preview", _whatif_hours="1"))
        self.assertEqual(preview.status_code, 200)
        self.assertContains(preview, "nothing to replay")  # the replay ran (this shard has no finished job)
        self.assertEqual(Tenant.objects.get(pk=self.tenant.pk).floor, 2)
        pool_url = reverse("admin:tenants_poolsettings_change", args=[1])
        data = {**self.change_data()["poolsettings"], "_whatif": "Preview", "_whatif_hours": "1"}
        self.assertContains(self.post(viewer, pool_url, data), "nothing to replay")
        self.assertEqual(PoolSettings.load().f_max, 4.0)
        with self.assertLogs("django.request", "WARNING"):
            saved = self.post(viewer, url, tenant_form(floor="9", _continue="Save and continue editing"))
        self.assertEqual(saved.status_code, 403)

    def test_a_member_who_is_not_staff_gets_no_admin(self) -> None:
        user = get_user_model().objects.create_user("outsider", password="pw-not-used-123")
        user.groups.add(Group.objects.get(name=VIEWER))
        client = Client()
        client.force_login(user)
        response = client.get(reverse("admin:tenants_tenant_changelist"))
        self.assertEqual(response.status_code, 302)
        self.assertIn(reverse("admin:login"), response["Location"])


class EditorTests(RolesTestCase):
    def test_changes_adds_deletes_and_reverts_policy(self) -> None:
        editor = self.as_role(EDITOR)
        for name, data in self.change_data().items():
            with self.subTest(model=name):
                response = self.post(editor, reverse(f"admin:tenants_{name}_change", args=[self.rows[name].pk]), data)
                self.assertEqual(response.status_code, 302, response.content[:3000])
        self.assertEqual(self.redis.hget(keys.shard_key("default"), "capacity"), "80")
        self.assertEqual(Tenant.objects.get(pk=self.tenant.pk).floor, 5)
        record = Tenant.history.filter(id=self.tenant.pk).latest("history_date")  # type: ignore[attr-defined]
        self.assertEqual(record.history_user, self.users[EDITOR])
        self.assertEqual(self.post(editor, self.a_change_to_revert()).status_code, 302)
        self.assertEqual(Tenant.objects.get(pk=self.tenant.pk).floor, 5)
        added = self.post(editor, reverse("admin:tenants_shard_add"), {"name": "east", "capacity": "10"})
        self.assertEqual(added.status_code, 302)
        deleted = self.post(
            editor, reverse("admin:tenants_shard_delete", args=[Shard.objects.get(name="east").pk]), {"post": "yes"}
        )
        self.assertEqual(deleted.status_code, 302)
        self.assertFalse(Shard.objects.filter(name="east").exists())

    def test_may_not_rotate_keys(self) -> None:
        editor = self.as_role(EDITOR)
        for action in ("rotate_api_keys", "rotate_webhook_secrets"):
            with self.subTest(action=action):
                response = self.action(editor, action, confirm="yes")
                self.assertNotContains(response, "fq_", status_code=response.status_code)
        tenant = Tenant.objects.get(pk=self.tenant.pk)
        self.assertTrue(tenant.check_api_key(self.raw_key))
        self.assertEqual(tenant.webhook_secret, "")


class KeyManagerTests(RolesTestCase):
    def test_rotates_api_keys_and_webhook_secrets(self) -> None:
        manager = self.as_role(KEY_MANAGER)
        confirm = self.action(manager, "rotate_api_keys")
        self.assertContains(confirm, "Rotate API keys?")
        rotated = self.action(manager, "rotate_api_keys", confirm="yes")
        self.assertEqual(rotated.status_code, 200)
        self.assertFalse(Tenant.objects.get(pk=self.tenant.pk).check_api_key(self.raw_key))
        secrets = self.action(manager, "rotate_webhook_secrets")
        self.assertContains(secrets, "whsec_")
        record = Tenant.history.filter(id=self.tenant.pk).latest("history_date")  # type: ignore[attr-defined]
        self.assertEqual(record.history_user, self.users[KEY_MANAGER])

    def test_changes_no_policy(self) -> None:
        manager = self.as_role(KEY_MANAGER)
        revert_url = self.a_change_to_revert()
        before = self.saved_values()
        with self.assertLogs("django.request", "WARNING"):
            for name, data in self.change_data().items():
                with self.subTest(model=name):
                    url = reverse(f"admin:tenants_{name}_change", args=[self.rows[name].pk])
                    self.assertEqual(self.post(manager, url, data).status_code, 403)
            self.assertEqual(
                self.post(manager, reverse("admin:tenants_tenant_add"), tenant_form(slug="new")).status_code, 403
            )
            self.assertEqual(self.post(manager, revert_url).status_code, 403)
            self.assertEqual(manager.get(reverse("admin:tenants_shard_changelist")).status_code, 403)
        for action in ("activate", "deactivate", "delete_selected"):
            self.action(manager, action, post="yes")
        self.assertEqual(self.saved_values(), before)

    def test_the_timeline_shows_it_only_what_it_may_see(self) -> None:
        manager = self.as_role(KEY_MANAGER)
        page = manager.get(reverse("admin:tenants_policychange_changelist")).content.decode()
        self.assertIn(">acme</a>", page)
        self.assertNotIn("History starts", page, "shards and classes are not its to see")
        self.assertIn('value="tenant"', page)
        self.assertNotIn('value="shard"', page)
        self.assertNotIn('class="fq-revert"', page)
