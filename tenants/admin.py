"""Admin for tenant policy: validation with clear errors, key rotation; under the tenant and
pool settings forms, the live state in words and the what-if preview (tenants.admin_panel);
every policy model's history, the timeline of changes and their revert (tenants.admin_history).

Who may do what is Django's permissions (the roles are groups: tenants/migrations/0008_policy_roles.py):
view, add, change and delete per model, `tenants.rotate_keys` for the key rotations, and
`tenants.view_policychange` for the timeline. A user who may view a tenant or the pool
settings but not change them may still preview a change (the what-if), never save it."""

from __future__ import annotations

from typing import Any

import redis
from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db import transaction
from django.db.models import Count, QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from simple_history.utils import bulk_update_with_history

from tenants.admin_history import REASON_FIELD, REASON_FIELDSET, ChangeReasonForm, PolicyChangeAdmin, PolicyHistoryAdmin
from tenants.admin_panel import PoolWhatIfMixin, TenantWhatIfMixin
from tenants.change_markers import markers_push_on_commit
from tenants.changes import entries_build
from tenants.history import source_current
from tenants.models import LatencyClass, PolicyChange, PoolSettings, Resource, Shard, SubTenant, Tenant
from tenants.policy import ResourcePolicy
from tenants.resource_limits import resource_limits_read
from tenants.selectors import tenants_move_preview
from tenants.sync import tenant_policy_sync_on_commit
from webhooks.targets import TargetRefused, target_resolve

admin.site.register(PolicyChange, PolicyChangeAdmin)


class MoveConfirmingForm(ChangeReasonForm):
    """A form whose save may move or rename tenants with unfinished jobs: before such a
    save it says what the move will do to them and asks for the `confirm_move` box."""

    confirm_move = forms.BooleanField(
        required=False,
        label="Confirm move",
        help_text="Tick after reading what the move does to unfinished jobs (shown when saving would move any).",
    )

    def confirm_move_check(self, tenants: QuerySet[Tenant], change: str) -> None:
        if self.cleaned_data.get("confirm_move"):
            return
        preview = tenants_move_preview(tenants=tenants)
        if preview:
            raise forms.ValidationError(
                f"{change} {' '.join(preview)} Tick “Confirm move” and save again to go ahead.", code="confirm_move"
            )


# --- Shards and latency classes ----------------------------------------------------------


class ShardAdminForm(MoveConfirmingForm):
    class Meta:
        model = Shard
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean() or {}
        old, new = self.instance.name, data.get("name")
        if self.instance.pk is not None and new and new != old:
            self.confirm_move_check(Tenant.objects.filter(shard=self.instance), f"Renaming shard {old} to {new}:")
        return data


@admin.register(Shard)
class ShardAdmin(PolicyHistoryAdmin):
    form = ShardAdminForm
    list_display = ["name", "capacity", "tenant_count", "updated_at"]
    search_fields = ["name"]
    readonly_fields = ["updated_at"]
    fields = ["name", "capacity", "confirm_move", REASON_FIELD, "updated_at"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Shard]:
        return super().get_queryset(request).annotate(_tenant_count=Count("tenants"))

    @admin.display(description="tenants", ordering="_tenant_count")
    def tenant_count(self, obj: Shard) -> int:
        return getattr(obj, "_tenant_count", 0)


@admin.register(LatencyClass)
class LatencyClassAdmin(PolicyHistoryAdmin):
    form = ChangeReasonForm
    list_display = ["name", "rank", "objective_seconds", "objective", "updated_at"]
    search_fields = ["name"]
    readonly_fields = ["updated_at"]
    fields = ["name", "rank", "objective_seconds", REASON_FIELD, "updated_at"]

    @admin.display(description="objective")
    def objective(self, obj: LatencyClass) -> str:
        seconds = obj.objective_seconds
        for unit, size in (("h", 3600), ("min", 60)):
            if seconds >= size and seconds % size == 0:
                return f"{seconds // size} {unit}"
        return f"{seconds} s"

    def has_delete_permission(self, request: HttpRequest, obj: LatencyClass | None = None) -> bool:
        # Jobs without a class, and tenants without a default, fall back to "default".
        if obj is not None and obj.name == "default":
            return False
        return super().has_delete_permission(request, obj)


