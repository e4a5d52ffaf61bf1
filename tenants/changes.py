"""The policy change log, read back: each history row (tenants.history) as who, when, from
where, why and field by field old -> new, and the timeline of every policy model's
changes, newest first, filtered by object, user or source."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import models
from django.db.models import QuerySet

from tenants.history import Source
from tenants.models import LatencyClass, PoolSettings, Resource, Shard, SubTenant, Tenant

# The policy models with a history, by the name the admin's URLs use.
POLICY_MODELS: dict[str, type[models.Model]] = {
    "tenant": Tenant,
    "subtenant": SubTenant,
    "shard": Shard,
    "latencyclass": LatencyClass,
    "resource": Resource,
    "poolsettings": PoolSettings,
}
# Never shown as a change: the key, and the creation date (the history row has its own).
_QUIET_FIELDS = frozenset({"id", "created_at"})
# How a row of each model is named (a foreign key to it is shown by this field).
_NAME_FIELD = {Tenant: "slug", Shard: "name", LatencyClass: "name", Resource: "name"}
KIND = {"+": "created", "~": "changed", "-": "deleted"}
PAGE_SIZE = 50


@dataclass(frozen=True)
class FieldChange:
    name: str  # the model field's name ("shard", not "shard_id")
    label: str  # its verbose name
    old: Any  # stored values (a foreign key's id), None before a creation
    new: Any
    old_text: str
    new_text: str

    def __str__(self) -> str:
        return f"{self.label}: {self.old_text} → {self.new_text}"


@dataclass
class ChangeEntry:
    """One history row as the timeline shows it."""

    model_name: str
    model: type[models.Model]
    record: Any  # the historical row
    object_pk: int
    object_label: str
    kind: str
    changes: list[FieldChange] = field(default_factory=list)
    user: str = ""
    user_id: int | None = None
    exists: bool = True  # the object is still there

    @property
    def history_id(self) -> int:
        return int(self.record.history_id)

    @property
    def date(self) -> datetime:
        return self.record.history_date  # type: ignore[no-any-return]

    @property
    def reason(self) -> str:
        return self.record.history_change_reason or ""

    @property
    def model_label(self) -> str:
        return str(self.model._meta.verbose_name)

    @property
    def source(self) -> str:
        return str(Source(self.record.history_source).label)

    def summary(self) -> str:
        """One line: "tenant acme changed: floor 2 → 8"."""
        words = f"{self.model_label} {self.object_label} {self.kind}"
        if self.kind == "changed":
            words += ": " + ("; ".join(map(str, self.changes)) if self.changes else "no field changed")
        return words


def tracked_fields(model: type[models.Model]) -> list[models.Field[Any, Any]]:
    """The fields a model's history keeps and the change log shows, in the model's order."""
    history_model = model.history.model  # type: ignore[attr-defined]
    kept = {f.attname for f in history_model._meta.fields}
    return [f for f in model._meta.concrete_fields if f.attname in kept and f.name not in _QUIET_FIELDS]


class Names:
    """Names of the rows foreign keys point at, read once per page; a deleted row is named
    by its last history row."""

    def __init__(self) -> None:
        self._names: dict[type[models.Model], dict[Any, str]] = {}

    def want(self, model: type[models.Model], pks: Iterable[Any]) -> None:
        missing = {pk for pk in pks if pk is not None} - set(self._names.get(model, {}))
        if not missing or model not in _NAME_FIELD:
            return
        attr = _NAME_FIELD[model]
        found = dict(model._default_manager.filter(pk__in=missing).values_list("pk", attr))
        for pk in missing - set(found):
            last = model.history.filter(id=pk).order_by("-history_date").values_list(attr, flat=True).first()  # type: ignore[attr-defined]
            found[pk] = f"{last} (deleted)" if last else f"#{pk} (deleted)"
        self._names.setdefault(model, {}).update(found)

    def name(self, model: type[models.Model], pk: Any) -> str:
        if pk is None:
            return "none"
        self.want(model, [pk])
        return self._names.get(model, {}).get(pk, f"#{pk}")


def value_text(f: models.Field[Any, Any], value: Any, names: Names) -> str:
    if isinstance(f, models.ForeignKey):
        return names.name(f.related_model, value)  # type: ignore[arg-type]
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        return value.isoformat(timespec="seconds")
    if value == "":
        return "(empty)"
    return str(value)


def record_changes(record: Any, prev: Any | None, *, names: Names) -> list[FieldChange]:
    """Field by field what this history row changed: against the row before it, or, for a
    creation, every value it started with (a deletion: every value it had)."""
    out = []
    for f in tracked_fields(record.instance_type):
        new = getattr(record, f.attname)
        old = getattr(prev, f.attname) if prev is not None else None
        if record.history_type == "-":
            old, new = new, None
        elif prev is not None and old == new:
            continue
        out.append(
            FieldChange(
                name=f.name,
                label=str(f.verbose_name),
                old=old,
                new=new,
                old_text="" if prev is None and record.history_type == "+" else value_text(f, old, names),
                new_text="" if record.history_type == "-" else value_text(f, new, names),
            )
        )
    return out


def object_label(model: type[models.Model], record: Any, names: Names) -> str:
    if model is SubTenant:
        return f"{names.name(Tenant, record.tenant_id)}/{record.external_id}"
    if model is PoolSettings:
        return "pool settings"
    return str(getattr(record, _NAME_FIELD[model]))


def entries_build(records: Sequence[tuple[str, Any]], *, names: Names | None = None) -> list[ChangeEntry]:
    """The entries of these history rows ((model name, row) pairs), each diffed against the
    row before it."""
    names = names or Names()
    for model_name, record in records:
        model = POLICY_MODELS[model_name]
        for f in tracked_fields(model):
            if isinstance(f, models.ForeignKey):
                names.want(f.related_model, [getattr(record, f.attname)])  # type: ignore[arg-type]
    existing: dict[str, set[int]] = {}
    for model_name in {m for m, _ in records}:
        pks = {r.id for m, r in records if m == model_name}
        rows = POLICY_MODELS[model_name]._default_manager.filter(pk__in=pks)
        existing[model_name] = set(rows.values_list("pk", flat=True))
    entries = []
    for model_name, record in records:
        model = POLICY_MODELS[model_name]
        prev = record.prev_record if record.history_type == "~" else None
        user = record.history_user
        entries.append(
            ChangeEntry(
                model_name=model_name,
                model=model,
                record=record,
                object_pk=record.id,
                object_label=object_label(model, record, names),
                kind=KIND[record.history_type],
                changes=record_changes(record, prev, names=names),
                user=user.get_username() if user is not None else "",
                user_id=record.history_user_id,
                exists=record.id in existing[model_name],
            )
        )
    return entries


@dataclass(frozen=True)
class ChangeFilter:
    """What the timeline shows: some models, one object (of the first model), one user, one source."""

    models: tuple[str, ...] = tuple(POLICY_MODELS)
    object_pk: int | None = None
    user_id: int | None = None
    source: str | None = None

    def querysets(self) -> list[tuple[str, QuerySet[Any]]]:
        out = []
        for name in self.models:
            qs = POLICY_MODELS[name].history.all()  # type: ignore[attr-defined]
            if self.user_id is not None:
                qs = qs.filter(history_user_id=self.user_id)
            if self.source:
                qs = qs.filter(history_source=self.source)
            if self.object_pk is not None:
                if name == self.models[0]:
                    qs = qs.filter(id=self.object_pk)
                elif name == "subtenant" and self.models[0] == "tenant":
                    qs = qs.filter(tenant_id=self.object_pk)  # a tenant's page shows its sub-tenants' changes too
                else:
                    continue
            out.append((name, qs))
        return out


def changes_page(flt: ChangeFilter, *, page: int = 0, per_page: int = PAGE_SIZE) -> tuple[list[ChangeEntry], bool]:
    """One page of the timeline, newest first, and whether an older page follows."""
    wanted = (page + 1) * per_page + 1
    heads = []
    for name, qs in flt.querysets():
        rows = qs.order_by("-history_date", "-history_id").values_list("history_date", "history_id")[:wanted]
        heads.append([(date, hid, name) for date, hid in rows])
    merged = list(heapq.merge(*heads, key=lambda row: (row[0], row[1]), reverse=True))
    chosen = merged[page * per_page : (page + 1) * per_page]
    by_model: dict[str, list[int]] = {}
    for _, hid, name in chosen:
        by_model.setdefault(name, []).append(hid)
    loaded = {
        (name, r.history_id): r
        for name, ids in by_model.items()
        for r in POLICY_MODELS[name].history.filter(history_id__in=ids).select_related("history_user")  # type: ignore[attr-defined]
    }
    records = [(name, loaded[(name, hid)]) for _, hid, name in chosen]
    return entries_build(records), len(merged) > (page + 1) * per_page


def change_entry(model_name: str, history_id: int) -> ChangeEntry | None:
    """One history row as an entry, or None."""
    model = POLICY_MODELS.get(model_name)
    if model is None:
        return None
    record = model.history.filter(history_id=history_id).select_related("history_user").first()  # type: ignore[attr-defined]
    return entries_build([(model_name, record)])[0] if record is not None else None


def model_name_of(model: type[models.Model]) -> str:
    return model._meta.model_name or ""
