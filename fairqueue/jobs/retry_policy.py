"""A task's retry policy: which errors it retries, how many attempts it gets, how long it
waits between them. Declared at registration (`@fairqueue_task(..., retry=RetryPolicy(...))`),
so it imports no models: the registry and the isolated children load it before Django is
set up. What a failed attempt does with it: fairqueue.jobs.retries.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import redis

from fairqueue.jobs.database import TRANSIENT_DB_ERRORS

MAX_ATTEMPTS_LIMIT = 100  # attempt_history keeps one entry per attempt: bounded


@dataclass(frozen=True)
class RetryPolicy:
    """`max_attempts` counts every attempt, the first included (1: never retried). The wait
    before attempt n+1 is uniform in [0, min(backoff_cap_s, backoff_base_s * 2**(n-1))]."""

    max_attempts: int = 3
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 300.0
    retry_on: tuple[type[BaseException], ...] = field(default=(Exception,))

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= MAX_ATTEMPTS_LIMIT:
            raise ValueError(f"max_attempts must be 1-{MAX_ATTEMPTS_LIMIT}")
        if not (0 <= self.backoff_base_s <= self.backoff_cap_s):
            raise ValueError("backoff needs 0 <= backoff_base_s <= backoff_cap_s")
        if not all(isinstance(t, type) and issubclass(t, BaseException) for t in self.retry_on):
            raise ValueError("retry_on must be a tuple of exception classes")

    def retries(self, exc: BaseException) -> bool:
        return isinstance(exc, self.retry_on)

    def backoff_bound(self, failures: int) -> float:
        """The longest wait after the `failures`-th failed attempt (1 after the first)."""
        exponent = min(max(failures - 1, 0), 64)  # 2**64 s is past any cap; avoids huge floats
        return min(self.backoff_cap_s, self.backoff_base_s * 2.0**exponent)

    def backoff(self, failures: int, rng: random.Random | None = None) -> float:
        """Full jitter: uniform between 0 and the bound."""
        return (rng or _rng).uniform(0.0, self.backoff_bound(failures))


NO_RETRY = RetryPolicy(max_attempts=1, backoff_base_s=0.0, backoff_cap_s=0.0)

# Errors that say a dependency is away for a moment, not that the task is wrong: the
# database unreachable or its connection broken (a restart, a failover), Redis unreachable.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_DB_ERRORS, redis.ConnectionError, redis.TimeoutError)
# The policy of a task that declares none: only transient errors are retried, a few times.
# A task that declares its own retries what it lists (add TRANSIENT_ERRORS to keep these).
DEFAULT_RETRY = RetryPolicy(max_attempts=3, backoff_base_s=1.0, backoff_cap_s=30.0, retry_on=TRANSIENT_ERRORS)

_rng = random.SystemRandom()
