"""Argument validation/encoding and result decoding shared by Engine and AsyncEngine.

Each builder returns a ``Call``: which operation, with which KEYS and ARGV, and how to
turn the raw reply into a result. The sync and async engines only differ in how they send
it. Replies are flat (nested Lua tables cost the server measurably per call) and the
common outcomes are a bare integer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Generic, NamedTuple, TypeVar

from .keys import tag_keys
from .results import (
    Admission,
    CancelResult,
    JobState,
    KeyLimit,
    KeysArg,
    KeyState,
    ReclaimResult,
    ReleaseResult,
    Woken,
)

T = TypeVar("T")

MAX_PRIORITY = 250
#: A spec stores a job's key count and position as single bytes (SPEC_N, SPEC_NK in
#: lua/_lib.lua); 16 is far more than any real job needs (FairQueue uses three).
MAX_KEYS_PER_JOB = 16
#: Expired leases reclaimed inline by admit/release/cancel (the sweep does the rest): the
#: value of RECLAIM_BATCH in lua/_lib.lua, which is what the Lua uses.
INLINE_RECLAIM = 8
#: The cost of one job of weight 1 in a key's fair order: a waiter's virtual finish tag is
#: its start tag plus DEFAULT_COST / weight (DEFAULT_COST in lua/_lib.lua, which is what the
#: Lua uses for the default flow). Costs are whole numbers from 1 (a weight of 2**20 or
#: more) to MAX_COST (a weight of 2**-16 or less): weights outside that range order like
#: its ends.
DEFAULT_COST = 1 << 20
MAX_COST = 1 << 36
#: Width of the spec's lease field (bytes SPEC_TAIL..SPEC_LEASE_END in lua/_lib.lua): an
#: admit sends its lease zero-padded to it and the Lua stores it as given.
LEASE_DIGITS = 10


@dataclass(frozen=True)
class Call(Generic[T]):
    """One operation (a function of the engine's library) and the decoder of its reply."""

    script: str
    keys: tuple[str, ...]
    args: tuple[str | int, ...]
    decode: Callable[[Any], T]


def text(value: Any) -> str:
    """Replies are bytes unless the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _woken(flat: list[Any]) -> list[Woken]:
    return [Woken(text(flat[i]), text(flat[i + 1])) for i in range(0, len(flat), 2)]


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not job_id:
        raise ValueError("job_id must be a non-empty string")
    if "\0" in job_id:
        raise ValueError(f"job_id must not contain \\0: {job_id!r}")
    return job_id


_RESERVED_CHARS = re.compile("[\\0\\1\\2\\3]")  # the scripts' field separators


def _check_key_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"key names must be non-empty strings, got {name!r}")
    if _RESERVED_CHARS.search(name):
        raise ValueError(f"key names must not contain \\0, \\1, \\2 or \\3: {name!r}")
    return name


#: Longest lease: its milliseconds fill the spec's fixed-width field (about 115 days).
MAX_LEASE_MS = 10**LEASE_DIGITS - 1


def lease_ms(lease_seconds: float) -> int:
    """Leases travel in milliseconds (the resolution of the engine's clock)."""
    if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, int | float) or not lease_seconds > 0:
        raise ValueError(f"lease_seconds must be > 0, got {lease_seconds!r}")
    ms = max(1, round(lease_seconds * 1000))
    if ms > MAX_LEASE_MS:
        raise ValueError(f"lease_seconds must be at most {MAX_LEASE_MS // 1000}, got {lease_seconds!r}")
    return ms


def _check_flow(flow: object) -> str:
    if not isinstance(flow, str):
        raise ValueError(f"flows must be strings, got {flow!r}")
    if "\0" in flow or "\1" in flow:
        raise ValueError(f"flows must not contain \\0 or \\1: {flow!r}")
    return flow


def flow_cost(weight: float) -> int:
    """A job's cost in its flow's fair order: DEFAULT_COST / weight, whole, clamped to
    1..MAX_COST (the Lua adds it to the job's virtual start tag)."""
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"weights must be finite numbers > 0, got {weight!r}")
    return max(1, min(MAX_COST, round(DEFAULT_COST / weight)))


class KeySpec(NamedTuple):
    """One key of a job as the engine takes it (``key_specs``): ``cost`` is its flow's
    (``flow_cost`` of the weight), ``reserve`` the effective one (``min(reserve, limit)``),
    ``guard`` the name of an earlier key of the job or None."""

    name: str
    limit: int
    flow: str
    cost: int
    reserve: int
    guard: str | None
    guarantee: int


