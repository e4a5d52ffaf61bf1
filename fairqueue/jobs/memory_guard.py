"""The memory guard: before the engine's Redis reaches its maxmemory, new waiting jobs are
refused, the tenants with the largest backlogs first.

Past `memory_guard_pct` of maxmemory (a pool setting) the guard is on and sets a cap on a
tenant's waiting jobs: the largest backlog of any tenant, scaled down linearly to 0 as the
memory goes from the threshold to maxmemory. Just past the threshold only the largest
backlog is refused more; nearer maxmemory, every tenant with a backlog. A submit whose
tenant would pass the cap answers 429 (fairqueue.jobs.quotas, checked in the same atomic
call as the quotas), unless the tenant runs below its floor: its floor stays what it can
count on. Jobs already accepted are never refused; nothing is evicted.

The duty tick computes the cap (`memory_guard_step`) and stores it under GUARD_KEY with a
short expiry, so a guard nobody refreshes lapses instead of refusing forever. A server
without maxmemory has no guard.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from fairqueue.jobs import cells
from fairqueue.jobs.runtime import redis_client
from tenants.policy import policy_snapshot

GUARD_KEY = cells.PREFIX + "guard"  # read by lua/cells.lua ("guard" check)
# A few duty ticks: the cap lapses this long after the last tick that set it.
GUARD_TTL_MS = 5000
GUARD_OFF_PCT = 100.0  # a threshold of 100% never guards
# The duty reads the memory at most this often (every tick would be four reads a second of
# a figure that moves slowly), well within GUARD_TTL_MS.
GUARD_READ_SECONDS = 1.0


@dataclass(frozen=True)
class GuardState:
    """The engine Redis's memory and the guard's state, for /metrics and the dashboard."""

    used_bytes: int
    max_bytes: int  # 0: no maxmemory set (no guard)
    threshold_pct: float
    cap: int | None  # the most jobs a tenant may have waiting while the guard is on

    @property
    def active(self) -> bool:
        return self.cap is not None

    @property
    def headroom_bytes(self) -> int | None:
        """Bytes left before the guard starts refusing (None: no maxmemory)."""
        if not self.max_bytes:
            return None
        return max(0, math.floor(self.max_bytes * self.threshold_pct / 100) - self.used_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "used_bytes": self.used_bytes,
            "max_bytes": self.max_bytes,
            "used_ratio": round(self.used_bytes / self.max_bytes, 4) if self.max_bytes else None,
            "threshold_pct": self.threshold_pct,
            "headroom_bytes": self.headroom_bytes,
            "guard_active": self.active,
            "guard_cap": self.cap,
        }


def guard_cap(*, used: int, maxmemory: int, threshold_pct: float, largest: int) -> int | None:
    """The guard's cap on a tenant's waiting jobs (None: the guard is off): `largest` (the
    largest backlog) scaled down linearly from the threshold to maxmemory, so the largest
    backlogs are refused first."""
    if maxmemory <= 0 or threshold_pct >= GUARD_OFF_PCT:
        return None
    threshold = maxmemory * threshold_pct / 100
    if used < threshold:
        return None
    level = min(1.0, (used - threshold) / max(1.0, maxmemory - threshold))
    return max(0, math.floor(largest * (1.0 - level)))


def engine_memory() -> tuple[int, int]:
    """(used_memory, maxmemory) of the engine's Redis; of a Redis Cluster, those of the
    node nearest its maxmemory (the first to refuse writes)."""
    info: dict[str, Any] = redis_client().info("memory")  # type: ignore[assignment]  # sync client
    nodes = [v for v in info.values() if isinstance(v, dict)] or [info]
    figures = [(int(n.get("used_memory", 0)), int(n.get("maxmemory", 0))) for n in nodes]
    return max(figures, key=lambda f: f[0] / f[1] if f[1] else 0.0)


_view: cells.CellsView | None = None
_last_step = float("-inf")  # monotonic time of this process's last read
_set_here = False  # this process set the cap (so lifting it is its to do; others' expire)


def _largest_backlog() -> int:
    global _view
    _view = cells.cells_refresh(_view)
    by_tenant = _view.of_tenants("t")
    return max((sum(c.waiting for c in classes.values()) for classes in by_tenant.values()), default=0)


def memory_guard_step() -> GuardState | None:
    """The duty: read the engine's memory, set the guard's cap (or lift it); at most once per
    GUARD_READ_SECONDS (None when it did not read now)."""
    global _last_step, _set_here
    now = time.monotonic()
    if now - _last_step < GUARD_READ_SECONDS:
        return None
    _last_step = now
    pool = policy_snapshot().pool
    used, maxmemory = engine_memory()
    cap = None
    if maxmemory > 0 and used >= maxmemory * pool.memory_guard_pct / 100:
        cap = guard_cap(used=used, maxmemory=maxmemory, threshold_pct=pool.memory_guard_pct, largest=_largest_backlog())
    client = redis_client()
    if cap is not None:
        client.set(GUARD_KEY, cap, px=GUARD_TTL_MS)
        _set_here = True
    elif _set_here:
        client.delete(GUARD_KEY)
        _set_here = False
    return GuardState(used, maxmemory, pool.memory_guard_pct, cap)


def guard_state() -> GuardState:
    """The memory and the guard as they are now (one INFO and one GET)."""
    pool = policy_snapshot().pool
    used, maxmemory = engine_memory()
    raw = redis_client().get(GUARD_KEY)
    return GuardState(used, maxmemory, pool.memory_guard_pct, int(raw) if raw is not None else None)


def memory_guard_forget() -> None:
    """Read the memory at the next step whenever it comes (tests, which change maxmemory)."""
    global _last_step
    _last_step = float("-inf")
