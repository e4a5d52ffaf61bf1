"""Typed arguments and results of engine operations (plain dataclasses, no Redis types)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True)
class KeyLimit:
    """A key a job needs and the limit its caller computed for it, for this call.

    ``flow`` and ``weight`` place the job in the key's fair order when it has to wait there:
    the key's waiters are served by priority, then fairly across their flows in proportion
    to the flows' weights, FIFO within a flow (docs/engine.md, "Fair order"). Flows are
    opaque strings (FairQueue: the tenant, on a shard key); the default flow ``""`` at
    weight 1 for every job gives first-come first-served order. A job's weight counts for
    this key and this job only, like its limit.

    ``reserve`` keeps ``min(reserve, limit)`` of the key's slots for jobs within their
    guarantee; like the limit it is the key's state while the key is in use, set by every
    call that passes the limit (0 when not given) and forgotten when the key goes idle.
    ``guard`` names another key of the same job that sorts before this one, and
    ``guarantee`` bounds its holder count: the job is *within its guarantee* at this key
    when the guard's holder count, this job included, is at most ``guarantee`` (never
    without a guard). Such a job may take the reserved slots, and when it has to wait it
    waits in the key's floor band, served before every other waiter (docs/engine.md,
    "Reserves and guarantees"). ``guard`` and ``guarantee`` describe the job: ``set_limits``
    takes limits and reserves only."""

    name: str
    limit: int
    flow: str = ""
    weight: float = 1.0
    reserve: int = 0
    guard: str | None = None
    guarantee: int = 0


#: Keys of a job with their limits: ``{"t:1": 5}`` or ``[KeyLimit("t:1", 5)]`` or ``[("t:1", 5)]``
#: (KeyLimits may also carry a flow and weight, ``KeyLimit("s:1", 40, "acme", 2.0)``, and a
#: reserve, guard and guarantee, ``KeyLimit("s:1", 40, reserve=4, guard="t:1", guarantee=2)``).
KeysArg = Mapping[str, int] | Iterable[KeyLimit | tuple[str, int]]


class TagHealth(StrEnum):
    """Whether a tag's state can be trusted (``Engine.tags_health``).

    ``READY``: marked ready by the server that holds it now. ``NOT_READY``: never marked, or
    its state was lost (a flush, a restart without persistence): rebuild it. ``FOREIGN``:
    marked ready, but by another server or before a break in this server's history (a
    replica promoted after a failover, a restart from an older snapshot): it may lack the
    last acknowledged writes, so throw it away and rebuild it."""

    READY = "ready"
    NOT_READY = "not_ready"
    FOREIGN = "foreign"


@dataclass(frozen=True)
class Woken:
    """A job that now holds every key it needs: the caller must dispatch it (or, for a
    reclaimed job, re-deliver it). ``data`` is the opaque string given at admit."""

    job_id: str
    data: str


@dataclass(frozen=True)
class Admission:
    """Outcome of an admit. ``parked_on``/``position`` (1-based) are set when parked;
    ``duplicate`` means the job was already known and its current state is reported;
    ``not_ready`` means ``require_ready`` was set and the tag is not ready (its state was
    lost and not rebuilt yet): nothing was stored for this job, even if the tag knew it (the
    call may still have reclaimed expired leases: see ``reclaimed``, ``woken``); the caller
    must admit the job later."""

    job_id: str
    admitted: bool
    parked_on: str | None
    position: int | None
    woken: list[Woken] = field(default_factory=list)
    reclaimed: list[Woken] = field(default_factory=list)
    duplicate: bool = False
    not_ready: bool = False


@dataclass(frozen=True)
class ReleaseResult:
    """Outcome of a release: ``found`` is False for an unknown job (already released or
    reclaimed). ``woken`` jobs were admitted by this call and must be dispatched."""

    found: bool
    woken: list[Woken] = field(default_factory=list)
    reclaimed: list[Woken] = field(default_factory=list)


@dataclass(frozen=True)
class CancelResult:
    """Outcome of a cancel: only a parked job can be cancelled."""

    cancelled: bool
    woken: list[Woken] = field(default_factory=list)
    reclaimed: list[Woken] = field(default_factory=list)


@dataclass(frozen=True)
class ReclaimResult:
    """Jobs whose lease ran out (to re-deliver) and the jobs their slots went to."""

    reclaimed: list[Woken] = field(default_factory=list)
    woken: list[Woken] = field(default_factory=list)


@dataclass(frozen=True)
class KeyState:
    """A key as dashboards see it. ``limit`` is None while the key is idle (no holders, no
    waiters: it forgets its limit, and the next job to use it brings one) or was never used;
    ``reserve`` is its effective reserve (``min(reserve, limit)``; 0 when none or idle);
    ``waiters_by_priority`` maps priority -> parked count (highest first, both bands
    together), of which ``floor_waiting`` wait in the floor band (parked within their
    guarantee). ``holders`` is only filled when asked for (``inspect_key(holders=True)``,
    the default); ``held`` is the holder count either way."""

    key: str
    limit: int | None
    holders: list[str]
    waiters_by_priority: dict[int, int]
    waiting: int
    held_count: int | None = None
    reserve: int = 0
    floor_waiting: int = 0

    @property
    def held(self) -> int:
        """Number of holders."""
        return len(self.holders) if self.held_count is None else self.held_count


@dataclass(frozen=True)
class JobState:
    """A job as the engine knows it. ``status`` is "admitted", "parked" or "unknown"."""

    job_id: str
    status: str
    held_keys: list[str]
    parked_on: str | None
    position: int | None
    lease_expires_ms: int | None
    priority: int | None
    data: str | None


@dataclass(frozen=True)
class AdmitRequest:
    """One admit of a bulk ``admit_many``; same fields as ``admit``'s keywords."""

    tag: str
    job_id: str
    keys: KeysArg
    lease_seconds: float
    priority: int = 0
    data: str = ""
    require_ready: bool = False
