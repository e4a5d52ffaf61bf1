"""Repeated failures of one periodic thing, logged readably: the first with its traceback,
then one line per interval with how many failed since, then one line when it works again.

A duty that fails on every tick (the database away for minutes) would otherwise write a
traceback four times a second.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

DEFAULT_INTERVAL_SECONDS = 30.0


@dataclass
class _Streak:
    started: float
    failures: int = 1
    logged_at: float = 0.0
    since_logged: int = 0


class FailureLog:
    """One per kind of periodic work; `failed(name, exc)` and `succeeded(name)` per run."""

    def __init__(self, logger: logging.Logger, what: str, *, interval: float = DEFAULT_INTERVAL_SECONDS) -> None:
        self.log = logger
        self.what = what
        self.interval = interval
        self._streaks: dict[str, _Streak] = {}
        self._lock = threading.Lock()

    def failed(self, name: str, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            streak = self._streaks.get(name)
            if streak is None:
                self._streaks[name] = _Streak(started=now, logged_at=now)
                first = True
            else:
                streak.failures += 1
                streak.since_logged += 1
                first = False
                if now - streak.logged_at < self.interval:
                    return
                count, streak.since_logged, streak.logged_at = streak.since_logged, 0, now
        if first:
            self.log.error("%s %s failed", self.what, name, exc_info=exc)
        else:
            self.log.error(
                "%s %s failed %d more time(s) in the last %.0f s; still failing: %s: %s",
                self.what,
                name,
                count,
                self.interval,
                type(exc).__name__,
                exc,
            )

    def succeeded(self, name: str) -> None:
        if name not in self._streaks:  # the common case, without the lock
            return
        with self._lock:
            streak = self._streaks.pop(name, None)
        if streak is not None:
            self.log.warning(
                "%s %s works again after %d failure(s) over %.1f s",
                self.what,
                name,
                streak.failures,
                time.monotonic() - streak.started,
            )

    def failing(self) -> dict[str, int]:
        """Each name failing now, with how many times in a row."""
        with self._lock:
            return {name: s.failures for name, s in self._streaks.items()}
