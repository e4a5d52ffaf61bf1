"""Policy as code: the whole policy as one YAML or JSON document (`manage.py policy export`),
read back and checked against the database (`policy apply --dry-run`), and applied in one
transaction recorded in history with source "file" (`policy apply`).

The document (objects are keyed by name, so a reviewed diff reads as the change)::

    format: fairqueue-policy/1
    pool: {target_utilisation: 0.85, f_min: 0.25, f_max: 4.0, rate_window_seconds: 300,
           default_job_seconds: 1.0, batch_objective_seconds: 43200, floor_headroom: 0,
           quarantine_after_losses: 1, quarantine_poison_losses: 2, quarantine_slots: 1,
           backlog_quota: 100000, batch_backlog_quota: 1000000, submit_rate: 0.0, submit_burst: 1000,
           memory_guard_pct: 80.0}
    shards: {default: {capacity: 100}}
    latency_classes: {critical: {objective_seconds: 60, rank: 40}, ...}
    resources: {llm-a: {limit: 10, decrease_factor: 0.5, increase_per_success: 0.2, recovery_seconds: 10.0}}
    tenants:
      acme: {name: Acme, active: true, shard: default, floor: 2, burst_floor: 2, burst_pct: 0.5,
             max_concurrency: null, dedicated: 0, batch_enabled: false, default_latency_class: null,
             sub_tenant_share: 0.5, max_fan_out: 10, webhook_url: "", backlog_quota: null,
             batch_backlog_quota: null, submit_rate: null, sub_tenants: {clinic-9: 4}}

A field left out keeps its value (a new object takes the model's default); an object left
out is kept, unless the file is applied with `prune`, which deletes it. No secrets: API
keys and webhook secrets are neither written nor read. Every value goes through the
model's own validation (the admin's messages); every problem is reported with the file's
line and the key's path, and a file with any problem writes nothing.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import models, transaction

from tenants.history import Source, change_source
from tenants.models import LatencyClass, PoolSettings, Resource, Shard, SubTenant, Tenant
from tenants.policy import PolicySnapshot
from tenants.selectors import tenants_move_preview
from tenants.whatif import policy_from_rows
from webhooks.targets import TargetRefused, target_resolve

FORMAT = "fairqueue-policy/1"
POOL_FIELDS = (
    "target_utilisation",
    "f_min",
    "f_max",
    "rate_window_seconds",
    "default_job_seconds",
    "batch_objective_seconds",
    "floor_headroom",
    "quarantine_after_losses",
    "quarantine_poison_losses",
    "quarantine_slots",
    "backlog_quota",
    "batch_backlog_quota",
    "submit_rate",
    "submit_burst",
    "memory_guard_pct",
)
SHARD_FIELDS = ("capacity",)
CLASS_FIELDS = ("objective_seconds", "rank")
RESOURCE_FIELDS = ("limit", "decrease_factor", "increase_per_success", "recovery_seconds")
TENANT_FIELDS = (
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
    "sub_tenant_share",
    "max_fan_out",
    "webhook_url",
    "backlog_quota",
    "batch_backlog_quota",
    "submit_rate",
)
SUB_TENANTS = "sub_tenants"
SECTIONS = ("format", "pool", "shards", "latency_classes", "resources", "tenants")
# Jobs without a class fall back to it (the admin refuses its deletion too).
KEPT_CLASS = "default"
# While ranks are swapped between classes, each changed class holds one of these first
# (ranks are unique; a class's rank is at most 250).
TEMPORARY_RANK_BASE = 10_000


class PolicyFileError(Exception):
    """A file that cannot be applied: every problem, each naming its line and key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


# --- Export ---------------------------------------------------------------------------------


def _export_value(obj: models.Model, name: str) -> Any:
    value = getattr(obj, name)
    if isinstance(value, Shard | LatencyClass):
        return value.name
    return value


