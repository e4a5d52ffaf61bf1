"""The policy side of the what-if: a proposed policy from unsaved rows, what a comparison
says, and the hook that runs it.

The replay itself needs the jobs (fairqueue.jobs.whatif registers it as the runner): this
app never imports the jobs side, so the admin calls `whatif_run` and gets a
`WhatIfComparison` back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db.models import Field

from tenants.models import LatencyClass, PoolSettings, Shard, SubTenant, Tenant
from tenants.policy import ClassPolicy, PolicySnapshot, PoolPolicy, ShardPolicy, TenantPolicy
from tenants.sync import tenant_policy_mapping

MAX_HOURS = 24 * 7
DEFAULT_HOURS = 1.0
# The fields an operator can change in a what-if (the command's --set; the admin's forms).
TENANT_FIELDS = ("floor", "burst_floor", "burst_pct", "max_concurrency", "dedicated", "sub_tenant_share", "active")
POOL_FIELDS = ("target_utilisation", "f_min", "f_max", "rate_window_seconds", "default_job_seconds", "floor_headroom")
SHARD_FIELDS = ("capacity",)


class WhatIfError(Exception):
    """A what-if that cannot run as asked (said in the operator's words)."""


@dataclass(frozen=True)
class WhatIfRequest:
    shard: str
    hours: float
    current: PolicySnapshot
    proposed: PolicySnapshot
    slots: int | None = None  # None: the fleet's live slots
    changes: tuple[str, ...] = ()  # "acme.floor 2 -> 8", for the reader


@dataclass(frozen=True)
class TenantWaits:
    jobs: int
    p50: float | None
    p99: float | None


@dataclass(frozen=True)
class PolicyOutcome:
    """One policy's simulated run of the window."""

    waits: dict[str, TenantWaits]
    utilisation: float | None  # slot-seconds of job bodies / (slots x the window)
    backlog_utilisation: float | None  # the same while a job waited for a slot
    series_t: list[float]  # seconds after the window's start
    series_waiting: list[int]  # the most jobs submitted and not started, per interval
    peak_waiting: int
    stranded: int  # never started in the model (a limit of 0)
    elapsed_s: float


@dataclass(frozen=True)
class WhatIfComparison:
    shard: str
    hours: float
    start: datetime
    end: datetime
    jobs: int
    slots: int
    slots_source: str
    current: PolicyOutcome
    proposed: PolicyOutcome
    changes: tuple[str, ...] = ()
    latencies: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def tenants(self) -> list[str]:
        return sorted(set(self.current.waits) | set(self.proposed.waits))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["start"], out["end"] = self.start.isoformat(), self.end.isoformat()
        return out


WhatIfRunner = Callable[[WhatIfRequest], WhatIfComparison]
_runners: list[WhatIfRunner] = []


def whatif_runner_register(runner: WhatIfRunner) -> None:
    """The jobs side registers the replay (it owns the Job rows)."""
    if runner not in _runners:
        _runners.append(runner)


def whatif_run(request: WhatIfRequest) -> WhatIfComparison:
    if not _runners:
        raise WhatIfError("No what-if runner is registered (the jobs app is not installed).")
    return _runners[-1](request)


def hours_parse(raw: object) -> float:
    """The window length from an operator's input, or WhatIfError saying what is wrong."""
    try:
        hours = float(str(raw).strip())
    except ValueError:
        raise WhatIfError(f"Hours must be a number, not {str(raw)[:20]!r}.") from None
    if not 0 < hours <= MAX_HOURS:
        raise WhatIfError(f"Hours must be more than 0 and at most {MAX_HOURS} (a week), not {hours:g}.")
    return hours


def policy_from_database(
    *,
    tenants: Iterable[Tenant] = (),
    pool: PoolSettings | None = None,
    shards: Iterable[Shard] = (),
) -> PolicySnapshot:
    """The policy the fleet would run if the database held these rows: the saved rows,
    with `tenants`, `pool` and `shards` (unsaved instances, e.g. a form's) in place of
    theirs. Built through the same mappings the sync writes to Redis."""
    override_tenants = {t.pk: t for t in tenants}
    override_shards = {s.pk: s for s in shards}
    shard_rows = {s.pk: override_shards.get(s.pk, s) for s in Shard.objects.all()}
    shard_rows.update(override_shards)
    tenant_rows = {
        t.pk: override_tenants.get(t.pk, t) for t in Tenant.objects.select_related("shard", "default_latency_class")
    }
    tenant_rows.update(override_tenants)
    subs: dict[str, dict[str, int]] = {}
    slug_by_pk = {pk: t.slug for pk, t in tenant_rows.items()}
    for st in SubTenant.objects.all():
        if st.tenant_id in slug_by_pk:
            subs.setdefault(slug_by_pk[st.tenant_id], {})[st.external_id] = st.max_concurrency
    for t in tenant_rows.values():
        if t.shard_id in shard_rows:
            t.shard = shard_rows[t.shard_id]  # the proposed shard row, if one is given
    return policy_from_rows(
        tenants=tenant_rows.values(),
        subtenants=subs,
        shards=shard_rows.values(),
        classes=LatencyClass.objects.all(),
        pool=pool if pool is not None else PoolSettings.load(),
    )


def policy_from_rows(
    *,
    tenants: Iterable[Tenant],
    subtenants: dict[str, dict[str, int]],
    shards: Iterable[Shard],
    classes: Iterable[LatencyClass],
    pool: PoolSettings,
) -> PolicySnapshot:
    """The policy these rows (saved or not) make, built through the mappings the sync
    writes to Redis; each tenant's `shard` is one of `shards`."""
    return PolicySnapshot(
        tenants={t.slug: TenantPolicy.from_hash(tenant_policy_mapping(tenant=t)) for t in tenants},
        subtenants=subtenants,
        shards={s.name: ShardPolicy(s.name, s.capacity, 0) for s in shards},
        classes={c.name: ClassPolicy(c.name, c.objective_seconds, c.rank, 0) for c in classes},
        pool=PoolPolicy(
            target_utilisation=pool.target_utilisation,
            f_min=pool.f_min,
            f_max=pool.f_max,
            rate_window_seconds=pool.rate_window_seconds,
            default_job_seconds=pool.default_job_seconds,
            batch_objective_seconds=pool.batch_objective_seconds,
            floor_headroom=pool.floor_headroom,
            quarantine_after_losses=pool.quarantine_after_losses,
            quarantine_poison_losses=pool.quarantine_poison_losses,
            quarantine_slots=pool.quarantine_slots,
            backlog_quota=pool.backlog_quota,
            batch_backlog_quota=pool.batch_backlog_quota,
            submit_rate=pool.submit_rate,
            submit_burst=pool.submit_burst,
            memory_guard_pct=pool.memory_guard_pct,
        ),
    )


def policy_changes(current: PolicySnapshot, proposed: PolicySnapshot) -> tuple[str, ...]:
    """What differs, field by field ("acme.floor 2 -> 8")."""
    out = []
    for slug in sorted(set(current.tenants) | set(proposed.tenants)):
        a, b = current.tenants.get(slug), proposed.tenants.get(slug)
        if a is None or b is None:
            out.append(f"{slug}: {'added' if a is None else 'removed'}")
            continue
        out += [
            f"{slug}.{f} {getattr(a, f)} -> {getattr(b, f)}" for f in TENANT_FIELDS if getattr(a, f) != getattr(b, f)
        ]
    out += [
        f"pool.{f} {getattr(current.pool, f)} -> {getattr(proposed.pool, f)}"
        for f in POOL_FIELDS
        if getattr(current.pool, f) != getattr(proposed.pool, f)
    ]
    for name in sorted(set(current.shards) & set(proposed.shards)):
        if current.shards[name].capacity != proposed.shards[name].capacity:
            out.append(f"{name}.capacity {current.shards[name].capacity} -> {proposed.shards[name].capacity}")
    return tuple(out)


def changes_apply(settings: list[str], *, shard: Shard) -> tuple[list[Tenant], PoolSettings | None, list[Shard]]:
    """Unsaved rows with `settings` ("SLUG.FIELD=VALUE", "pool.FIELD=VALUE",
    "shard.FIELD=VALUE" for `shard`) applied and validated like the admin's forms."""
    tenants: dict[str, Tenant] = {}
    pool: PoolSettings | None = None
    shard_row: Shard | None = None
    for item in settings:
        target, sep, value = item.partition("=")
        owner, dot, name = target.strip().rpartition(".")
        if not sep or not dot or not owner or not name:
            raise WhatIfError(f"--set {item!r}: write SLUG.FIELD=VALUE, pool.FIELD=VALUE or shard.FIELD=VALUE.")
        row: Tenant | PoolSettings | Shard
        allowed: tuple[str, ...]
        if owner == "pool":
            pool = pool or PoolSettings.load()
            row, allowed = pool, POOL_FIELDS
        elif owner == "shard":
            shard_row = shard_row or Shard.objects.get(pk=shard.pk)
            row, allowed = shard_row, SHARD_FIELDS
        else:
            if owner not in tenants:
                found = Tenant.objects.select_related("shard").filter(slug=owner).first()
                if found is None:
                    raise WhatIfError(f"--set {item!r}: no tenant {owner!r}.")
                if found.shard_id != shard.pk:
                    raise WhatIfError(
                        f"--set {item!r}: tenant {owner} is on shard {found.shard.name}, not {shard.name}."
                    )
                tenants[owner] = found
            row, allowed = tenants[owner], TENANT_FIELDS
        if name not in allowed:
            raise WhatIfError(f"--set {item!r}: {name!r} is not one of {', '.join(allowed)}.")
        model_field = row._meta.get_field(name)
        assert isinstance(model_field, Field)  # the allowed names are plain fields
        try:
            text = value.strip()
            parsed = None if text.lower() in ("", "none") and model_field.null else model_field.to_python(text)
            setattr(row, name, parsed)
        except ValidationError as exc:
            raise WhatIfError(f"--set {item!r}: {' '.join(exc.messages)}") from None
    rows: list[Tenant | PoolSettings | Shard] = [*tenants.values()]
    rows += [pool] if pool else []
    rows += [shard_row] if shard_row else []
    for changed in rows:
        try:
            changed.full_clean(exclude=["api_key_prefix", "api_key_hash"])
        except ValidationError as exc:
            raise WhatIfError(f"{changed}: {'; '.join(exc.messages)}") from None
    return list(tenants.values()), pool, [shard_row] if shard_row else []
