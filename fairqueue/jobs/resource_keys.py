"""Pushes the key limits of outside resources to the engine: where one changed (a cut, a
recovered slot, a pause that ended), parked jobs must learn it without waiting for the
next admit on that key.

Admits carry each resource key's limit like every other (fairqueue.jobs.dispatch), so a
push is needed only where nothing is admitted: a cut must be stored before the refused
job's release hands its slot on, and a raised limit (or the end of a pause) must wake
waiters that would otherwise wait for the next release. The tick pushes every resource
to every shard's tag once a second, which also ends pauses within a second.
"""

from __future__ import annotations

from collections.abc import Iterable

from fairqueue.jobs.admission import resource_key, shard_tag
from fairqueue.jobs.dispatch import outcomes_handle
from fairqueue.jobs.runtime import engine
from tenants.policy import PolicySnapshot, ResourcePolicy, policy_snapshot
from tenants.resource_limits import resource_limits_read


def resource_limits_push(resources: Iterable[ResourcePolicy], tags: Iterable[str]) -> int:
    """Set each resource key's limit now on each tag (one call per tag); dispatch whoever
    a raised limit woke. Returns how many jobs were woken."""
    states = resource_limits_read(resources)
    if not states:
        return 0
    limits = {resource_key(name): state.limit for name, state in states.items()}
    woken = 0
    for tag in dict.fromkeys(tags):
        # An unready tag (state lost, rebuild pending) is left alone, as limits_refresh does.
        result = engine().set_limits(tag=tag, limits=limits, require_ready=True)
        if result:
            outcomes_handle(woken=result, reclaimed=[])
            woken += len(result)
    return woken


def resource_limits_refresh(policy: PolicySnapshot | None = None) -> int:
    """The tick's duty: every resource's limit on every shard's tag."""
    policy = policy or policy_snapshot()
    if not policy.resources:
        return 0
    tags = [shard_tag(name) for name in sorted(policy.shards)]
    return resource_limits_push(policy.resources.values(), tags)