def policy_export() -> dict[str, Any]:
    """The whole policy as a document (see the module's docstring)."""
    pool = PoolSettings.load()
    subs: dict[int, dict[str, int]] = {}
    for st in SubTenant.objects.order_by("external_id"):
        subs.setdefault(st.tenant_id, {})[st.external_id] = st.max_concurrency
    tenants = Tenant.objects.select_related("shard", "default_latency_class").order_by("slug")
    return {
        "format": FORMAT,
        "pool": {f: getattr(pool, f) for f in POOL_FIELDS},
        "shards": {s.name: {f: getattr(s, f) for f in SHARD_FIELDS} for s in Shard.objects.order_by("name")},
        "latency_classes": {
            c.name: {f: getattr(c, f) for f in CLASS_FIELDS} for c in LatencyClass.objects.order_by("-rank")
        },
        "resources": {r.name: {f: getattr(r, f) for f in RESOURCE_FIELDS} for r in Resource.objects.order_by("name")},
        "tenants": {
            t.slug: {**{f: _export_value(t, f) for f in TENANT_FIELDS}, SUB_TENANTS: subs.get(t.pk, {})}
            for t in tenants
        },
    }


def policy_dump(document: dict[str, Any], *, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    header = "# FairQueue policy (python manage.py policy export). No secrets: API keys and webhook secrets stay out.\n"
    return header + yaml.safe_dump(document, sort_keys=False, allow_unicode=True, default_flow_style=False)


# --- Reading, with the line of every key -------------------------------------------------


class Mapping(dict[Any, Any]):
    """A mapping read from a file, with the line of each key."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[Any, int] = {}


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(f"line {line}: {key!r} appears twice (first on line {first})")
        self.line = line


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> Mapping:
    loader.flatten_mapping(node)
    out = Mapping()
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
        line = key_node.start_mark.line + 1
        if key in out:
            raise _DuplicateKey(key, line, out.lines[key])
        out[key] = loader.construct_object(value_node, deep=True)  # type: ignore[no-untyped-call]
        out.lines[key] = line
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)  # type: ignore[arg-type]


def _yaml_load(text: str, *, name: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader: plain data only
    except _DuplicateKey as exc:
        raise PolicyFileError([f"{name}, {exc}"]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise PolicyFileError([f"{name}{where}: not valid YAML: {exc.problem or exc.context}"]) from None
    except yaml.YAMLError as exc:
        raise PolicyFileError([f"{name}: not valid YAML: {exc}"]) from None


def _json_mapping(pairs: list[tuple[str, Any]]) -> Mapping:
    out = Mapping()
    for key, value in pairs:
        if key in out:
            raise ValueError(f"{key!r} appears twice in one object")
        out[key] = value
    return out


def _lines_copy(into: Any, source: Any) -> None:
    """The lines of `source`'s keys onto the same keys of `into` (the same document read twice)."""
    if not isinstance(into, Mapping) or not isinstance(source, Mapping):
        return
    for key, value in into.items():
        if key in source.lines:
            into.lines[key] = source.lines[key]
            _lines_copy(value, source[key])


def policy_load(text: str, *, fmt: str, name: str) -> Any:
    """The document in `text` (YAML, or JSON), with the line of each key; PolicyFileError
    naming the line when it cannot be read."""
    if fmt != "json":
        return _yaml_load(text, name=name)
    try:
        document = json.loads(text, object_pairs_hook=_json_mapping)
    except ValueError as exc:
        lineno = getattr(exc, "lineno", None)
        where = f", line {lineno}" if lineno else ""
        raise PolicyFileError([f"{name}{where}: not valid JSON: {getattr(exc, 'msg', exc)}"]) from None
    # The values are JSON's; the lines come from reading it as YAML too, when that reads it
    # (JSON indented with tabs is no YAML: then the problems name keys alone).
    with contextlib.suppress(PolicyFileError):
        _lines_copy(document, _yaml_load(text, name=name))
    return document


# --- Checking a document against the database -------------------------------------------------


class _Problems:
    def __init__(self, name: str) -> None:
        self.name = name
        self._found: list[tuple[int, str]] = []

    def add(self, path: Iterable[Any], line: int | None, message: str) -> None:
        where = f", line {line}" if line else ""
        self._found.append((line or 0, f"{self.name}{where}: {'.'.join(map(str, path))}: {message}"))

    @property
    def items(self) -> list[str]:
        """In the file's order."""
        return [text for _, text in sorted(self._found, key=lambda found: found[0])]


def _line(mapping: Any, key: Any, default: int | None = None) -> int | None:
    return mapping.lines.get(key, default) if isinstance(mapping, Mapping) else default


def _convert(f: models.Field[Any, Any], value: Any) -> Any:
    """A file's value for a model field (no foreign keys), or ValueError saying what is wrong."""
    if value is None:
        if f.null:
            return None
        raise ValueError("must have a value (null is not allowed here)")
    if isinstance(f, models.IntegerField):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be a whole number, not {value!r}")
    elif isinstance(f, models.FloatField):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"must be a number, not {value!r}")
        value = float(value)
    elif isinstance(f, models.BooleanField):
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, not {value!r}")
    elif isinstance(f, models.CharField) and not isinstance(value, str):
        raise ValueError(f"must be text, not {value!r}")
    return value


