"""The benches' optional dependencies, checked before a run starts: a missing one is named
with what installs it, instead of an ImportError half-way through a run."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

# requirements-dev.txt pins them; `make test` and `make demo` install it.
INSTALL_HINT = "pip install -r requirements-dev.txt"


class ExtrasMissing(RuntimeError):
    pass


def extras_missing(modules: Iterable[str]) -> list[str]:
    """The top-level modules in `modules` that cannot be imported here (found, not imported:
    they are heavy)."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def extras_require(modules: Iterable[str], *, purpose: str) -> None:
    """Raise ExtrasMissing naming what `purpose` needs and how to install it."""
    missing = extras_missing(modules)
    if missing:
        raise ExtrasMissing(
            f"{purpose} needs {' and '.join(missing)}, not installed in this Python: "
            f"run `{INSTALL_HINT}` (`make test` and `make demo` install it)."
        )
