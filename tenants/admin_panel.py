"""The panel under the tenant and pool settings change forms: the live state in words, and
the what-if preview of the form's unsaved values (tenants.whatif) beside it.

A preview is a POST of the change form with the Preview button: the form is validated as
for a save (bad input: its errors, as always), then the page comes back with the
operator's values still in it, unsaved, and the comparison in the panel.

A user who may view the row but not change it (the policy viewer role) may preview too:
the form is editable for that but has no Save button, and any POST but a preview is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.utils.safestring import SafeString

from tenants.charts import lines_chart
from tenants.models import PoolSettings, Shard, Tenant
from tenants.selectors import tenant_live_state
from tenants.whatif import (
    DEFAULT_HOURS,
    WhatIfComparison,
    WhatIfError,
    WhatIfRequest,
    hours_parse,
    policy_changes,
    policy_from_database,
    whatif_run,
)

PREVIEW_BUTTON = "_whatif"
HOURS_FIELD = "_whatif_hours"
SHARD_FIELD = "_whatif_shard"
# The admin runs the replay inside the request: a day of a busy shard takes about a minute.
MAX_ADMIN_HOURS = 24.0
CURRENT_COLOUR, PROPOSED_COLOUR = "#417690", "#d9730d"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:,.2f} s"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


@dataclass
class WhatIfPanel:
    """What the template shows in the preview column."""

    hours: str = str(DEFAULT_HOURS)
    shard: str = ""
    shards: list[str] = field(default_factory=list)  # a choice (pool settings), else empty
    error: str = ""
    comparison: WhatIfComparison | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    chart: SafeString | None = None


def _rows(c: WhatIfComparison) -> list[dict[str, Any]]:
    rows = []
    for slug in c.tenants():
        now, new = c.current.waits.get(slug), c.proposed.waits.get(slug)
        either = now or new
        rows.append(
            {
                "tenant": slug,
                "jobs": f"{either.jobs:,}" if either else "0",
                "p50_now": _seconds(now.p50 if now else None),
                "p50_new": _seconds(new.p50 if new else None),
                "p99_now": _seconds(now.p99 if now else None),
                "p99_new": _seconds(new.p99 if new else None),
                # A P99 that gets worse by more than a tenth is worth the operator's eye.
                "worse": bool(now and new and now.p99 is not None and new.p99 is not None and new.p99 > now.p99 * 1.1),
            }
        )
    rows.append(
        {
            "tenant": "pool use (while jobs waited)",
            "jobs": "",
            "p50_now": f"{_share(c.current.utilisation)} ({_share(c.current.backlog_utilisation)})",
            "p50_new": f"{_share(c.proposed.utilisation)} ({_share(c.proposed.backlog_utilisation)})",
            "p99_now": f"peak {c.current.peak_waiting:,} waiting",
            "p99_new": f"peak {c.proposed.peak_waiting:,} waiting",
            "worse": False,
        }
    )
    return rows


def _chart(c: WhatIfComparison) -> SafeString:
    t = c.current.series_t if len(c.current.series_t) >= len(c.proposed.series_t) else c.proposed.series_t

    def padded(values: list[int]) -> list[float]:
        return [float(v) for v in values] + [0.0] * (len(t) - len(values))

    return lines_chart(
        t,
        [
            ("current", CURRENT_COLOUR, padded(c.current.series_waiting)),
            ("proposed", PROPOSED_COLOUR, padded(c.proposed.series_waiting)),
        ],
        title="jobs waiting (most at once, per interval)",
    )


def panel_run(panel: WhatIfPanel, request: WhatIfRequest) -> None:
    """Run the replay and fill the panel, or say why it cannot run."""
    try:
        comparison = whatif_run(request)
    except WhatIfError as exc:
        panel.error = str(exc)
        return
    panel.comparison = comparison
    panel.rows = _rows(comparison)
    panel.chart = _chart(comparison)


def _dict_words(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items()) or "none"


def live_state_lines(tenant: Tenant) -> list[tuple[str, str]]:
    """tenants.selectors.tenant_live_state, as sentences."""
    state = dict(tenant_live_state(tenant=tenant))
    lines: list[tuple[str, str]] = []
    if "Redis" in state:
        return [("Redis", str(state["Redis"]))]
    synced = state.pop("Synced policy", None)
    match = state.pop("Matches database", "")
    key = state.pop("Policy key", "")
    version, overall = state.pop("Tenant policy version", ""), state.pop("Global policy version", "")
    sync_text = f"{key} holds version {version or '-'} (the policy is at {overall}); matches the database: {match}"
    lines.append(("Policy in Redis", sync_text))
    if isinstance(synced, dict):
        hard_max = synced.get("max_concurrency") or "none"
        words = (
            f"floor {synced.get('floor')}, burst floor {synced.get('burst_floor')}, burst "
            f"{float(synced.get('burst_pct') or 0):.0%} of base, hard max {hard_max}, dedicated "
            f"{synced.get('dedicated')}, fan-out per job {synced.get('max_fan_out') or '-'}, "
            f"shard {synced.get('shard')}, sub-tenants capped at "
            f"{float(synced.get('sub_tenant_share') or 0):.0%} of the limit unless registered, batch lane "
            f"{'on' if synced.get('batch_enabled') == '1' else 'off'}, "
            f"{'active' if synced.get('active') == '1' else 'inactive'}"
        )
        lines.append(("Synced policy", words))
    subs = state.pop("Sub-tenant caps", "none")
    lines.append(
        ("Sub-tenants", ", ".join(f"{k} at most {v}" for k, v in subs.items()) if isinstance(subs, dict) else str(subs))
    )
    for label, value in state.items():
        lines.append((label, _dict_words(value) if isinstance(value, dict) else str(value)))
    return lines


def _preview_form(form_class: type[forms.ModelForm]) -> type[forms.ModelForm]:
    class PreviewForm(form_class):  # type: ignore[valid-type,misc]
        def is_valid(self) -> bool:
            # Django's change view saves a valid form. A preview validates it the same way
            # (its errors show as for a save), then reports it not valid, with no error
            # added: the page comes back with the operator's values, unsaved.
            self.fq_preview_ready = super().is_valid()
            return False

    PreviewForm.__name__ = f"Preview{form_class.__name__}"
    return PreviewForm


class WhatIfPreviewMixin(admin.ModelAdmin):  # type: ignore[type-arg]
    """The Preview button and the panel, for a change form of policy rows."""

    change_form_template = "admin/tenants/whatif_change_form.html"

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not super().has_change_permission(request) and self.has_view_permission(request):
            if request.method == "POST" and PREVIEW_BUTTON not in request.POST:
                raise PermissionDenied
            request._fq_preview_only = True  # type: ignore[attr-defined]
        return super().change_view(request, object_id, form_url, extra_context)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Inside change_view only: the form of a preview-only user is editable (a preview
        # never saves: its form is never valid to Django).
        return super().has_change_permission(request, obj) or getattr(request, "_fq_preview_only", False)

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        form = super().get_form(request, obj, change=change, **kwargs)
        if request.method == "POST" and PREVIEW_BUTTON in request.POST and obj is not None:
            return _preview_form(form)
        return form

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        if change and obj is not None:
            context["fq_live_state"] = self.live_state(obj)
            context["fq_whatif"] = self.whatif_panel(request, context["adminform"].form, obj)
        if getattr(request, "_fq_preview_only", False):
            context.update(show_save=False, show_save_and_continue=False, show_save_and_add_another=False)
        return super().render_change_form(request, context, add=add, change=change, form_url=form_url, obj=obj)

    def live_state(self, obj: Any) -> list[tuple[str, str]] | None:
        return None

    def whatif_shard(self, request: HttpRequest, obj: Any) -> tuple[str, list[str]]:
        raise NotImplementedError

    def whatif_proposed(self, form: forms.ModelForm) -> dict[str, Any]:
        raise NotImplementedError

    def whatif_panel(self, request: HttpRequest, form: forms.ModelForm, obj: Any) -> WhatIfPanel:
        shard, shards = self.whatif_shard(request, obj)
        panel = WhatIfPanel(shard=shard, shards=shards)
        if request.method != "POST" or PREVIEW_BUTTON not in request.POST:
            return panel
        panel.hours = str(request.POST.get(HOURS_FIELD, DEFAULT_HOURS))[:20]
        if not getattr(form, "fq_preview_ready", False):
            panel.error = "Correct the errors in the form to preview it."
            return panel
        try:
            hours = hours_parse(panel.hours)
            if hours > MAX_ADMIN_HOURS:
                raise WhatIfError(
                    f"The admin previews at most {MAX_ADMIN_HOURS:g} hours; "
                    f"use `manage.py whatif --shard {shard} --hours {hours:g}` for more."
                )
            if not shard:
                raise WhatIfError("There is no shard to replay.")
        except WhatIfError as exc:
            panel.error = str(exc)
            return panel
        current = policy_from_database()
        proposed = policy_from_database(**self.whatif_proposed(form))
        panel_run(
            panel,
            WhatIfRequest(
                shard=shard,
                hours=hours,
                current=current,
                proposed=proposed,
                changes=policy_changes(current, proposed),
            ),
        )
        return panel


class TenantWhatIfMixin(WhatIfPreviewMixin):
    def live_state(self, obj: Tenant) -> list[tuple[str, str]] | None:
        # The form may have changed the instance in memory (a preview): read the saved row.
        return live_state_lines(Tenant.objects.select_related("shard").get(pk=obj.pk))

    def whatif_shard(self, request: HttpRequest, obj: Tenant) -> tuple[str, list[str]]:
        saved = Tenant.objects.select_related("shard").get(pk=obj.pk)
        return saved.shard.name, []

    def whatif_proposed(self, form: forms.ModelForm) -> dict[str, Any]:
        return {"tenants": [form.instance]}


class PoolWhatIfMixin(WhatIfPreviewMixin):
    def whatif_shard(self, request: HttpRequest, obj: PoolSettings) -> tuple[str, list[str]]:
        shards = list(Shard.objects.order_by("name").values_list("name", flat=True))
        asked = str(request.POST.get(SHARD_FIELD, "")) if request.method == "POST" else ""
        return (asked if asked in shards else (shards[0] if shards else "")), shards

    def whatif_proposed(self, form: forms.ModelForm) -> dict[str, Any]:
        return {"pool": form.instance}
