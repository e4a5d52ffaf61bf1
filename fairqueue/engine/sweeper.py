"""A background reclaimer for worker processes.

Leases are also reclaimed inline by admit/release, but a tag that sees no traffic needs a
sweep, or a dead worker's slots would wait for the next call. Any number of processes may
run one: the reclaim script is atomic, and the random jitter keeps a fleet of workers from
sweeping in lock step.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterable

from .engine import Engine
from .results import ReclaimResult

log = logging.getLogger(__name__)


class Sweeper:
    """Runs ``engine.sweep(tags())`` every ``interval`` seconds (+/- ``jitter`` fraction)
    in a daemon thread, passing each non-empty result to ``on_result(tag, result)`` so the
    owner can re-deliver reclaimed jobs and dispatch woken ones."""

    def __init__(
        self,
        engine: Engine,
        tags: Callable[[], Iterable[str]],
        on_result: Callable[[str, ReclaimResult], None],
        *,
        interval: float = 1.0,
        jitter: float = 0.5,
        max_jobs_per_tag: int = 100,
    ) -> None:
        if interval <= 0 or not 0 <= jitter < 1:
            raise ValueError("interval must be > 0 and jitter in [0, 1)")
        self.engine = engine
        self.tags = tags
        self.on_result = on_result
        self.interval = interval
        self.jitter = jitter
        self.max_jobs_per_tag = max_jobs_per_tag
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep_once(self) -> dict[str, ReclaimResult]:
        """One pass over every tag (one round trip); results are also sent to on_result."""
        results = self.engine.sweep(self.tags(), self.max_jobs_per_tag)
        for tag, result in results.items():
            if result.reclaimed or result.woken:
                self.on_result(tag, result)
        return results

    def _loop(self) -> None:
        while not self._stop.wait(self.interval * (1 + random.uniform(-self.jitter, self.jitter))):
            try:
                self.sweep_once()
            except Exception:  # keep sweeping through transient Redis errors
                log.exception("engine sweep failed")

    def start(self) -> None:
        """Start the daemon thread (idempotent)."""
        if self._thread and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="fairqueue-sweeper", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop and join the thread."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout)
            self._thread = None
