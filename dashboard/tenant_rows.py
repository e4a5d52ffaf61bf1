"""The snapshot's tenant rows, kept from one build to the next and remade only for the
tenants whose inputs changed.

A row's inputs: its tenant's policy (a new policy snapshot starts afresh), its signals
(`live.signals_read_many` answers the same object while they stay equal), the tick's
published share, fair share and limit for it (as read), its engine holders, its waiting
and parked cells (fairqueue.jobs.cells: the view keeps a tenant's class dicts while none
of its cells changed), and the pool's slots and jobs in flight, which every limit depends
on. Each build compares each source as a whole first (dict equality, most of it identity
in C) and looks per tenant only into the sources that differ; a change of the pool
recomputes each distinct limit once (the memo) and remakes the rows whose figures moved.
What every build still does per row: a copy of the kept row with its oldest wait's age as
of the build's `now`, and for a tenant with waiting jobs the worst of its classes' oldest
waits against the class's objective (`oldest_wait_ratio`, the batch lane against its own).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fairqueue.jobs import cells, live
from fairqueue.jobs.admission import LiveSignals, tenant_limit_for
from tenants.policy import PolicySnapshot, TenantPolicy

BATCH_CLASS = cells.BATCH_CLASS

Figures = tuple[int, int, float, float]  # floor, limit, rate per minute, mean job seconds
MEMO_SLACK = 1000
LimitsRaw = tuple[dict[str, str], dict[str, str], dict[str, str]]  # shares, fair shares, tick limits


@dataclass
class _Row:
    memo_key: tuple[Any, ...]  # the limit's inputs but the pool: (policy numbers, signals, figures as read)
    figures: Figures
    row: dict[str, Any]  # "oldest_wait_s" and "oldest_wait_ratio" unset
    oldest_ts: float | None  # the tenant's oldest waiting job (batch lane aside)
    waits: tuple[tuple[float, float], ...]  # (oldest job's timestamp, objective) per class with one


@dataclass(frozen=True)
class RowsInputs:
    """Everything the rows are made from, for one build."""

    signals: dict[str, LiveSignals]
    limits_raw: LimitsRaw
    holders: dict[str, int]  # engine tenant key -> held
    view: cells.CellsView
    pool: tuple[int, int]  # (slots, in flight)


def _changed_keys(new: dict[str, Any], old: dict[str, Any]) -> Iterable[str]:
    """Keys whose value differs (by identity: the callers' values are shared while equal,
    so a differing identity is at worst a row remade for nothing), added or removed."""
    if new is old:
        return ()
    old_get = old.get
    changed = [k for k, v in new.items() if old_get(k) is not v]
    changed += [k for k in old.keys() - new.keys()]
    return changed


class TenantRows:
    """The rows of one policy snapshot's tenants (`tenants` in order, `keys` their engine
    keys, `limit_keys` their policy numbers as a shared id, `objectives` each latency
    class's objective in seconds, the batch lane's included)."""

    def __init__(
        self,
        policy: PolicySnapshot,
        tenants: list[TenantPolicy],
        keys: list[str],
        limit_keys: list[int],
        objectives: dict[str, int],
    ) -> None:
        self.policy = policy
        self.objectives = objectives
        self.tenants, self.keys, self.limit_keys = tenants, keys, limit_keys
        self.index = {t.slug: i for i, t in enumerate(tenants)}
        # One tenant per policy numbers: the limit formula reads only those of a tenant.
        self.alike: dict[int, TenantPolicy] = {}
        for t, limit_key in zip(tenants, limit_keys, strict=True):
            self.alike.setdefault(limit_key, t)
        self.key_index = {k: i for i, k in enumerate(keys)}
        self.rows: list[_Row | None] = [None] * len(tenants)
        self.memo: dict[tuple[Any, ...], Figures] = {}
        self.groups: dict[tuple[Any, ...], set[int]] = {}  # memo key -> the rows made with it
        self.last: RowsInputs | None = None

    def build(self, inputs: RowsInputs, *, now: float) -> list[dict[str, Any]]:
        dirty = self._dirty(inputs)
        for i in dirty:
            self._remake(i, inputs)
        self.last = inputs
        if len(self.memo) > 2 * len(self.groups) + MEMO_SLACK:  # figures no row uses any more
            self.memo = {k: self.memo[k] for k in self.groups}
        out: list[dict[str, Any]] = []
        append = out.append
        for kept in self.rows:
            assert kept is not None  # every row is made on the first build
            row = kept.row.copy()
            oldest_ts = kept.oldest_ts
            if oldest_ts is not None:
                age = now - oldest_ts
                row["oldest_wait_s"] = round(age, 3) if age > 0.0 else 0.0
            if kept.waits:
                ratio = max((now - ts) / objective for ts, objective in kept.waits)
                row["oldest_wait_ratio"] = round(ratio, 4) if ratio > 0.0 else 0.0
            append(row)
        return out

    def _dirty(self, new: RowsInputs) -> Iterable[int]:
        old = self.last
        if old is None:
            return range(len(self.tenants))
        dirty: set[int] = set()
        index_get, key_index_get = self.index.get, self.key_index.get
        if new.signals != old.signals:
            dirty.update(i for s in _changed_keys(new.signals, old.signals) if (i := index_get(s)) is not None)
        if new.limits_raw is not old.limits_raw:
            for now_raw, then_raw in zip(new.limits_raw, old.limits_raw, strict=True):
                if now_raw != then_raw:
                    changed = {k for k, _ in now_raw.items() ^ then_raw.items()}
                    dirty.update(i for s in changed if (i := index_get(s)) is not None)
        if new.holders is not old.holders and new.holders != old.holders:
            changed_held = {k for k, _ in new.holders.items() ^ old.holders.items()}
            dirty.update(i for k in changed_held if (i := key_index_get(k)) is not None)
        if new.view is not old.view:
            if new.view.based_on == old.view.serial and new.view.changed is not None:
                dirty.update(i for _, s in new.view.changed if (i := index_get(s)) is not None)
            else:
                for kind in ("t", "p"):
                    changed_cells = _changed_keys(new.view.of_tenants(kind), old.view.of_tenants(kind))
                    dirty.update(i for s in changed_cells if (i := index_get(s)) is not None)
        if new.pool != old.pool:
            # Every limit depends on the pool: each distinct one is computed again, and the
            # rows whose figures it moved are remade.
            memo, self.memo = self.memo, {}
            for memo_key, members in self.groups.items():
                figures = self._figures(memo_key, new.pool)
                if figures != memo.get(memo_key):
                    dirty.update(members)
        return dirty

    def _figures(self, memo_key: tuple[Any, ...], pool: tuple[int, int]) -> Figures:
        figures = self.memo.get(memo_key)
        if figures is None:
            limit_key, rate_per_min, mean_seconds, share, fair_share, tick = memo_key
            slots, in_flight = pool
            tick_limit, tick_held = live.tick_limit_parse(tick)
            breakdown = tenant_limit_for(
                self.policy,
                self.alike[limit_key],
                LiveSignals(
                    rate_per_min=rate_per_min,
                    mean_seconds=mean_seconds,
                    pool_slots=slots,
                    in_flight=in_flight,
                    idle_share=int(share) if share is not None else 0,
                    fair_share=float(fair_share) if fair_share is not None else None,
                    tick_limit=tick_limit,
                    tick_held_elsewhere=tick_held,
                ),
            )
            figures = self.memo[memo_key] = (
                breakdown.floor,
                breakdown.limit,
                round(breakdown.rate_per_min, 3),
                round(breakdown.mean_seconds, 4),
            )
        return figures

    def _remake(self, i: int, inputs: RowsInputs) -> None:
        t = self.tenants[i]
        slug = t.slug
        signals = inputs.signals[slug]
        shares_raw, fair_raw, ticked_raw = inputs.limits_raw
        memo_key = (
            self.limit_keys[i],
            signals.rate_per_min,
            signals.mean_seconds,
            shares_raw.get(slug),
            fair_raw.get(slug),
            ticked_raw.get(slug),
        )
        figures = self._figures(memo_key, inputs.pool)
        old = self.rows[i]
        if old is not None and old.memo_key != memo_key:
            members = self.groups[old.memo_key]
            members.discard(i)
            if not members:
                del self.groups[old.memo_key]
        self.groups.setdefault(memo_key, set()).add(i)
        parked_cells = inputs.view.of_tenants("p").get(slug)
        parked_by_class = {cls: c.waiting for cls, c in parked_cells.items()} if parked_cells else {}
        waiting = 0
        oldest_ts: float | None = None
        waits = []
        for cls, cell in (inputs.view.of_tenants("t").get(slug) or {}).items():
            waiting += cell.waiting
            if cell.oldest_ts is None:
                continue
            objective = self.objectives.get(cls)
            if objective:  # a class no longer in policy has no objective to be measured against
                waits.append((cell.oldest_ts, float(objective)))
            if cls != BATCH_CLASS and (oldest_ts is None or cell.oldest_ts < oldest_ts):
                oldest_ts = cell.oldest_ts
        row = {
            "slug": slug,
            "name": t.name,
            "active": t.active,
            "shard": t.shard,
            "floor": figures[0],
            "limit": figures[1],
            "in_flight": inputs.holders.get(self.keys[i], 0),
            "parked_by_class": parked_by_class,
            "parked": sum(parked_by_class.values()),
            "waiting": waiting,
            "oldest_wait_s": None,  # each build's, as of its `now`
            "oldest_wait_ratio": None,  # likewise
            "rate_per_min": figures[2],
            "mean_job_s": figures[3],
        }
        self.rows[i] = _Row(memo_key, figures, row, oldest_ts, tuple(waits))
