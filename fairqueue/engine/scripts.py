"""Builds the engine's Redis Functions library from ``lua/`` and names its functions.

Each ``lua/<verb_noun>.lua`` is one operation; ``lua/_lib.lua`` holds the helpers they
share. They are loaded as one library (``FUNCTION LOAD``) and called with ``FCALL``
rather than sent as EVAL scripts: a library's helpers are created once when it loads,
while an EVAL script re-creates every helper closure on every call, which measured as
the largest single cost of an admit after the Redis commands themselves.

The library and its functions are named after a hash of the source, so processes
running different versions of the engine (a rolling deploy) each call their own code, and
loading is idempotent: whoever finds a function missing (a fresh server, FUNCTION FLUSH)
loads the library and retries, like NOSCRIPT handling for EVALSHA.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .cluster import primary_clients

# An installed FairQueue carries the scripts in the package (the wheel maps the repository's
# top-level lua/ to fairqueue/engine/lua); a checkout finds them at the top level.
_PACKAGED_LUA = Path(__file__).resolve().parent / "lua"
LUA_DIR = _PACKAGED_LUA if _PACKAGED_LUA.is_dir() else Path(__file__).resolve().parents[2] / "lua"

#: Every operation of the engine, one ``lua/<name>.lua`` each.
OPERATIONS: tuple[str, ...] = (
    "admit_job",
    "admit_jobs",  # after admit_job: it calls op_admit_job
    "release_job",
    "cancel_job",
    "renew_lease",
    "reclaim_leases",
    "set_limits",
    "inspect_key",
    "inspect_job",
    "check_invariants",
    "init_tag",
)

#: Operations that never write: flagged ``no-writes`` so FCALL_RO may run them on replicas.
READ_ONLY: frozenset[str] = frozenset({"inspect_key", "inspect_job", "check_invariants"})

LIBRARY_PREFIX = "fairqueue_"
_VERSION = "@VERSION@"


@dataclass(frozen=True)
class Library:
    """The engine's Functions library: its source and the names it registers."""

    version: str
    source: str

    @property
    def name(self) -> str:
        return f"{LIBRARY_PREFIX}{self.version}"

    def function(self, operation: str) -> str:
        """The FCALL name of one operation (``fq_<version>_admit_job`` …)."""
        if operation not in OPERATIONS:
            raise KeyError(operation)
        return f"fq_{self.version}_{operation}"


def _registration(name: str, body: str) -> str:
    flags = "'no-writes'" if name in READ_ONLY else ""
    return (
        f"local function op_{name}(KEYS, ARGV)\n"
        # Inline rather than a helper call: a Lua function call is a measurable part of
        # every operation (docs/engine.md, "Where the time goes").
        "K_STATE, K_WAITS, K_LEASES, K_CLOCK = KEYS[1], KEYS[2], KEYS[3], KEYS[4]\n"
        "if not call then bind() end\n"
        f"{body}\n"
        "end\n"
        f"redis.register_function{{function_name = 'fq_{_VERSION}_{name}', callback = op_{name},"
        f" flags = {{{flags}}}}}\n"
    )


@lru_cache(maxsize=1)
def library(lua_dir: Path = LUA_DIR) -> Library:
    """Read the Lua files once per process and assemble the library."""
    parts = [(lua_dir / "_lib.lua").read_text()]
    parts += [_registration(name, (lua_dir / f"{name}.lua").read_text()) for name in OPERATIONS]
    body = "\n".join(parts)
    version = hashlib.sha1(body.encode()).hexdigest()[:12]
    source = f"#!lua name={LIBRARY_PREFIX}{version}\n" + body.replace(_VERSION, version)
    return Library(version, source)


def function_name(operation: str) -> str:
    """FCALL name of an operation in this process's library version."""
    return library().function(operation)


def is_missing_function(error: BaseException) -> bool:
    """The server does not have our library (fresh server, FUNCTION FLUSH)."""
    return "function not found" in str(error).lower()


def is_already_loaded(error: BaseException) -> bool:
    """Another process loaded the same library version first: nothing to do."""
    return "already exists" in str(error).lower()


def _library_names(reply: Any) -> list[str]:
    """Library names from a FUNCTION LIST reply (RESP2: flat name/value lists, bytes or str)."""
    names = []
    for entry in reply:
        fields = dict(zip(entry[::2], entry[1::2], strict=True)) if isinstance(entry, list) else entry
        for key, value in fields.items():
            if (key.decode() if isinstance(key, bytes) else key) == "library_name":
                names.append(value.decode() if isinstance(value, bytes) else str(value))
    return sorted(names)


def loaded_libraries(client: Any) -> list[str]:
    """Every version of the engine's library loaded on this server, or on any primary of a
    cluster (ours included)."""
    names: set[str] = set()
    for server in primary_clients(client):
        names.update(_library_names(server.function_list(library=f"{LIBRARY_PREFIX}*")))
    return sorted(names)


def prune_libraries(client: Any) -> list[str]:
    """Delete the engine libraries of other code versions; return their names.

    Safe while old processes still run: one whose library is gone loads it again on its
    next call. Run it after a deploy has replaced every process."""
    current = library().name
    stale = [name for name in loaded_libraries(client) if name != current]
    for server in primary_clients(client):
        for name in set(stale) & set(loaded_libraries(server)):
            server.function_delete(name)
    return stale