def _text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Shard | LatencyClass):
        return value.name
    if value == "":
        return '""'
    return str(value)


@dataclass
class _Object:
    """One policy row as the file would leave it."""

    path: tuple[str, ...]  # ("tenants", "acme")
    obj: models.Model
    line: int | None
    lines: dict[str, int | None]  # field -> its line
    before: dict[str, Any] | None  # the saved values (None: new)
    fields: tuple[str, ...]

    def changes(self) -> list[tuple[str, Any, Any]]:
        if self.before is None:
            return []
        out = []
        for name in self.fields:
            new = getattr(self.obj, name)
            old = self.before[name]
            if _key_of(old) != _key_of(new):
                out.append((name, old, new))
        return out

    @property
    def new(self) -> bool:
        return self.before is None

    @property
    def changed(self) -> bool:
        return self.new or bool(self.changes())


def _key_of(value: Any) -> Any:
    # A foreign key is compared by the row it names: a new row has no pk, so by its name.
    if isinstance(value, Shard | LatencyClass):
        return ("row", type(value).__name__, value.name)
    return value


@dataclass
class PolicyPlan:
    """What applying a document would do."""

    source: str
    objects: list[_Object] = field(default_factory=list)  # in the order they are saved
    deletions: list[tuple[str, models.Model]] = field(default_factory=list)  # ("tenants.old", row), in order
    kept: list[str] = field(default_factory=list)  # in the database, not in the file, kept
    moved: list[Tenant] = field(default_factory=list)  # saved tenants the file puts on another shard
    moves: list[str] = field(default_factory=list)  # what moving them does to their unfinished jobs
    current: PolicySnapshot | None = None
    proposed: PolicySnapshot | None = None
    affected_shards: set[str] = field(default_factory=set)  # shards whose waits may change

    @property
    def changed(self) -> bool:
        return bool(self.deletions) or any(o.changed for o in self.objects)

    def lines(self) -> list[str]:
        """The diff, one line per created or deleted object and per changed field."""
        out = []
        for o in self.objects:
            label = ".".join(o.path)
            if o.new:
                given = ", ".join(f"{f} {_text(getattr(o.obj, f))}" for f in o.fields)
                out.append(f"+ {label}: {given}")
            else:
                out += [f"~ {label}.{f}: {_text(old)} -> {_text(new)}" for f, old, new in o.changes()]
        out += [f"- {label}" for label, _ in self.deletions]
        return out


