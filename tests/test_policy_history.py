"""Policy history: every change of a policy row with who, when, from where, why and
old -> new; no secret in it; kept after a delete; the admin's pages; the dashboard's markers."""

from __future__ import annotations

import json
from typing import Any

import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import RequestFactory
from django.urls import reverse
from simple_history.models import HistoricalRecords

from dashboard.snapshot import snapshot_build
from tenants import keys
from tenants.changes import ChangeFilter, changes_page
from tenants.history import Source, change_source
from tenants.models import LatencyClass, PoolSettings, Resource, Shard, SubTenant, Tenant
from tests.base import RedisTestCase
from tests.test_tenants_admin import tenant_form, with_sub_tenants

HISTORY_TABLES = [
    "tenants_historicaltenant",
    "tenants_historicalsubtenant",
    "tenants_historicalshard",
    "tenants_historicallatencyclass",
    "tenants_historicalresource",
    "tenants_historicalpoolsettings",
]


class HistoryTestCase(RedisTestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.boss = get_user_model().objects.create_superuser("boss", "boss@example.com", "pw-not-used-123")

    def setUp(self) -> None:
        super().setUp()
        self.redis = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
        self.client.force_login(self.boss)

    def make_tenant(self, slug: str = "acme", **fields: Any) -> Tenant:
        fields.setdefault("shard", Shard.objects.get(name="default"))
        with self.captureOnCommitCallbacks(execute=True):
            return Tenant.objects.create(slug=slug, name=slug.title(), **fields)

    def post_change(self, tenant: Tenant, **overrides: Any) -> Any:
        with self.captureOnCommitCallbacks(execute=True):
            return self.client.post(
                reverse("admin:tenants_tenant_change", args=[tenant.pk]), tenant_form(slug=tenant.slug, **overrides)
            )

    def latest(self, tenant: Tenant) -> Any:
        return Tenant.history.filter(id=tenant.pk).order_by("-history_date").first()  # type: ignore[attr-defined]


class RecordedChangeTests(HistoryTestCase):
    def test_an_admin_edit_records_who_when_source_reason_and_each_old_and_new_value(self) -> None:
        tenant = self.make_tenant(floor=2)
        response = self.post_change(tenant, floor="8", burst_pct="0.75", change_reason="Black Friday ramp-up")
        self.assertEqual(response.status_code, 302)
        record = self.latest(tenant)
        self.assertEqual(record.history_type, "~")
        self.assertEqual(record.history_user, self.boss)
        self.assertEqual(record.history_source, Source.ADMIN)
        self.assertEqual(record.history_change_reason, "Black Friday ramp-up")
        entries, _ = changes_page(ChangeFilter(models=("tenant",), object_pk=tenant.pk))
        changes = {c.name: (c.old_text, c.new_text) for c in entries[0].changes}
        self.assertEqual(changes, {"floor": ("2", "8"), "burst_pct": ("0.5", "0.75")})
        self.assertEqual(entries[0].summary(), "tenant acme changed: floor: 2 → 8; burst pct: 0.5 → 0.75")
        self.assertEqual(entries[1].kind, "created")
        self.assertEqual(entries[1].source, "command")  # made by this test's ORM call, outside a request

    def test_a_shard_move_is_shown_by_names_and_a_cleared_max_as_none(self) -> None:
        tenant = self.make_tenant(max_concurrency=10)
        east = Shard.objects.create(name="east", capacity=40)
        self.post_change(tenant, shard=str(east.pk), max_concurrency="")
        entries, _ = changes_page(ChangeFilter(models=("tenant",), object_pk=tenant.pk))
        self.assertEqual([str(c) for c in entries[0].changes], ["shard: default → east", "max concurrency: 10 → none"])

    def test_sub_tenants_changed_in_the_tenant_page_share_its_reason_and_show_in_its_history(self) -> None:
        tenant = self.make_tenant()
        data = with_sub_tenants(tenant_form(change_reason="clinic 9 signed"), [("clinic-9", 4)])
        with self.captureOnCommitCallbacks(execute=True):
            self.client.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]), data)
        sub = SubTenant.history.get()  # type: ignore[attr-defined]
        self.assertEqual((sub.external_id, sub.max_concurrency), ("clinic-9", 4))
        self.assertEqual(
            (sub.history_change_reason, sub.history_user, sub.history_source), ("clinic 9 signed", self.boss, "admin")
        )
        page = self.client.get(reverse("admin:tenants_tenant_history", args=[tenant.pk]))
        self.assertContains(page, "acme/clinic-9")
        self.assertContains(page, "clinic 9 signed")

    def test_every_policy_model_keeps_its_changes(self) -> None:
        cases = [
            (Shard.objects.get(name="default"), "capacity", 80),
            (LatencyClass.objects.get(name="high"), "objective_seconds", 240),
            (Resource.objects.create(name="llm-a", limit=10), "limit", 4),
            (PoolSettings.load(), "f_max", 2.0),
            (
                SubTenant.objects.create(tenant=self.make_tenant(), external_id="h1", max_concurrency=2),
                "max_concurrency",
                3,
            ),
        ]
        for row, field, value in cases:
            with self.subTest(model=type(row).__name__):
                before = getattr(row, field)
                setattr(row, field, value)
                row._change_reason = f"set {field}"  # type: ignore[attr-defined]
                row.save()
                record = type(row).history.filter(id=row.pk).order_by("-history_date").first()  # type: ignore[attr-defined]
                self.assertEqual(record.history_change_reason, f"set {field}")
                self.assertEqual(getattr(record.prev_record, field), before)
                self.assertEqual(getattr(record, field), value)

    def test_the_reason_belongs_to_one_save(self) -> None:
        tenant = self.make_tenant()
        tenant.floor = 3
        tenant._change_reason = "first"  # type: ignore[attr-defined]
        tenant.save()
        tenant.floor = 4
        tenant.save()
        self.assertIsNone(self.latest(tenant).history_change_reason)

    def test_the_source_of_a_policy_file_and_of_a_request_outside_the_admin(self) -> None:
        tenant = self.make_tenant()
        with change_source(Source.FILE):
            tenant.floor = 5
            tenant.save()
        self.assertEqual(self.latest(tenant).history_source, "file")
        tenant.floor = 6
        tenant.save()
        self.assertEqual(self.latest(tenant).history_source, "command")
        # Saved while serving an HTTP request outside the admin (what the history middleware
        # records): a REST call, by the request's user.
        request = RequestFactory().post("/hooks/policy")
        request.user = self.boss
        HistoricalRecords.context.request = request
        try:
            tenant.floor = 7
            tenant.save()
        finally:
            del HistoricalRecords.context.request
        self.assertEqual((self.latest(tenant).history_source, self.latest(tenant).history_user), ("rest", self.boss))

    def test_history_started_with_the_policy_the_migrations_left(self) -> None:
        for name in ("critical", "high", "default", "low"):
            record = LatencyClass.history.get(name=name)  # type: ignore[attr-defined]
            self.assertEqual((record.history_type, record.history_source), ("+", "migration"))
        self.assertEqual(Shard.history.get(name="default").history_source, "migration")  # type: ignore[attr-defined]

    def test_a_deleted_tenant_keeps_its_history_and_its_page_shows_it(self) -> None:
        tenant = self.make_tenant(floor=3)
        pk = tenant.pk
        self.post_change(tenant, floor="5")
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(reverse("admin:tenants_tenant_delete", args=[pk]), {"post": "yes"})
        self.assertEqual(response.status_code, 302)
        self.assertFalse(Tenant.objects.filter(pk=pk).exists())
        kinds = list(Tenant.history.filter(id=pk).order_by("history_date").values_list("history_type", "floor"))  # type: ignore[attr-defined]
        self.assertEqual(kinds, [("+", 3), ("~", 5), ("-", 5)])
        page = self.client.get(reverse("admin:tenants_tenant_history", args=[pk]))
        self.assertEqual(page.status_code, 200)
        self.assertContains(page, "History: #")
        self.assertContains(page, "<strong>deleted</strong>", html=True)


