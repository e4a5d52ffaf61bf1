"""The admin's side of policy history (tenants.history, tenants.changes): a reason field on
every policy form, each object's history page and the timeline of all policy changes (who,
when, from where, why, field by field old -> new), and the revert of a change.

A revert is an edit: the values the change replaced go through the admin's own form of the
model (its validation, the move confirmation), are saved by the admin's save (so the
signals sync Redis on commit) and recorded as a change of their own, whose reason names the
change it reverts. Reverting a deletion restores the object (without its API key or webhook
secret, which history never holds: the restored tenant gets new ones, shown once). A revert
that would move unfinished jobs, or put back a value someone changed again since, asks
for confirmation first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.db import models, transaction
from django.forms.models import model_to_dict
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.formats import date_format

from tenants.changes import (
    POLICY_MODELS,
    ChangeEntry,
    ChangeFilter,
    FieldChange,
    Names,
    change_entry,
    changes_page,
    value_text,
)
from tenants.history import REASON_MAX_LENGTH, Source

REASON_FIELD = "change_reason"
CONFIRM_FIELD = "confirm"


class ChangeReasonForm(forms.ModelForm):
    """A policy form with the optional reason kept in history with the change."""

    change_reason = forms.CharField(
        required=False,
        max_length=REASON_MAX_LENGTH,
        label="Reason for this change",
        help_text="Optional; kept in the policy history with the change (Policy changes).",
        widget=forms.TextInput(attrs={"size": 80}),
    )


REASON_FIELDSET: tuple[str, Any] = ("Reason", {"fields": [REASON_FIELD]})


def _can(request: HttpRequest, action: str, model: type[models.Model]) -> bool:
    return bool(request.user.has_perm(f"{model._meta.app_label}.{action}_{model._meta.model_name}"))


def revert_url(entry: ChangeEntry) -> str:
    return reverse(f"admin:tenants_{entry.model_name}_revert", args=[entry.object_pk, entry.history_id])


def revertible(request: HttpRequest, entry: ChangeEntry) -> bool:
    """Whether this user may revert this change now (and it can be)."""
    if entry.kind == "changed":
        # A key rotation alone changed nothing an operator sets: no button for it.
        settable = any(entry.model._meta.get_field(c.name).editable for c in entry.changes)
        return settable and entry.exists and _can(request, "change", entry.model)
    if entry.kind == "deleted":
        return not entry.exists and _can(request, "add", entry.model)
    return False


@dataclass
class TimelineRow:
    entry: ChangeEntry
    revert_url: str | None
    object_url: str | None
    history_url: str


def _rows(request: HttpRequest, entries: list[ChangeEntry]) -> list[TimelineRow]:
    rows = []
    for e in entries:
        object_url = reverse(f"admin:tenants_{e.model_name}_change", args=[e.object_pk]) if e.exists else None
        rows.append(
            TimelineRow(
                entry=e,
                revert_url=revert_url(e) if revertible(request, e) else None,
                object_url=object_url,
                history_url=reverse(f"admin:tenants_{e.model_name}_history", args=[e.object_pk]),
            )
        )
    return rows


def _int(raw: str | None) -> int | None:
    try:
        return int(raw) if raw not in (None, "") else None
    except ValueError:
        return None


def timeline_response(
    request: HttpRequest,
    admin_site: admin.AdminSite,
    flt: ChangeFilter,
    *,
    title: str,
    opts: Any,
    subject: str = "",
    filters: bool = True,
) -> HttpResponse:
    """A page of changes, newest first, with the filters and the revert buttons."""
    page = max(_int(request.GET.get("p")) or 0, 0)
    entries, more = changes_page(flt, page=page)
    query = {k: v for k, v in request.GET.items() if k != "p"}
    users = get_user_model().objects.filter(is_staff=True).order_by("username") if filters else []
    context = {
        **admin_site.each_context(request),
        "title": title,
        "subject": subject,
        "opts": opts,
        "rows": _rows(request, entries),
        "page": page,
        "newer_url": f"?{urlencode({**query, 'p': page - 1})}" if page > 0 else None,
        "older_url": f"?{urlencode({**query, 'p': page + 1})}" if more else None,
        "filters": filters,
        "models": [(name, POLICY_MODELS[name]._meta.verbose_name_plural) for name in flt.models] if filters else [],
        "users": users,
        "sources": Source.choices,
        "chosen": {
            "model": request.GET.get("model", ""),
            "user": request.GET.get("user", ""),
            "source": request.GET.get("source", ""),
        },
        "timeline_url": reverse("admin:tenants_policychange_changelist"),
    }
    return TemplateResponse(request, "admin/tenants/policy_changes.html", context)


class PolicyChangeAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """The timeline of every policy change (its changelist is the page), filterable by
    object type, object, user and source."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        visible = tuple(name for name, model in POLICY_MODELS.items() if _can(request, "view", model))
        chosen_model = request.GET.get("model", "")
        names = (chosen_model,) if chosen_model in visible else visible
        object_pk = _int(request.GET.get("object")) if chosen_model in visible else None
        if not names:
            raise PermissionDenied
        flt = ChangeFilter(
            models=names,
            object_pk=object_pk,
            user_id=_int(request.GET.get("user")),
            source=request.GET.get("source") if request.GET.get("source") in Source.values else None,
        )
        return timeline_response(request, self.admin_site, flt, title="Policy changes", opts=self.opts)