class _Reader:
    """Builds a plan: the saved rows, with the document's values set on them (unsaved)."""

    def __init__(self, document: Any, *, name: str, prune: bool) -> None:
        self.doc = document
        self.prune = prune
        self.problems = _Problems(name)
        self.plan = PolicyPlan(source=name)
        self.shards = {s.name: s for s in Shard.objects.all()}
        self.classes = {c.name: c for c in LatencyClass.objects.all()}
        self.resources = {r.name: r for r in Resource.objects.all()}
        self.tenants = {t.slug: t for t in Tenant.objects.select_related("shard", "default_latency_class")}
        for t in self.tenants.values():
            # One row per shard and class: a tenant sees the file's changes to its shard.
            t.shard = self.shards[t.shard.name]
            if t.default_latency_class is not None:
                t.default_latency_class = self.classes[t.default_latency_class.name]
        self.subs: dict[str, dict[str, SubTenant]] = {}
        for st in SubTenant.objects.select_related("tenant"):
            self.subs.setdefault(st.tenant.slug, {})[st.external_id] = st
        self.pool = PoolSettings.load()
        self.current = policy_from_rows(
            tenants=list(self.tenants.values()),
            subtenants={slug: {e: s.max_concurrency for e, s in subs.items()} for slug, subs in self.subs.items()},
            shards=list(self.shards.values()),
            classes=list(self.classes.values()),
            pool=self.pool,
        )

    # A section is a mapping of names to mappings of fields.
    def section(self, key: str) -> Iterator[tuple[str, dict[Any, Any] | None, int | None]]:
        body = self.doc.get(key)
        if key not in self.doc:
            return
        if not isinstance(body, dict):
            self.problems.add([key], _line(self.doc, key), "must be a mapping of names to their settings")
            return
        for name, entry in body.items():
            line = _line(body, name)
            if not isinstance(name, str) or not name:
                self.problems.add([key, name], line, "a name must be text (quote it: yes, no, on, 1 are not)")
                continue
            if entry is not None and not isinstance(entry, dict):
                self.problems.add([key, name], line, "must be a mapping of its settings")
                continue
            yield name, entry, line

    def set_fields(
        self,
        path: tuple[str, ...],
        obj: models.Model,
        entry: Any,
        fields: tuple[str, ...],
        *,
        extra: tuple[str, ...] = (),
    ) -> dict[str, int | None]:
        lines: dict[str, int | None] = {}
        for key, value in (entry or {}).items():
            line = _line(entry, key)
            if key in extra:
                continue
            if key not in fields:
                known = ", ".join((*fields, *extra))
                self.problems.add([*path, key], line, f"unknown setting (known: {known})")
                continue
            lines[key] = line
            f = obj._meta.get_field(key)
            assert isinstance(f, models.Field)
            if isinstance(f, models.ForeignKey):
                self.set_relation(path, obj, f, value, line)
                continue
            try:
                setattr(obj, key, _convert(f, value))
            except ValueError as exc:
                self.problems.add([*path, key], line, str(exc))
        return lines

    def set_relation(
        self, path: tuple[str, ...], obj: models.Model, f: models.ForeignKey[Any, Any], value: Any, line: int | None
    ) -> None:
        rows: dict[str, Any] = self.shards if f.related_model is Shard else self.classes
        if value is None and f.null:
            setattr(obj, f.name, None)
        elif not isinstance(value, str) or value not in rows:
            known = ", ".join(sorted(rows)) or "none"
            noun = "shard" if f.related_model is Shard else "latency class"
            self.problems.add([*path, f.name], line, f"no {noun} {value!r} (known: {known})")
        else:
            setattr(obj, f.name, rows[value])

    def add(
        self,
        path: tuple[str, ...],
        obj: models.Model,
        line: int | None,
        entry: Any,
        fields: tuple[str, ...],
        extra: tuple[str, ...] = (),
    ) -> _Object:
        before = None if obj.pk is None else {f: getattr(obj, f) for f in fields}
        lines = self.set_fields(path, obj, entry, fields, extra=extra)
        item = _Object(path=path, obj=obj, line=line, lines=lines, before=before, fields=fields)
        self.plan.objects.append(item)
        return item

    def read(self) -> PolicyPlan:
        doc = self.doc
        if not isinstance(doc, dict):
            raise PolicyFileError(
                [f"{self.problems.name}: the document must be a mapping of sections ({', '.join(SECTIONS)})"]
            )
        for key in doc:
            if key not in SECTIONS:
                self.problems.add([key], _line(doc, key), f"unknown section (known: {', '.join(SECTIONS)})")
        if "format" in doc and doc["format"] != FORMAT:
            self.problems.add(["format"], _line(doc, "format"), f"must be {FORMAT!r}, not {doc['format']!r}")
        in_file: dict[str, set[str]] = {key: set() for key in ("shards", "latency_classes", "resources", "tenants")}
        for name, entry, line in self.section("shards"):
            in_file["shards"].add(name)
            shard = self.shards.setdefault(name, Shard(name=name))
            self.add(("shards", name), shard, line, entry, SHARD_FIELDS)
        for name, entry, line in self.section("latency_classes"):
            in_file["latency_classes"].add(name)
            if name not in self.classes and "rank" not in (entry or {}):
                self.problems.add(["latency_classes", name], line, "a new class needs a rank")
            latency_class = self.classes.setdefault(name, LatencyClass(name=name))
            self.add(("latency_classes", name), latency_class, line, entry, CLASS_FIELDS)
        for name, entry, line in self.section("resources"):
            in_file["resources"].add(name)
            resource = self.resources.setdefault(name, Resource(name=name))
            self.add(("resources", name), resource, line, entry, RESOURCE_FIELDS)
        if "pool" in doc:
            pool_entry = doc["pool"]
            if isinstance(pool_entry, dict):
                self.add(("pool",), self.pool, _line(doc, "pool"), pool_entry, POOL_FIELDS)
            else:
                self.problems.add(["pool"], _line(doc, "pool"), "must be a mapping of its settings")
        for slug, entry, line in self.section("tenants"):
            in_file["tenants"].add(slug)
            tenant = self.tenants.get(slug)
            if tenant is None:
                if "shard" not in (entry or {}):
                    self.problems.add(["tenants", slug], line, "a new tenant needs a shard")
                tenant = self.tenants[slug] = Tenant(slug=slug, name=slug)
            self.add(("tenants", slug), tenant, line, entry, TENANT_FIELDS, extra=(SUB_TENANTS,))
            self.read_sub_tenants(slug, tenant, entry or {})
        self.deletions_or_kept(in_file)
        self.validate()
        if self.problems.items:
            raise PolicyFileError(self.problems.items)
        self.finish()
        return self.plan

    def read_sub_tenants(self, slug: str, tenant: Tenant, entry: Any) -> None:
        if SUB_TENANTS not in entry:
            return
        body, path = entry[SUB_TENANTS], ("tenants", slug, SUB_TENANTS)
        if not isinstance(body, dict):
            self.problems.add(path, _line(entry, SUB_TENANTS), "must be a mapping of sub-tenant ids to their caps")
            return
        saved = self.subs.setdefault(slug, {})
        listed = set()
        for external_id, cap in body.items():
            line = _line(body, external_id)
            external_id = (
                str(external_id) if isinstance(external_id, int) and not isinstance(external_id, bool) else external_id
            )
            if not isinstance(external_id, str) or not external_id:
                self.problems.add([*path, external_id], line, "a sub-tenant id must be text")
                continue
            listed.add(external_id)
            sub = saved.get(external_id) or SubTenant(tenant=tenant, external_id=external_id)
            saved[external_id] = sub
            cap_entry = Mapping()
            cap_entry["max_concurrency"] = cap
            if line is not None:
                cap_entry.lines["max_concurrency"] = line
            self.add((*path, external_id), sub, line, cap_entry, ("max_concurrency",))
        for external_id in sorted(set(saved) - listed):
            self.gone(f"tenants.{slug}.sub_tenants.{external_id}", saved[external_id])

    def gone(self, label: str, row: models.Model) -> None:
        if self.prune:
            self.plan.deletions.append((label, row))
        else:
            self.plan.kept.append(label)

    def deletions_or_kept(self, in_file: dict[str, set[str]]) -> None:
        """What a section of the file leaves out (a section the file has not is left alone)."""
        if "tenants" in self.doc:
            for slug in sorted(set(self.tenants) - in_file["tenants"]):
                if self.prune:  # its sub-tenants first, each deletion with the file's reason
                    for external_id, sub in sorted(self.subs.get(slug, {}).items()):
                        self.plan.deletions.append((f"tenants.{slug}.sub_tenants.{external_id}", sub))
                self.gone(f"tenants.{slug}", self.tenants[slug])
        for key, rows in (("resources", self.resources), ("latency_classes", self.classes), ("shards", self.shards)):
            if key in self.doc:
                for name in sorted(set(rows) - in_file[key]):
                    self.gone(f"{key}.{name}", rows[name])

    def validate(self) -> None:
        deleted = {id(row) for _, row in self.plan.deletions}
        listed = {id(o.obj) for o in self.plan.objects}
        changed_shards = {id(o.obj): o for o in self.plan.objects if isinstance(o.obj, Shard) and o.changed}
        # A tenant the file leaves alone is checked again when its shard changes (a floor
        # above the shard's new capacity), at the line of that change.
        unlisted = [
            _Object(
                path=("tenants", t.slug),
                obj=t,
                line=changed_shards[id(t.shard)].lines.get("capacity", changed_shards[id(t.shard)].line),
                lines={},
                before=None,
                fields=(),
            )
            for t in self.tenants.values()
            if id(t) not in listed and id(t) not in deleted and id(t.shard) in changed_shards
        ]
        for o in [*self.plan.objects, *unlisted]:
            if not o.changed and not (isinstance(o.obj, Tenant) and id(o.obj.shard) in changed_shards):
                continue
            # Foreign keys were checked against the file's rows (which may be new).
            exclude = [f.name for f in o.obj._meta.fields if isinstance(f, models.ForeignKey)]
            try:
                o.obj.full_clean(exclude=exclude, validate_unique=False)
            except ValidationError as exc:
                for name, messages in exc.message_dict.items():
                    on = [] if name == NON_FIELD_ERRORS else [name]
                    self.problems.add([*o.path, *on], o.lines.get(name, o.line), " ".join(messages))
            changed_fields = {name for name, _, _ in o.changes()}
            if isinstance(o.obj, Tenant) and o.obj.webhook_url and (o.new or "webhook_url" in changed_fields):
                try:
                    target_resolve(o.obj.webhook_url)
                except TargetRefused as exc:
                    self.problems.add([*o.path, "webhook_url"], o.lines.get("webhook_url", o.line), str(exc))
        ranks: dict[int, list[str]] = {}
        for c in self.classes.values():
            if id(c) not in deleted and c.rank is not None:
                ranks.setdefault(c.rank, []).append(c.name)
        for rank, names in sorted(ranks.items()):
            if len(names) > 1:
                self.problems.add(
                    ["latency_classes"],
                    _line(self.doc, "latency_classes"),
                    f"rank {rank} is taken by {', '.join(sorted(names))}: ranks must differ",
                )
        for label, row in self.plan.deletions:
            if isinstance(row, LatencyClass) and row.name == KEPT_CLASS:
                self.problems.add(
                    label.split("."), None, f"the {KEPT_CLASS!r} class cannot be deleted (jobs without a class use it)"
                )
        living = [t for t in self.tenants.values() if id(t) not in deleted]
        for label, row in self.plan.deletions:
            users = sorted(t.slug for t in living if t.shard is row or t.default_latency_class is row)
            if users:
                self.problems.add(
                    label.split("."), None, f"still used by tenant(s) {', '.join(users)}: it cannot be deleted"
                )

    def finish(self) -> None:
        plan = self.plan
        deleted = {id(row) for _, row in plan.deletions}
        plan.moved = [
            o.obj
            for o in plan.objects
            if isinstance(o.obj, Tenant) and not o.new and "shard" in [c[0] for c in o.changes()]
        ]
        if plan.moved:
            plan.moves = tenants_move_preview(tenants=Tenant.objects.filter(pk__in=[t.pk for t in plan.moved]))
        tenants = [t for t in self.tenants.values() if id(t) not in deleted]
        subtenants: dict[str, dict[str, int]] = {}
        for slug, subs in self.subs.items():
            for external_id, sub in subs.items():
                if id(sub) not in deleted and id(self.tenants.get(slug)) not in deleted:
                    subtenants.setdefault(slug, {})[external_id] = sub.max_concurrency
        plan.current = self.current
        plan.proposed = policy_from_rows(
            tenants=tenants,
            subtenants=subtenants,
            shards=[s for s in self.shards.values() if id(s) not in deleted],
            classes=[c for c in self.classes.values() if id(c) not in deleted],
            pool=self.pool,
        )
        plan.affected_shards = _affected_shards(plan)


