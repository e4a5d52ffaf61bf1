"""Redis key names of the engine.

All state of one hash tag lives in a fixed set of keys named
``{prefix}:{tag}:v<LAYOUT>:<name>`` with the tag in braces, so every key of every job
under that tag hashes to one Redis Cluster slot and every function can receive the same
small KEYS list, even when a release wakes jobs whose keys the caller could not know in
advance.

``LAYOUT`` is part of the names so that code with a different data layout never reads
this one's state (mixing formats corrupts it: seen in a chaos run during development).
A new layout starts from empty state, which a caller rebuilds like after a loss of Redis
data (see ``init_tag``).
"""

from __future__ import annotations

from functools import lru_cache

#: Order matters: the Lua functions read KEYS[1..4] by position (see lua/_lib.lua).
#: ``state`` holds each key's holder count (the plain field), its limit (``"\0" + key``),
#: each job's spec (``"\2" + job``) and the meta fields (``"\1..."``), so one HMGET
#: reads everything an admit decides on. ``clock`` is an empty string with a fixed expiry
#: far in the future, so the functions read the server clock as one integer (its PTTL);
#: it is the only key with an expiry, so eviction under a ``volatile-*`` policy can only
#: take it, and the functions then fall back to TIME and set it again.
KEY_NAMES: tuple[str, ...] = ("state", "waits", "leases", "clock")

#: Version of the data layout (field kinds, spec and wait-entry formats) in lua/_lib.lua.
#: Bump it with any change to them. 5: fair order (the virtual tag and the flow's backlog
#: start in the wait order, the flow part in the wait entry, the "\4"/"\5" flow records).
#: 6: reserves and guarantees (a limit field "L:R" with its reserve, the floor band's
#: priority bytes, guards in a parked job's "\3" record).
LAYOUT = 6

#: The ``state`` field that marks a tag ready (``READY`` in lua/_lib.lua).
READY_FIELD = "\x01ready"
#: What starts a job's spec field in ``state`` (``"\2" + job id``).
SPEC_PREFIX = "\x02"
#: The ``state`` field naming the server (process and replication history) that marked the
#: tag ready: written from Python only, never read by the Lua (see ``cluster.server_identity``).
STAMP_FIELD = "\x01stamp"


def validate_tag(tag: str) -> None:
    """A tag must be a non-empty brace-free string, or the hash slot would not be shared."""
    if not isinstance(tag, str) or not tag:
        raise ValueError("tag must be a non-empty string")
    if "{" in tag or "}" in tag:
        raise ValueError(f"tag must not contain braces: {tag!r}")


def validate_prefix(prefix: str) -> None:
    """A prefix with braces would move the cluster hash tag away from the tag."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError("prefix must be a non-empty string")
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"prefix must not contain braces: {prefix!r}")


@lru_cache(maxsize=4096)
def tag_keys(prefix: str, tag: str) -> tuple[str, ...]:
    """The KEYS list every script of one tag receives, in KEY_NAMES order."""
    validate_prefix(prefix)
    validate_tag(tag)
    return tuple(f"{prefix}:{{{tag}}}:v{LAYOUT}:{name}" for name in KEY_NAMES)


def key_name(prefix: str, tag: str, name: str) -> str:
    """One of the per-tag keys by its short name (for direct reads and tests)."""
    return tag_keys(prefix, tag)[KEY_NAMES.index(name)]