def _check_count(what: str, name: str, value: object) -> int:
    """A key's limit, reserve or guarantee: an int >= 0. The error's text is built only for
    a bad value: every admit checks three per key."""
    if type(value) is int and value >= 0:
        return value
    return _check_int(f"{what} of {name!r}", value, 0)


def _check_guard(name: str, guard: object, guarantee: int, job: bool) -> None:
    if not job:
        raise ValueError(f"set_limits takes limits and reserves; a guard and guarantee belong to a job ({name!r})")
    if guard is not None and not isinstance(guard, str):
        raise ValueError(f"the guard of {name!r} must be a key name, got {guard!r}")
    if guard is None:
        raise ValueError(f"a guarantee needs a guard: {name!r} has guarantee {guarantee} and no guard")


_BY_NAME = itemgetter(0)
_new_spec = tuple.__new__  # KeySpec(...) through its generated __new__ costs an admit ~0.2 µs a key


def key_specs(keys: KeysArg, *, allow_empty: bool = False, job: bool = True) -> list[KeySpec]:
    """Validated ``KeySpec``s in canonical (sorted) order.

    Sorting here gives every job the same key order, which is what rules out deadlock;
    the scripts trust it. ``job=False`` (``set_limits``: limits and reserves only) refuses
    guards and guarantees, which describe a job."""
    items: Iterable[Any] = keys.items() if isinstance(keys, Mapping) else keys
    specs: list[KeySpec] = []
    guarded = False
    for item in items:
        if isinstance(item, KeyLimit):
            name, limit, flow, weight = item.name, item.limit, item.flow, item.weight
            reserve, guard, guarantee = item.reserve, item.guard, item.guarantee
            name = _check_key_name(name)
            if reserve or reserve.__class__ is not int:
                reserve = _check_count("reserve", name, reserve)
            if guarantee or guarantee.__class__ is not int or guard is not None:
                guarantee = _check_count("guarantee", name, guarantee)
                _check_guard(name, guard, guarantee, job)
                guarded = True
        else:
            name, limit = item
            name = _check_key_name(name)
            flow, weight, reserve, guard, guarantee = "", 1.0, 0, None, 0
        limit = _check_count("limit", name, limit)
        spec = (
            name,
            limit,
            _check_flow(flow),
            flow_cost(weight),
            reserve if reserve < limit else limit,
            guard,
            guarantee,
        )
        specs.append(_new_spec(KeySpec, spec))
    if not specs and not allow_empty:
        raise ValueError("a job needs at least one key")
    names = [spec[0] for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate keys: {sorted(names)}")
    if guarded:
        for spec in specs:
            if spec.guard is not None and (spec.guard not in names or not spec.guard < spec.name):
                raise ValueError(
                    f"the guard of {spec.name!r} must be another key of the job that sorts before it,"
                    f" got {spec.guard!r}"
                )
    specs.sort(key=_BY_NAME)
    return specs


def limit_arg(spec: KeySpec) -> str | int:
    """A key's limit as the scripts take it: the limit, or "L:R" with its reserve (lr in
    lua/_lib.lua), so a limit and its reserve are stored, compared and forgotten together."""
    return f"{spec.limit}:{spec.reserve}" if spec.reserve else spec.limit


def flows_arg(specs: list[KeySpec]) -> str:
    """The admit's flows argument (key_arg in lua/_lib.lua): "" when every key has the
    default flow "" at the default cost and no reserve or guard (the scripts then read the
    limits as plain numbers); else flow "\\1" cost per key, then "\\1" guard index (1-based,
    in key order) "\\1" guarantee for a key with a guard, joined by "\\0" in key order."""
    if all(
        flow == "" and cost == DEFAULT_COST and not reserve and guard is None
        for _, _, flow, cost, reserve, guard, _ in specs
    ):
        return ""
    parts: list[str] = []
    index: dict[str, int] = {}
    for _, _, flow, cost, _, guard, guarantee in specs:
        if guard is None:
            parts.append(f"{flow}\1{cost}")
        else:
            index = index or {spec[0]: i for i, spec in enumerate(specs, 1)}
            parts.append(f"{flow}\1{cost}\1{index[guard]}\1{guarantee}")
    return "\0".join(parts)


def _flatten(specs: list[KeySpec]) -> list[str | int]:
    flat: list[str | int] = []
    for spec in specs:
        flat += [spec[0], limit_arg(spec)]
    return flat


#: The shared part of an admit's ARGV (priority, lease, require_ready, flows, then key,
#: limit pairs, each limit with its reserve): what ``admit_shape`` encodes once for jobs alike.
Shape = tuple[str | int, ...]


def admit_shape(keys: KeysArg, *, priority: int, lease_seconds: float, require_ready: bool = False) -> Shape:
    """Validate and encode what an admit's ARGV holds besides the job id and its data:
    priority, lease, require_ready, flows (with guards) and the key, limit pairs (limits
    with their reserves; lua/admit_job.lua)."""
    _check_int("priority", priority, 0, MAX_PRIORITY)
    specs = key_specs(keys)
    if len(specs) > MAX_KEYS_PER_JOB:
        raise ValueError(f"a job may have at most {MAX_KEYS_PER_JOB} keys, got {len(specs)}")
    lease = str(lease_ms(lease_seconds)).zfill(LEASE_DIGITS)
    return (priority, lease, 1 if require_ready else 0, flows_arg(specs), *_flatten(specs))


def _check_data(data: object) -> str:
    if not isinstance(data, str):
        raise ValueError("data must be a string")
    return data


def _admission(job_id: str, r: Any) -> Admission:
    """Decode one admit's reply (lua/admit_job.lua)."""
    if isinstance(r, int):  # admitted, nothing else to report
        return Admission(job_id, True, None, None, [], [], False, False)
    admitted, not_ready = bool(r[0]), bool(r[4])
    woken, reclaimed = _split(r, 5)
    return Admission(
        job_id=job_id,
        admitted=admitted,
        parked_on=None if admitted or not_ready else text(r[1]),
        position=None if admitted or not_ready else int(r[2]),
        woken=woken,
        reclaimed=reclaimed,
        duplicate=bool(r[3]),
        not_ready=not_ready,
    )


def admit(
    prefix: str,
    *,
    tag: str,
    job_id: str,
    keys: KeysArg,
    priority: int,
    lease_seconds: float,
    data: str,
    require_ready: bool = False,
) -> Call[Admission]:
    """Encode an admit (see lua/admit_job.lua)."""
    _check_job_id(job_id)
    _check_int("priority", priority, 0, MAX_PRIORITY)  # checked before data, as always
    _check_data(data)
    priority_, lease, flag, flows, *pairs = admit_shape(
        keys, priority=priority, lease_seconds=lease_seconds, require_ready=require_ready
    )
    args: tuple[str | int, ...] = (job_id, priority_, lease, data, flag, flows, *pairs)
    return Call("admit_job", tag_keys(prefix, tag), args, lambda r: _admission(job_id, r))


#: One run of admits alike in an ``admit_batch``: their shared ``Shape``, then each job's
#: (job id, data).
Run = tuple[Shape, list[tuple[str, str]]]


def admit_batch(prefix: str, *, tag: str, runs: list[Run]) -> Call[list[Admission]]:
    """Encode many admits of one tag as one call (see lua/admit_jobs.lua): the jobs of
    `runs`, in order, each admitted exactly as its own ``admit`` would be, one after the
    other. The shapes come from ``admit_shape`` (validated there); job ids and data are
    checked here."""
    args: list[str | int] = []
    jobs: list[str] = []
    for shape, pairs in runs:
        args += [len(pairs), len(shape), *shape]
        for job_id, data in pairs:
            args += [_check_job_id(job_id), _check_data(data)]
            jobs.append(job_id)

    def decode(r: Any) -> list[Admission]:
        if isinstance(r, int):  # every job admitted with nothing else to report
            return [Admission(j, True, None, None, [], [], False, False) for j in jobs]
        return [_admission(j, one) for j, one in zip(jobs, r, strict=True)]

    if len(jobs) == 1:  # a lone job: admit_job itself, without admit_jobs' loop around it
        shape, [(lone, lone_data)] = runs[0]
        argv: tuple[str | int, ...] = (lone, shape[0], shape[1], lone_data, shape[2], shape[3], *shape[4:])
        return Call("admit_job", tag_keys(prefix, tag), argv, lambda r: [_admission(lone, r)])
    return Call("admit_jobs", tag_keys(prefix, tag), tuple(args), decode)


def _split(r: list[Any], at: int) -> tuple[list[Woken], list[Woken]]:
    """Woken and reclaimed pairs of a flat reply whose woken count sits at index ``at``."""
    end = at + 1 + int(r[at])
    return _woken(r[at + 1 : end]), _woken(r[end:])


def _done(r: Any) -> tuple[bool, list[Woken], list[Woken]]:
    """Release and cancel replies: found alone, one woken job as "job_id\\0data" (the
    common handoff: a string costs Redis less than a table), or the flat table."""
    if isinstance(r, int):
        return bool(r), [], []
    if isinstance(r, bytes | str):
        job_id, _, data = text(r).partition("\0")
        return True, [Woken(job_id, data)], []
    return (bool(r[0]), *_split(r, 1))


def release(prefix: str, *, tag: str, job_id: str, keys: Iterable[str] | None = None) -> Call[ReleaseResult]:
    """Encode a release (see lua/release_job.lua). ``keys`` is the optional hint of the
    job's key names; the script checks it against the job's spec."""
    _check_job_id(job_id)
    hint = sorted(_check_key_name(k) for k in keys) if keys is not None else []
    return Call("release_job", tag_keys(prefix, tag), (job_id, *hint), lambda r: ReleaseResult(*_done(r)))


def cancel(prefix: str, *, tag: str, job_id: str) -> Call[CancelResult]:
    """Encode a cancel (see lua/cancel_job.lua)."""
    _check_job_id(job_id)
    return Call("cancel_job", tag_keys(prefix, tag), (job_id,), lambda r: CancelResult(*_done(r)))


def renew(prefix: str, *, tag: str, job_id: str, lease_seconds: float) -> Call[bool]:
    """Encode a lease renewal (see lua/renew_lease.lua)."""
    _check_job_id(job_id)
    return Call("renew_lease", tag_keys(prefix, tag), (job_id, lease_ms(lease_seconds)), lambda r: bool(r))


def reclaim(prefix: str, *, tag: str, max_jobs: int) -> Call[ReclaimResult]:
    """Encode a bounded reclaim of expired leases (see lua/reclaim_leases.lua)."""
    _check_int("max_jobs", max_jobs, 1)
    return Call(
        "reclaim_leases",
        tag_keys(prefix, tag),
        (max_jobs,),
        lambda r: ReclaimResult(*_split(r, 0)),
    )


def set_limits(prefix: str, *, tag: str, limits: KeysArg, require_ready: bool = False) -> Call[list[Woken]]:
    """Encode a limit change (see lua/set_limits.lua): limits with their reserves (a key
    given without one, as ``{name: limit}`` or a pair, gets none); flows and weights are
    checked and dropped, a guard or guarantee refused."""
    args = (1 if require_ready else 0, *_flatten(key_specs(limits, allow_empty=True, job=False)))
    return Call("set_limits", tag_keys(prefix, tag), args, _woken)


def inspect_key(prefix: str, *, tag: str, key: str, holders: bool = True) -> Call[KeyState]:
    """Encode a key inspection (see lua/inspect_key.lua)."""
    _check_key_name(key)

    def decode(r: list[Any]) -> KeyState:
        flat = r[2]
        by_prio = {int(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
        limit = int(r[0])
        names = [text(h) for h in r[1]]
        return KeyState(key, None if limit < 0 else limit, names, by_prio, int(r[3]), int(r[4]), int(r[5]), int(r[6]))

    return Call("inspect_key", tag_keys(prefix, tag), (key, 1 if holders else 0), decode)


def inspect_job(prefix: str, *, tag: str, job_id: str) -> Call[JobState]:
    """Encode a job inspection (see lua/inspect_job.lua)."""
    _check_job_id(job_id)

    def decode(r: list[Any]) -> JobState:
        status = {"r": "admitted", "w": "parked"}.get(text(r[0]), "unknown")
        if status == "unknown":
            return JobState(job_id, status, [], None, None, None, None, None)
        parked = status == "parked"
        lease = int(r[4])
        return JobState(
            job_id=job_id,
            status=status,
            held_keys=[text(k) for k in r[1]],
            parked_on=text(r[2]) if parked else None,
            position=int(r[3]) if parked else None,
            lease_expires_ms=None if lease < 0 else lease,
            priority=int(r[5]),
            data=text(r[6]),
        )

    return Call("inspect_job", tag_keys(prefix, tag), (job_id,), decode)


def init_tag(prefix: str, *, tag: str) -> Call[bool]:
    """Encode marking a tag ready (see lua/init_tag.lua)."""
    return Call("init_tag", tag_keys(prefix, tag), (), lambda r: bool(r))


def check_invariants(prefix: str, *, tag: str) -> Call[list[str]]:
    """Encode the O(state) consistency audit (see lua/check_invariants.lua)."""
    return Call("check_invariants", tag_keys(prefix, tag), (), lambda r: [text(p) for p in r])