class SecretTests(HistoryTestCase):
    def test_no_key_hash_and_no_webhook_secret_are_stored_in_history(self) -> None:
        for table in HISTORY_TABLES:
            with connection.cursor() as cursor:
                columns = {c.name for c in connection.introspection.get_table_description(cursor, table)}
            self.assertFalse({"api_key_hash", "webhook_secret"} & columns, table)
        tenant = self.make_tenant()
        raw_key = tenant.rotate_api_key()
        secret = tenant.rotate_webhook_secret()
        tenant.save()
        dumped = json.dumps(list(Tenant.history.values()), default=str)  # type: ignore[attr-defined]
        for leaked in (raw_key, secret, tenant.api_key_hash):
            self.assertNotIn(leaked, dumped)
        self.assertIn(tenant.api_key_prefix, dumped, "a rotation shows as its new prefix")

    def test_rotating_a_key_in_the_admin_is_in_the_history_without_the_key(self) -> None:
        tenant = self.make_tenant()
        url = reverse("admin:tenants_tenant_changelist")
        response = self.client.post(
            url, {"action": "rotate_api_keys", "_selected_action": [tenant.pk], "confirm": "yes"}
        )
        self.assertEqual(response.status_code, 200)
        tenant.refresh_from_db()
        entries, _ = changes_page(ChangeFilter(models=("tenant",), object_pk=tenant.pk))
        self.assertEqual(entries[0].user, "boss")
        self.assertIn(f"api key prefix: none → {tenant.api_key_prefix}", entries[0].summary())
        page = self.client.get(reverse("admin:tenants_policychange_changelist")).content.decode()
        self.assertNotIn(tenant.api_key_hash, page)
        rotation = reverse("admin:tenants_tenant_revert", args=[tenant.pk, entries[0].history_id])
        self.assertNotIn(rotation, page, "a rotation has no Revert button: nothing an operator sets changed")
        creation = reverse("admin:tenants_tenant_revert", args=[tenant.pk, entries[1].history_id])
        self.assertNotIn(creation, page)


