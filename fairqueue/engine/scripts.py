"""Loads the Lua scripts once and calls them by EVALSHA, one round trip per operation.

Each ``lua/<verb_noun>.lua`` is registered with ``lua/_lib.lua`` prepended, so the shared
grant/handoff logic lives in one place. We call EVALSHA directly (instead of redis-py's
``register_script``) because in a pipeline ``register_script`` first asks SCRIPT EXISTS,
an extra round trip; on NOSCRIPT (server restarted or flushed) we SCRIPT LOAD and retry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

LUA_DIR = Path(__file__).resolve().parent.parent.parent / "lua"

SCRIPT_NAMES: tuple[str, ...] = (
    "admit_job",
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


@dataclass(frozen=True)
class LuaScript:
    """One registered script: its full source (lib + body) and SHA1."""

    name: str
    source: str
    sha: str


@lru_cache(maxsize=1)
def load_scripts(lua_dir: Path = LUA_DIR) -> dict[str, LuaScript]:
    """Read every script file once per process."""
    lib = (lua_dir / "_lib.lua").read_text()
    scripts: dict[str, LuaScript] = {}
    for name in SCRIPT_NAMES:
        source = lib + "\n" + (lua_dir / f"{name}.lua").read_text()
        scripts[name] = LuaScript(name, source, hashlib.sha1(source.encode()).hexdigest())
    return scripts


def script(name: str) -> LuaScript:
    """A script by name (``admit_job`` …)."""
    return load_scripts()[name]


def evalsha_args(name: str, keys: Sequence[str], args: Sequence[str | int]) -> tuple[Any, ...]:
    """Positional arguments for ``client.evalsha``."""
    return (script(name).sha, len(keys), *keys, *args)
