"""Hold the cyclic garbage collector off while a large, short-lived picture is built.

A dashboard snapshot or a /metrics render at ten thousand tenants allocates tens of
thousands of containers (rows, label dicts, samples) that all live until the answer is
sent. Each 700 allocations start a young collection that finds no garbage in them, and
as they are promoted they trigger full collections that walk the whole process heap:
more time than the build itself. Reference counting still frees everything as usual;
only the cycle search waits until the block ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block, if it was enabled (re-entrant, and a
    thread that finds it already paused leaves it to the one that paused it)."""
    was_enabled = gc.isenabled()
    if was_enabled:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