class TimelineTests(HistoryTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.other = get_user_model().objects.create_superuser("night-owl", "owl@example.com", "pw-not-used-123")
        self.acme, self.beta = self.make_tenant("acme"), self.make_tenant("beta")
        self.post_change(self.acme, floor="4", change_reason="acme grows")
        self.client.force_login(self.other)
        self.post_change(self.beta, floor="6", change_reason="beta at 3 a.m.")
        with self.captureOnCommitCallbacks(execute=True):
            self.client.post(
                reverse("admin:tenants_shard_change", args=[Shard.objects.get(name="default").pk]),
                {"name": "default", "capacity": "90", "change_reason": "bigger database"},
            )

    def timeline(self, **params: Any) -> str:
        response = self.client.get(reverse("admin:tenants_policychange_changelist"), params)
        self.assertEqual(response.status_code, 200)
        return response.content.decode()

    def test_one_timeline_of_every_model_newest_first(self) -> None:
        page = self.timeline()
        positions = [page.index(text) for text in ("bigger database", "beta at 3 a.m.", "acme grows")]
        self.assertEqual(positions, sorted(positions))
        self.assertIn("History starts", page)  # the migrations' baseline, at the end

    def test_filtered_by_user_by_object_and_by_source(self) -> None:
        by_owl = self.timeline(user=self.other.pk)
        self.assertIn("beta at 3 a.m.", by_owl)
        self.assertIn("bigger database", by_owl)
        self.assertNotIn("acme grows", by_owl)
        acme_only = self.timeline(model="tenant", object=self.acme.pk)
        self.assertIn("acme grows", acme_only)
        self.assertNotIn("beta at 3 a.m.", acme_only)
        self.assertNotIn("bigger database", acme_only)
        shards = self.timeline(model="shard")
        self.assertIn("bigger database", shards)
        self.assertNotIn("acme grows", shards)
        migrations = self.timeline(source="migration")
        self.assertIn("History starts", migrations)
        self.assertNotIn("acme grows", migrations)

    def test_each_object_page_links_its_history(self) -> None:
        change = self.client.get(reverse("admin:tenants_tenant_change", args=[self.acme.pk]))
        history_url = reverse("admin:tenants_tenant_history", args=[self.acme.pk])
        self.assertContains(change, history_url)
        page = self.client.get(history_url)
        self.assertContains(page, "acme grows")
        self.assertContains(page, "<td>boss</td>", html=True)
        self.assertNotContains(page, "beta at 3 a.m.")

    def test_pages_of_the_timeline(self) -> None:
        for floor in range(10, 70):
            self.acme.floor = floor % 50 + 1
            self.acme.save()
        first = self.timeline()
        self.assertIn("older →", first)
        self.assertNotIn("History starts", first)
        second = self.timeline(p=1)  # the 71 changes: 50, then 21 ending with the baseline
        self.assertIn("← newer", second)
        self.assertNotIn("older →", second)
        self.assertIn("History starts", second)

    def test_bulk_activation_is_recorded_per_tenant(self) -> None:
        with self.captureOnCommitCallbacks(execute=True):
            self.client.post(
                reverse("admin:tenants_tenant_changelist"),
                {"action": "deactivate", "_selected_action": [self.acme.pk, self.beta.pk]},
            )
        for tenant in (self.acme, self.beta):
            record = self.latest(tenant)
            self.assertEqual((record.active, record.history_user, record.history_source), (False, self.other, "admin"))
            self.assertIn("Deactivated", record.history_change_reason)
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "active"), "0")


class MarkerTests(HistoryTestCase):
    def test_a_committed_change_becomes_a_marker_in_the_dashboard_snapshot(self) -> None:
        tenant = self.make_tenant()
        self.post_change(tenant, floor="9", change_reason="more")
        markers = snapshot_build(with_history=False)["policy_changes"]
        self.assertEqual([m["text"] for m in markers], ["tenant acme created", "tenant acme changed: floor: 2 → 9"])
        self.assertEqual((markers[-1]["user"], markers[-1]["source"]), ("boss", "admin"))
        self.assertLessEqual(markers[0]["ts"], markers[1]["ts"])

    def test_a_rolled_back_change_leaves_no_marker(self) -> None:
        with self.captureOnCommitCallbacks(execute=False):
            Tenant.objects.create(slug="ghost", name="Ghost", shard=Shard.objects.get(name="default"))
        self.assertEqual(snapshot_build(with_history=False)["policy_changes"], [])