@dataclass
class RevertPlan:
    """What reverting one change would do."""

    entry: ChangeEntry
    obj: models.Model | None  # the object as it is now (None: deleted, to restore)
    fields: list[FieldChange] = field(default_factory=list)  # the fields set back, with the values they get
    current: dict[str, str] = field(default_factory=dict)  # field -> its value now, as text
    changed_since: list[str] = field(default_factory=list)  # fields changed again after this change
    skipped: list[str] = field(default_factory=list)  # fields the admin's form cannot set


class PolicyHistoryAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """History for a policy model's admin: the reason on save, the object's history page
    and the revert view."""

    @property
    def history_model_name(self) -> str:
        return self.model._meta.model_name or ""

    def save_model(self, request: HttpRequest, obj: Any, form: forms.ModelForm, change: bool) -> None:
        obj._change_reason = (form.cleaned_data.get(REASON_FIELD) or "").strip() or None
        super().save_model(request, obj, form, change)

    def save_formset(self, request: HttpRequest, form: forms.ModelForm, formset: Any, change: bool) -> None:
        # The inline rows changed with the object share its reason.
        reason = (form.cleaned_data.get(REASON_FIELD) or "").strip() or None
        for inline_form in formset.forms:
            inline_form.instance._change_reason = reason
        super().save_formset(request, form, formset, change)

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        revert = path(
            "<path:object_id>/revert/<int:history_id>/",
            self.admin_site.admin_view(self.revert_view),
            name="{}_{}_revert".format(*info),
        )
        return [revert, *super().get_urls()]

    def history_view(self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None) -> Any:
        """The object's changes (a tenant's with its sub-tenants'), also after it was deleted."""
        pk = _int(object_id)
        if pk is None:
            raise Http404
        obj = self.model._default_manager.filter(pk=pk).first()
        if obj is None and not self.model.history.filter(id=pk).exists():  # type: ignore[attr-defined]
            raise Http404
        if not self.has_view_or_change_permission(request, obj):
            raise PermissionDenied
        names: tuple[str, ...] = (self.history_model_name,)
        if self.history_model_name == "tenant" and _can(request, "view", POLICY_MODELS["subtenant"]):
            names += ("subtenant",)
        subject = str(obj) if obj is not None else f"#{pk} (deleted)"
        return timeline_response(
            request,
            self.admin_site,
            ChangeFilter(models=names, object_pk=pk),
            title=f"History: {subject}",
            subject=subject,
            opts=self.opts,
            filters=False,
        )

    # --- Revert -----------------------------------------------------------------------------

    def revert_view(self, request: HttpRequest, object_id: str, history_id: int) -> HttpResponse:
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        entry = change_entry(self.history_model_name, history_id)
        if entry is None or str(entry.object_pk) != object_id:
            raise Http404
        if entry.kind not in ("changed", "deleted"):
            self.message_user(
                request,
                f"Change {history_id} created {entry.object_label}; to undo it, delete the object.",
                messages.ERROR,
            )
            return HttpResponseRedirect(reverse("admin:tenants_policychange_changelist"))
        with transaction.atomic():
            return self._revert(request, entry)

    def _revert_plan(self, request: HttpRequest, entry: ChangeEntry) -> RevertPlan:
        obj = self.model._default_manager.filter(pk=entry.object_pk).first()
        if entry.kind == "deleted":
            if obj is not None:
                raise _RevertRefused(f"{entry.object_label} exists again; there is no deletion to revert.")
            if not self.has_add_permission(request):
                raise PermissionDenied
            return RevertPlan(entry=entry, obj=None)
        if obj is None:
            raise _RevertRefused(f"{entry.object_label} was deleted since; revert its deletion first.")
        if not self.has_change_permission(request, obj):
            raise PermissionDenied
        if entry.record.prev_record is None:
            raise _RevertRefused(f"The values before change {entry.history_id} were not recorded.")
        editable = set(self.get_form(request, obj, change=True).base_fields)
        plan = RevertPlan(entry=entry, obj=obj)
        names = Names()
        for change in entry.changes:
            if change.name not in editable:
                plan.skipped.append(change.label)
                continue
            plan.fields.append(change)
            model_field = self.model._meta.get_field(change.name)
            assert isinstance(model_field, models.Field)  # a tracked field
            now = getattr(obj, model_field.attname)
            plan.current[change.name] = value_text(model_field, now, names)
            if now != change.new:
                plan.changed_since.append(change.label)
        if not plan.fields:
            raise _RevertRefused(
                f"Change {entry.history_id} changed nothing the admin sets ({', '.join(plan.skipped) or 'no field'})."
            )
        return plan

    def _revert_form(self, request: HttpRequest, plan: RevertPlan, *, confirmed: bool, reason: str) -> forms.ModelForm:
        entry = plan.entry
        if plan.obj is None:  # a deletion: the object again, as it was before it (its pk: on save)
            form_class = self.get_form(request, None, change=False)
            instance = self.model()
            data = model_to_dict(entry.record, fields=list(form_class.base_fields))
        else:
            form_class = self.get_form(request, plan.obj, change=True)
            instance = plan.obj
            data = model_to_dict(plan.obj, fields=list(form_class.base_fields))
            data.update({change.name: change.old for change in plan.fields})
        data = {k: v for k, v in data.items() if v is not None}
        data[REASON_FIELD] = reason
        if confirmed:
            data["confirm_move"] = "on"
        return form_class(data=data, instance=instance)  # type: ignore[no-any-return]

    def _revert(self, request: HttpRequest, entry: ChangeEntry) -> HttpResponse:
        try:
            plan = self._revert_plan(request, entry)
        except _RevertRefused as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return HttpResponseRedirect(reverse(f"admin:tenants_{entry.model_name}_history", args=[entry.object_pk]))
        confirmed = request.POST.get(CONFIRM_FIELD) == "on"
        default_reason = (
            f"Revert of change {entry.history_id} ({entry.user or 'unknown user'}, "
            f"{date_format(entry.date, 'Y-m-d H:i:s')})"
        )
        given = str(request.POST.get(REASON_FIELD, "")).strip()[:REASON_MAX_LENGTH]
        reason = f"{default_reason}: {given}" if given else default_reason
        form = self._revert_form(request, plan, confirmed=confirmed, reason=reason[:REASON_MAX_LENGTH])
        valid = form.is_valid()
        needs_confirmation = not confirmed and (
            plan.changed_since or any(e.code == "confirm_move" for e in form.non_field_errors().as_data())
        )
        if not valid or needs_confirmation:
            return self._revert_page(request, plan, form, needs_confirmation=bool(needs_confirmation), given=given)
        restored = plan.obj is None
        obj = self.save_form(request, form, change=not restored)
        if restored:
            obj.pk = entry.object_pk  # the same object again: its history goes on
        self.save_model(request, obj, form, change=not restored)
        form.save_m2m()
        if restored:
            self.log_addition(request, obj, [{"added": {}}])
        else:
            self.log_change(request, obj, [{"changed": {"fields": [c.label for c in plan.fields]}}])
        shown = self.revert_response(request, obj)
        if shown is not None:
            return shown
        done = "Restored" if restored else "Reverted"
        self.message_user(request, f"{done} {entry.summary()}. Recorded as a change of its own.", messages.SUCCESS)
        return HttpResponseRedirect(reverse(f"admin:tenants_{entry.model_name}_history", args=[obj.pk]))

    def _revert_page(
        self, request: HttpRequest, plan: RevertPlan, form: forms.ModelForm, *, needs_confirmation: bool, given: str
    ) -> HttpResponse:
        errors = [str(e) for e in form.non_field_errors().as_data() if e.code != "confirm_move"]
        for name, errs in form.errors.items():
            if name != "__all__":
                errors.append(f"{form.fields[name].label or name}: {' '.join(map(str, errs))}")
        moves = [" ".join(e.messages) for e in form.non_field_errors().as_data() if e.code == "confirm_move"]
        context = {
            **self.admin_site.each_context(request),
            "title": f"Revert change {plan.entry.history_id}?",
            "opts": self.opts,
            "plan": plan,
            "rows": [(c.label, plan.current.get(c.name, ""), c.old_text) for c in plan.fields],
            "errors": errors,
            "moves": moves,
            "needs_confirmation": needs_confirmation and not errors,
            "given": given,
            "reason_max": REASON_MAX_LENGTH,
            "revert_url": revert_url(plan.entry),
            "history_url": reverse(f"admin:tenants_{plan.entry.model_name}_history", args=[plan.entry.object_pk]),
        }
        status = 200 if needs_confirmation and not errors else 400
        return TemplateResponse(request, "admin/tenants/revert_confirmation.html", context, status=status)

    def revert_response(self, request: HttpRequest, obj: Any) -> HttpResponse | None:
        """A page to show after a revert instead of the history (a tenant's new key)."""
        return None


class _RevertRefused(Exception):
    """A revert that cannot be made, in the operator's words."""
