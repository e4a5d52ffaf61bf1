"""Every tenant's limit at today's load under two policies, for a preview of a policy change
(`manage.py policy apply --dry-run`): the duty tick's limits plan (fair and idle shares and
the formula, fairqueue.jobs.limits_plan) on the live signals, holders and pool it reads.
What it leaves out: the shard caps, which depend on the tick's own recent history."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fairqueue.jobs import live
from fairqueue.jobs.admission import shard_tag, tenant_key
from fairqueue.jobs.limits_plan import limits_plan
from fairqueue.jobs.runtime import engine
from tenants.policy import PolicySnapshot


@dataclass(frozen=True)
class LimitChange:
    tenant: str
    before: int | None  # None: not in that policy
    after: int | None
    rate_per_min: float
    held: int


def limits_compare(current: PolicySnapshot, proposed: PolicySnapshot) -> tuple[list[LimitChange], int]:
    """The tenants whose limit differs between the two policies at today's load, and the
    pool's live slots it was computed on."""
    fleet = live.fleet_state(max_age=0.0)
    slugs = sorted(set(current.tenants) | set(proposed.tenants))
    signals = live.signals_read_many(slugs, fleet=fleet)
    # What each tenant holds now, at the shard it is on now.
    grouped: dict[str, list[str]] = {}
    for tp in current.tenants.values():
        grouped.setdefault(shard_tag(tp.shard), []).append(tenant_key(tp.slug))
    keys_of: dict[str, Sequence[str]] = dict(grouped)
    counts = engine().counts_many(keys_of)
    held = {tp.slug: counts.get(shard_tag(tp.shard), {}).get(tenant_key(tp.slug), 0) for tp in current.tenants.values()}
    limits = []
    for policy in (current, proposed):
        plan = limits_plan(
            policy=policy,
            signals={slug: signals[slug] for slug in policy.tenants},
            held=held,
            slots=fleet.slots,
            in_flight=fleet.in_flight + fleet.batch_in_flight,
        )
        limits.append({slug: plan.limit(slug) for slug in plan.breakdowns})
    before, after = limits
    changes = [
        LimitChange(
            tenant=slug,
            before=before.get(slug),
            after=after.get(slug),
            rate_per_min=signals[slug].rate_per_min,
            held=held.get(slug, 0),
        )
        for slug in slugs
        if before.get(slug) != after.get(slug)
    ]
    return changes, fleet.slots