# --- Outside resources ------------------------------------------------------------------------


@admin.register(Resource)
class ResourceAdmin(PolicyHistoryAdmin):
    """Configured limits and AIMD parameters; the effective limit, live from Redis."""

    form = ChangeReasonForm
    list_display = ["name", "limit", "effective_limit", "decrease_factor", "increase_per_success", "recovery_seconds"]
    search_fields = ["name"]
    readonly_fields = ["effective_limit", "updated_at"]
    fieldsets = [
        (None, {"fields": ["name", "limit", "effective_limit"]}),
        (
            "Backing off (AIMD)",
            {
                "fields": ["decrease_factor", "increase_per_success", "recovery_seconds"],
                "description": "When a job's call is refused (the task raises fairqueue.Backoff), the effective "
                "limit is multiplied by the decrease factor; each success then adds its increase, once the "
                "recovery time has passed since the last cut. It stays between 1 and the configured limit.",
            },
        ),
        REASON_FIELDSET,
        ("History", {"fields": ["updated_at"], "classes": ["collapse"]}),
    ]

    @admin.display(description="effective limit")
    def effective_limit(self, obj: Resource) -> str:
        if obj.pk is None:
            return "-"
        policy = ResourcePolicy(
            name=obj.name,
            limit=obj.limit,
            decrease_factor=obj.decrease_factor,
            increase_per_success=obj.increase_per_success,
            recovery_seconds=obj.recovery_seconds,
            version=0,
        )
        try:
            state = resource_limits_read([policy])[obj.name]
        except redis.RedisError:
            return "unknown (Redis unreachable)"
        text = f"{state.limit} of {state.configured}"
        if state.paused:
            text += f" (paused for {(state.paused_until_ms - state.now_ms) / 1000:.1f} s)"
        elif state.effective < state.configured:
            text += f" (recovering: {state.effective:.2f})"
        return text


# --- Tenants and sub-tenants ----------------------------------------------------------------


class SubTenantInlineFormSet(BaseInlineFormSet):
    def clean(self) -> None:
        # Before super().clean(), whose unique check would only say "duplicate data".
        self._check_duplicate_ids()
        super().clean()

    def _check_duplicate_ids(self) -> None:
        seen: dict[str, int] = {}
        for index, form in enumerate(self.forms):
            if not hasattr(form, "cleaned_data") or not form.cleaned_data or form.cleaned_data.get("DELETE"):
                continue
            external_id = form.cleaned_data.get("external_id")
            if not external_id:
                continue
            if external_id in seen:
                message = f"Sub-tenant id '{external_id}' appears twice (rows {seen[external_id] + 1} and {index + 1})."
                form.add_error("external_id", message)
                raise forms.ValidationError(message)
            seen[external_id] = index


class SubTenantInline(admin.TabularInline):
    model = SubTenant
    formset = SubTenantInlineFormSet
    fields = ["external_id", "max_concurrency", "updated_at"]
    readonly_fields = ["updated_at"]
    extra = 0


class TenantAdminForm(MoveConfirmingForm):
    class Meta:
        model = Tenant
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean() or {}
        tenant = self.instance
        if tenant.pk is None:
            return data
        shard, slug = data.get("shard"), data.get("slug")
        changes = []
        if shard is not None and shard.pk != tenant.shard_id:
            changes.append(f"moving {tenant.slug} from shard {tenant.shard.name} to {shard.name}")
        if slug and slug != tenant.slug:
            changes.append(f"renaming {tenant.slug} to {slug}")
        if changes:
            self.confirm_move_check(Tenant.objects.filter(pk=tenant.pk), " and ".join(changes).capitalize() + ":")
        return data

    def clean_max_concurrency(self) -> int | None:
        value: int | None = self.cleaned_data.get("max_concurrency")
        if value == 0:
            raise forms.ValidationError(
                "A hard max of 0 would block every job; leave it empty for no max, or deactivate the tenant."
            )
        return value

    def clean_webhook_url(self) -> str:
        value: str = self.cleaned_data.get("webhook_url") or ""
        if value:
            try:
                target_resolve(value)
            except TargetRefused as exc:
                raise forms.ValidationError(str(exc)) from None
        return value

    def clean_burst_pct(self) -> float | None:
        value: float | None = self.cleaned_data.get("burst_pct")
        if value is not None and not 0.0 <= value <= 10.0:
            raise forms.ValidationError(f"Burst must be between 0 and 10 (a fraction of base: 0.5 = 50%), not {value}.")
        return value


