"""The effective limits of outside resources: AIMD state in Redis, shared by the fleet.

A resource (tenants.models.Resource) has a configured limit. Its effective limit starts
there; a refusal (a task raising `fairqueue.Backoff`) multiplies it by the resource's
decrease factor, and each job that succeeds adds `increase_per_success`, once
`recovery_seconds` have passed since the last cut. It never goes below 1 nor above the
configured limit. A refusal with a retry-after also pauses the resource: until then its
key's limit is 0, so nothing new is admitted on it.

Each update is one Lua script on one hash (`fq:{resources}:<name>`), on Redis's clock, so
every worker of the fleet moves the same number. The hash holds the effective limit as a
real number (increases are fractions of a slot), when it was last cut, until when it is
paused, and how many refusals and cuts it has seen. No hash means "at the configured
limit, never refused".

A refusal from a call that started before the last cut says nothing new (that call went
out under the old limit, like the ones that caused the cut): it does not cut again, so a
burst of refusals from calls in flight together is one cut, not one per call.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from tenants.policy import ResourcePolicy
from tenants.redis_client import get_redis

STATE_PREFIX = "fq:{resources}:"

# KEYS[1]: the state hash. ARGV: configured limit, decrease factor, start of the refused
# call (ms, 0 when unknown), retry-after (ms, 0 for none).
# Returns {effective, paused until (ms, 0 if not), 1 if this refusal cut the limit else 0}.
_REFUSE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit, factor = tonumber(ARGV[1]), tonumber(ARGV[2])
local started, wait = tonumber(ARGV[3]), tonumber(ARGV[4])
local r = redis.call('HMGET', KEYS[1], 'effective', 'cut_ms', 'paused_ms')
local eff = math.min(tonumber(r[1]) or limit, limit)
local cut = tonumber(r[2]) or 0
local paused = tonumber(r[3]) or 0
local cutting = 0
if started == 0 or started >= cut then
  eff = math.max(1, eff * factor)
  cut = now
  cutting = 1
end
if wait > 0 and now + wait > paused then paused = now + wait end
redis.call('HSET', KEYS[1], 'effective', string.format('%.6f', eff), 'cut_ms', string.format('%d', cut),
  'paused_ms', string.format('%d', paused))
redis.call('HINCRBY', KEYS[1], 'refusals', 1)
if cutting == 1 then redis.call('HINCRBY', KEYS[1], 'cuts', 1) end
return {string.format('%.6f', eff), string.format('%d', paused), cutting}
"""

# KEYS[1]: the state hash. ARGV: configured limit, increase per success, recovery (ms).
# Returns {effective before, effective after} ({} when the resource has no state: it is
# at its configured limit).
_SUCCEED = """
local r = redis.call('HMGET', KEYS[1], 'effective', 'cut_ms')
if not r[1] then return {} end
local limit, step, recovery = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local was = math.min(tonumber(r[1]), limit)
local eff = was
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if eff < limit and now - (tonumber(r[2]) or 0) >= recovery then
  eff = math.min(limit, eff + step)
  redis.call('HSET', KEYS[1], 'effective', string.format('%.6f', eff))
end
return {string.format('%.6f', was), string.format('%.6f', eff)}
"""


def state_key(name: str) -> str:
    return f"{STATE_PREFIX}{name}"


@dataclass(frozen=True)
class ResourceLimit:
    """One resource as the scheduler sees it now."""

    name: str
    configured: int
    effective: float  # the AIMD number, within 1..configured
    paused_until_ms: int  # Redis time; 0 when not paused
    now_ms: int  # Redis time of the read
    refusals: int = 0
    cuts: int = 0

    @property
    def paused(self) -> bool:
        return self.paused_until_ms > self.now_ms

    @property
    def limit(self) -> int:
        """The key's limit to pass the engine: 0 while paused, else the effective limit in
        whole slots (never below 1 nor above the configured limit)."""
        if self.paused:
            return 0
        return clamp_slots(self.effective, self.configured)


def clamp_slots(effective: float, configured: int) -> int:
    return max(1, min(configured, math.floor(effective + 1e-9)))


def _number(raw: str | None, default: float) -> float:
    try:
        value = float(raw) if raw not in (None, "") else default
    except ValueError:
        return default
    return value if math.isfinite(value) else default


def resource_limits_read(resources: Iterable[ResourcePolicy]) -> dict[str, ResourceLimit]:
    """The state of each resource, in one pipelined round trip (with Redis's clock)."""
    items = list(resources)
    if not items:
        return {}
    client = get_redis()
    pipe = client.pipeline(transaction=False)
    pipe.time()
    for resource in items:
        pipe.hmget(state_key(resource.name), ["effective", "paused_ms", "refusals", "cuts"])
    seconds, micros = (replies := pipe.execute())[0]
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    out: dict[str, ResourceLimit] = {}
    for resource, (effective, paused, refusals, cuts) in zip(items, replies[1:], strict=True):
        out[resource.name] = ResourceLimit(
            name=resource.name,
            configured=resource.limit,
            effective=max(1.0, min(float(resource.limit), _number(effective, resource.limit))),
            paused_until_ms=int(_number(paused, 0)),
            now_ms=now_ms,
            refusals=int(_number(refusals, 0)),
            cuts=int(_number(cuts, 0)),
        )
    return out


@dataclass(frozen=True)
class Refusal:
    effective: float
    paused_until_ms: int
    cut: bool


def resource_refused(resource: ResourcePolicy, *, started_ms: int | None, retry_after_seconds: float | None) -> Refusal:
    """Record a refusal: cut the effective limit (unless the refused call started before the
    last cut) and pause the resource for `retry_after_seconds` if given."""
    script = get_redis().register_script(_REFUSE)
    wait_ms = max(0, round((retry_after_seconds or 0) * 1000))
    effective, paused, cut = script(
        keys=[state_key(resource.name)],
        args=[resource.limit, repr(float(resource.decrease_factor)), int(started_ms or 0), wait_ms],
    )
    return Refusal(effective=float(effective), paused_until_ms=int(paused), cut=bool(int(cut)))


def resource_succeeded(resource: ResourcePolicy) -> tuple[float, float]:
    """Record a success: the additive increase (after the recovery time). Returns the
    effective limit before and after it."""
    script = get_redis().register_script(_SUCCEED)
    raw = script(
        keys=[state_key(resource.name)],
        args=[
            resource.limit,
            repr(float(resource.increase_per_success)),
            round(resource.recovery_seconds * 1000),
        ],
    )
    if not raw:
        return float(resource.limit), float(resource.limit)
    return float(raw[0]), float(raw[1])


def resource_limits_reset(name: str) -> None:
    """Forget a resource's state: back at its configured limit (tests, an operator's reset)."""
    get_redis().delete(state_key(name))
