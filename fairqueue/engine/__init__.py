"""FairQueue's throttle engine: atomic multi-key admission with fair waiter queues,
direct slot handoff and leases, in Redis Lua.

A standalone library: it knows keys, limits, priorities, flows (opaque strings with
weights, for the fair order of a key's waiters) and leases, nothing about tenants or Django.
"""

from .engine import AsyncEngine, Engine
from .keys import KEY_NAMES, tag_keys
from .results import (
    Admission,
    AdmitRequest,
    CancelResult,
    JobState,
    KeyLimit,
    KeysArg,
    KeyState,
    ReclaimResult,
    ReleaseResult,
    TagHealth,
    Woken,
)
from .sweeper import Sweeper

__all__ = [
    "KEY_NAMES",
    "Admission",
    "AdmitRequest",
    "AsyncEngine",
    "CancelResult",
    "Engine",
    "JobState",
    "KeyLimit",
    "KeyState",
    "KeysArg",
    "ReclaimResult",
    "ReleaseResult",
    "Sweeper",
    "TagHealth",
    "Woken",
    "tag_keys",
]