def _affected_shards(plan: PolicyPlan) -> set[str]:
    """The saved shards whose jobs' waits the change may alter (the what-if replays them)."""
    assert plan.current is not None and plan.proposed is not None
    current, proposed = plan.current, plan.proposed
    if current.pool != proposed.pool or current.classes != proposed.classes:
        return set(current.shards)
    out = set()
    for slug in set(current.tenants) | set(proposed.tenants):
        a, b = current.tenants.get(slug), proposed.tenants.get(slug)
        if a != b or current.subtenants.get(slug) != proposed.subtenants.get(slug):
            out |= {t.shard for t in (a, b) if t is not None}
    out |= {name for name in current.shards if current.shards[name] != proposed.shards.get(name)}
    return out & set(current.shards)


def policy_plan(document: Any, *, name: str, prune: bool = False) -> PolicyPlan:
    """What applying `document` would do; PolicyFileError with every problem if it cannot be."""
    return _Reader(document, name=name, prune=prune).read()


# --- Applying ---------------------------------------------------------------------------------


def policy_apply(
    plan: PolicyPlan, *, reason: str, user: AbstractBaseUser | None = None, confirm_moves: bool = False
) -> int:
    """Write the plan in one transaction, recorded in history with source "file" (and
    `user`, `reason`); the Redis sync follows the commit. Returns the rows written.
    Refuses (PolicyFileError, nothing written) to move tenants with unfinished jobs
    unless `confirm_moves`."""
    if plan.moved and not confirm_moves:
        moves = tenants_move_preview(tenants=Tenant.objects.filter(pk__in=[t.pk for t in plan.moved]))
        if moves:
            raise PolicyFileError([f"{plan.source}: moving: {m}" for m in moves])

    def stamp(row: models.Model) -> models.Model:
        """Who and why, for the row's history (django-simple-history reads these)."""
        row._change_reason = reason  # type: ignore[attr-defined]
        if user is not None:
            row._history_user = user  # type: ignore[attr-defined]
        return row

    with transaction.atomic(), change_source(Source.FILE):
        changed = [o for o in plan.objects if o.changed]
        # Ranks are unique: classes that change theirs let go of the old one first.
        reranked = [
            o.obj
            for o in changed
            if isinstance(o.obj, LatencyClass) and not o.new and "rank" in [c[0] for c in o.changes()]
        ]
        for i, reranked_row in enumerate(reranked):
            LatencyClass.objects.filter(pk=reranked_row.pk).update(rank=TEMPORARY_RANK_BASE + i)
        for o in changed:
            stamp(o.obj).save()
        for _, row in plan.deletions:
            stamp(row).delete()
    return len(changed) + len(plan.deletions)