@admin.register(Tenant)
class TenantAdmin(PolicyHistoryAdmin, TenantWhatIfMixin):
    form = TenantAdminForm
    inlines = [SubTenantInline]
    list_display = [
        "slug",
        "name",
        "active",
        "shard",
        "floor",
        "burst_floor",
        "burst_pct",
        "max_concurrency",
        "dedicated",
        "batch_enabled",
        "default_latency_class",
        "sub_tenant_count",
        "api_key_prefix",
    ]
    list_display_links = ["slug", "name"]
    list_filter = ["active", "batch_enabled", "shard", "default_latency_class"]
    search_fields = ["slug", "name", "api_key_prefix", "sub_tenants__external_id"]
    list_select_related = ["shard", "default_latency_class"]
    readonly_fields = ["api_key_prefix", "api_key_rotated_at", "webhook_secret_rotated_at", "created_at", "updated_at"]
    actions = ["rotate_api_keys", "rotate_webhook_secrets", "activate", "deactivate"]
    fieldsets = [
        (None, {"fields": ["slug", "name", "active", "shard", "confirm_move"]}),
        (
            "Concurrency",
            {
                "fields": [
                    "floor",
                    "burst_floor",
                    "burst_pct",
                    "max_concurrency",
                    "dedicated",
                    "sub_tenant_share",
                    "max_fan_out",
                ],
                "description": "limit = min(max(ceiling x pool pressure, floor), hard max) + dedicated, "
                "where ceiling = base + max(burst floor, base x burst).",
            },
        ),
        ("Scheduling", {"fields": ["default_latency_class", "batch_enabled"]}),
        (
            "Quotas",
            {
                "fields": ["backlog_quota", "batch_backlog_quota", "submit_rate"],
                "description": "Past these a submit answers 429 with a Retry-After; empty takes the pool's default.",
            },
        ),
        (
            "API key",
            {
                "fields": ["api_key_prefix", "api_key_rotated_at"],
                "description": "Only a hash is stored. Use the “Rotate API key” action to issue a new key.",
            },
        ),
        (
            "Webhooks",
            {
                "fields": ["webhook_url", "webhook_secret_rotated_at"],
                "description": "Finished jobs are POSTed here as signed events (a job may name its own URL). "
                "The signing secret is issued when a URL is first set, shown once; "
                "use the “Rotate webhook secret” action for a new one.",
            },
        ),
        REASON_FIELDSET,
        ("History", {"fields": ["created_at", "updated_at"], "classes": ["collapse"]}),
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Tenant]:
        return super().get_queryset(request).annotate(_sub_tenant_count=Count("sub_tenants"))

    def get_fieldsets(self, request: HttpRequest, obj: Tenant | None = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None:  # nothing to show before the tenant exists
            fieldsets = [fs for fs in fieldsets if fs[0] not in ("API key", "History")]
        return fieldsets

    @admin.display(description="sub-tenants", ordering="_sub_tenant_count")
    def sub_tenant_count(self, obj: Tenant) -> int:
        return getattr(obj, "_sub_tenant_count", 0)

    # A new tenant gets its key on creation; the add response shows it once instead of redirecting.
    def save_model(self, request: HttpRequest, obj: Tenant, form: forms.ModelForm, change: bool) -> None:
        if not change and not obj.api_key_hash:
            request._fq_new_keys = [(obj, obj.rotate_api_key())]  # type: ignore[attr-defined]
        if obj.webhook_url and not obj.webhook_secret:
            request._fq_new_webhook_secrets = [(obj, obj.rotate_webhook_secret())]  # type: ignore[attr-defined]
        super().save_model(request, obj, form, change)

    def response_change(self, request: HttpRequest, obj: Tenant) -> HttpResponse:
        new_secrets = getattr(request, "_fq_new_webhook_secrets", None)
        if new_secrets and "_popup" not in request.POST:
            return self._show_webhook_secrets(request, new_secrets, title="Webhook secret issued: copy it now")
        return super().response_change(request, obj)

    def revert_response(self, request: HttpRequest, obj: Tenant) -> HttpResponse | None:
        # A restored tenant gets a new key (and webhook secret), shown once, as on creation.
        new_keys = getattr(request, "_fq_new_keys", None)
        new_secrets = getattr(request, "_fq_new_webhook_secrets", None)
        if new_keys:
            title = "Tenant restored: copy its new API key now"
            return self._show_keys(request, new_keys, title=title, new_secrets=new_secrets)
        if new_secrets:
            return self._show_webhook_secrets(request, new_secrets, title="Webhook secret issued: copy it now")
        return None

    def response_add(self, request: HttpRequest, obj: Tenant, post_url_continue: str | None = None) -> HttpResponse:
        new_keys = getattr(request, "_fq_new_keys", None)
        new_secrets = getattr(request, "_fq_new_webhook_secrets", None)
        if new_keys and "_popup" not in request.POST:
            return self._show_keys(
                request, new_keys, title="Tenant created: copy its API key now", new_secrets=new_secrets
            )
        return super().response_add(request, obj, post_url_continue)

    def _show_keys(
        self,
        request: HttpRequest,
        new_keys: list[tuple[Tenant, str]],
        *,
        title: str,
        new_secrets: list[tuple[Tenant, str]] | None = None,
    ) -> HttpResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.model._meta,
            "new_keys": new_keys,
            "new_secrets": new_secrets or [],
            "changelist_url": reverse("admin:tenants_tenant_changelist"),
        }
        response = TemplateResponse(request, "admin/tenants/tenant/api_keys.html", context)
        # The raw key must not linger in any cache.
        response["Cache-Control"] = "no-store"
        return response

    def has_rotate_keys_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("tenants.rotate_keys"))

    @admin.action(description="Rotate API key (shows the new keys once)", permissions=["rotate_keys"])
    def rotate_api_keys(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> HttpResponse | None:
        if request.POST.get("confirm") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "title": "Rotate API keys?",
                "opts": self.model._meta,
                "tenants": list(queryset),
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(request, "admin/tenants/tenant/rotate_confirmation.html", context)
        new_keys = []
        for tenant in queryset:
            raw_key = tenant.rotate_api_key()
            tenant.save(update_fields=["api_key_prefix", "api_key_hash", "api_key_rotated_at", "updated_at"])
            new_keys.append((tenant, raw_key))
        if not new_keys:
            return None
        return self._show_keys(request, new_keys, title="New API keys: copy them now")

    def _show_webhook_secrets(
        self, request: HttpRequest, new_secrets: list[tuple[Tenant, str]], *, title: str
    ) -> HttpResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.model._meta,
            "new_secrets": new_secrets,
            "changelist_url": reverse("admin:tenants_tenant_changelist"),
        }
        response = TemplateResponse(request, "admin/tenants/tenant/webhook_secrets.html", context)
        response["Cache-Control"] = "no-store"  # the secret must not linger in any cache
        return response

    @admin.action(description="Rotate webhook secret (shows the new secrets once)", permissions=["rotate_keys"])
    def rotate_webhook_secrets(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> HttpResponse | None:
        new_secrets = []
        for tenant in queryset:
            secret = tenant.rotate_webhook_secret()
            tenant.save(update_fields=["webhook_secret", "webhook_secret_rotated_at", "updated_at"])
            new_secrets.append((tenant, secret))
        if not new_secrets:
            return None
        return self._show_webhook_secrets(request, new_secrets, title="New webhook secrets: copy them now")

    def _set_active(self, request: HttpRequest, queryset: QuerySet[Tenant], *, active: bool) -> None:
        with transaction.atomic():
            selected = Tenant.objects.select_for_update().filter(pk__in=queryset.values("pk"))
            changing = list(selected.exclude(active=active))
            for tenant in changing:
                tenant.active = active
            # One UPDATE and one history row per tenant; the bulk fires no signals: the
            # source, Redis and the dashboard's markers are seen to here.
            updated = bulk_update_with_history(
                changing,
                Tenant,
                ["active"],
                default_user=request.user,
                default_change_reason=f"{'Activated' if active else 'Deactivated'} from the tenant list",
                custom_historical_attrs={"history_source": source_current()},
            )
            tenant_policy_sync_on_commit(tenant_ids=[t.pk for t in changing])
            records = Tenant.history.filter(id__in=[t.pk for t in changing]).latest_of_each()  # type: ignore[attr-defined]
            markers_push_on_commit(entries_build([("tenant", r) for r in records]))
        verb = "Activated" if active else "Deactivated"
        self.message_user(request, f"{verb} {updated} tenant(s); Redis updated.", messages.SUCCESS)

    @admin.action(description="Activate selected tenants", permissions=["change"])
    def activate(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        self._set_active(request, queryset, active=True)

    @admin.action(description="Deactivate selected tenants", permissions=["change"])
    def deactivate(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        self._set_active(request, queryset, active=False)


@admin.register(SubTenant)
class SubTenantAdmin(PolicyHistoryAdmin):
    form = ChangeReasonForm
    list_display = ["external_id", "tenant", "max_concurrency", "updated_at"]
    list_filter = ["tenant"]
    search_fields = ["external_id", "tenant__slug", "tenant__name"]
    list_select_related = ["tenant"]
    autocomplete_fields = ["tenant"]
    readonly_fields = ["updated_at"]
    fields = ["tenant", "external_id", "max_concurrency", REASON_FIELD, "updated_at"]


# --- Pool settings (a single row) ------------------------------------------------------------


class PoolSettingsForm(ChangeReasonForm):
    class Meta:
        model = PoolSettings
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        cleaned: dict[str, Any] = super().clean() or {}
        f_min, f_max = cleaned.get("f_min"), cleaned.get("f_max")
        if f_min is not None and f_max is not None and f_min > f_max:
            self.add_error("f_min", f"f_min ({f_min}) must not exceed f_max ({f_max}).")
        return cleaned


@admin.register(PoolSettings)
class PoolSettingsAdmin(PolicyHistoryAdmin, PoolWhatIfMixin):
    form = PoolSettingsForm
    list_display = [
        "__str__",
        "target_utilisation",
        "f_min",
        "f_max",
        "rate_window_seconds",
        "default_job_seconds",
        "batch_objective_seconds",
        "floor_headroom",
        "quarantine_after_losses",
        "quarantine_slots",
        "updated_at",
    ]
    readonly_fields = ["updated_at"]
    fieldsets = [
        ("Pool pressure", {"fields": ["target_utilisation", "f_min", "f_max"]}),
        ("Rate estimate", {"fields": ["rate_window_seconds", "default_job_seconds"]}),
        ("Floors", {"fields": ["floor_headroom"]}),
        (
            "Quotas and memory",
            {"fields": ["backlog_quota", "batch_backlog_quota", "submit_rate", "submit_burst", "memory_guard_pct"]},
        ),
        ("Batch lane", {"fields": ["batch_objective_seconds"]}),
        ("Quarantine lane", {"fields": ["quarantine_after_losses", "quarantine_poison_losses", "quarantine_slots"]}),
        REASON_FIELDSET,
        (None, {"fields": ["updated_at"]}),
    ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return not PoolSettings.objects.exists() and super().has_add_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: PoolSettings | None = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # One row: go straight to it.
        pool = PoolSettings.objects.first()
        if pool is not None and self.has_view_or_change_permission(request, pool):
            return HttpResponseRedirect(reverse("admin:tenants_poolsettings_change", args=[pool.pk]))
        return super().changelist_view(request, extra_context)
