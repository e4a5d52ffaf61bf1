"""The periodic limit decision for every tenant, as a pure function of policy and signals.

The duty tick (`fairqueue.jobs.duties.limits_refresh`) reads the live signals and the
engine's counts, calls `limits_plan` and pushes the result to the engine; the what-if
simulation (`fairqueue.simulation.scheduler`) calls it with simulated signals and counts.
One function, so a replay predicts what the fleet would do, term for term.

The steps (the formulas themselves are in tenants.limits):
1. every tenant's ceiling (capped at its hard max) is its demand in a max-min fair share of
   the pool target (`fair_shares`), below which pressure never squeezes it;
2. its formula limit with that fair share and no idle share;
3. tenants holding at least their formula limit (and not capped by their hard max) share
   the unheld slots (`idle_shares`), never past what their shard can run;
4. where a shard's capacity binds, the tenants that want more than their fair share of it
   are capped (`caps_for`: the tick reads the shard's waiters for it; tenants.limits.shard_caps);
5. the limit with both shares and the cap (`tenant_limit_for`, which also caps at the shard).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from fairqueue.jobs.admission import LiveSignals, tenant_limit_for
from tenants.limits import LimitBreakdown, fair_shares, idle_shares
from tenants.policy import PolicySnapshot, TenantPolicy

# Unheld slots are shared out up to slots * (1 + OVERCOMMIT): a job in transit to a worker
# holds a slot it is not yet using, and without a little overcommit workers would idle.
OVERCOMMIT = 0.125


@dataclass(frozen=True)
class LimitsPlan:
    """One tick's decision: each tenant's shares, the signals with them, and its limit."""

    fair: dict[str, float]
    idle: dict[str, int]
    signals: dict[str, LiveSignals]  # the inputs with idle_share and fair_share filled in
    breakdowns: dict[str, LimitBreakdown]  # tenants of known shards only
    caps: dict[str, int] = field(default_factory=dict)  # shard caps, where a shard binds

    def limit(self, slug: str) -> int:
        return self.breakdowns[slug].limit


class _Memo:
    """`tenant_limit_for` and the signals with shares, computed once per distinct input.

    A breakdown depends on the tenant's policy numbers (not its slug or name) and its
    signals. Signals are keyed by identity (hashing a dataclass by value costs more than
    the formula): the caller's dicts keep them alive for the call, and the memo keeps every
    signals object it made, so an id is never reused while the memo lives. The tick passes
    one object for tenants with equal signals (fairqueue.jobs.live interns them).
    """

    def __init__(self, policy: PolicySnapshot) -> None:
        self.policy = policy
        self._breakdowns: dict[tuple[object, ...], LimitBreakdown] = {}
        self._signals: dict[tuple[int, int, float | None], LiveSignals] = {}
        self._capped: dict[tuple[int, int, int | None], LiveSignals] = {}

    def breakdown(self, tp: TenantPolicy, signals: LiveSignals) -> LimitBreakdown:
        key = (tp.shard, tp.floor, tp.burst_floor, tp.burst_pct, tp.max_concurrency, tp.dedicated, id(signals))
        found = self._breakdowns.get(key)
        if found is None:
            found = self._breakdowns[key] = tenant_limit_for(self.policy, tp, signals)
        return found

    def signals(self, signals: LiveSignals, *, idle_share: int, fair_share: float | None) -> LiveSignals:
        key = (id(signals), idle_share, fair_share)
        found = self._signals.get(key)
        if found is None:
            found = self._signals[key] = dataclasses.replace(signals, idle_share=idle_share, fair_share=fair_share)
        return found

    def with_share_and_cap(self, signals: LiveSignals, *, idle_share: int, shard_cap: int | None) -> LiveSignals:
        key = (id(signals), idle_share, shard_cap)
        found = self._capped.get(key)
        if found is None:
            found = self._capped[key] = dataclasses.replace(signals, idle_share=idle_share, shard_cap=shard_cap)
        return found


def limits_plan(
    *,
    policy: PolicySnapshot,
    signals: dict[str, LiveSignals],
    held: dict[str, int],
    slots: int,
    in_flight: int,
    caps_for: Callable[[dict[str, int]], dict[str, int]] | None = None,
) -> LimitsPlan:
    """Decide every tenant's limit. `signals` has an entry per tenant of the policy (its
    idle and fair shares are ignored), `held` the holders of each tenant's key, `slots` the
    pool's live slots and `in_flight` every job holding a slot, batch included. `caps_for`,
    given each tenant's formula limit, returns the shard caps (none when not given)."""
    # A ceiling depends on neither share: the signals as given serve for step 1. (The
    # what-if calls this every simulated half second, the tick with ten thousand tenants:
    # tenants alike in policy and signals, most idle ones, share one computation.)
    memo = _Memo(policy)
    ceilings = {}
    for slug, tp in policy.tenants.items():
        ceiling = memo.breakdown(tp, signals[slug]).ceiling
        ceilings[slug] = min(ceiling, tp.max_concurrency) if tp.max_concurrency is not None else ceiling
    fair = fair_shares(
        pool_target=slots * policy.pool.target_utilisation,
        demand=ceilings,
        weight=dict.fromkeys(policy.tenants, 1.0),  # max-min: every tenant alike; floors hold anyway
    )
    members = [tp for tp in policy.tenants.values() if tp.shard in policy.shards]
    planned = dict(signals)
    formulas: dict[str, LimitBreakdown] = {}
    for tp in members:
        planned[tp.slug] = memo.signals(signals[tp.slug], idle_share=0, fair_share=fair.get(tp.slug))
        formulas[tp.slug] = memo.breakdown(tp, planned[tp.slug])
    capped = {
        tp.slug
        for tp in members
        if tp.max_concurrency is not None and formulas[tp.slug].limit >= tp.max_concurrency + tp.dedicated
    }
    at_limit = {
        slug: (held.get(slug, 0), formula.limit)
        for slug, formula in formulas.items()
        if held.get(slug, 0) >= formula.limit and slug not in capped
    }
    shares = idle_shares(slots=slots, in_flight=in_flight, overcommit=OVERCOMMIT, demand=at_limit)
    # An idle share never lifts a limit past what the tenant's shard can run: where the
    # shard key binds, slots the pool has free are of no use to its tenants.
    for slug, share in shares.items():
        capacity = policy.shards[policy.tenants[slug].shard].capacity
        shares[slug] = max(0, min(share, capacity - formulas[slug].limit))
    caps = caps_for({slug: formula.limit for slug, formula in formulas.items()}) if caps_for else {}
    breakdowns = {}
    for tp in members:
        share = shares.get(tp.slug, 0)
        cap = caps.get(tp.slug)
        if share or cap is not None:
            planned[tp.slug] = memo.with_share_and_cap(planned[tp.slug], idle_share=share, shard_cap=cap)
            breakdowns[tp.slug] = memo.breakdown(tp, planned[tp.slug])
        else:  # the formula's own decision stands
            breakdowns[tp.slug] = formulas[tp.slug]
    return LimitsPlan(fair=fair, idle=shares, signals=planned, breakdowns=breakdowns, caps=caps)
