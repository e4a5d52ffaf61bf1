"""Explicit registry of submittable tasks: nothing runs unless it was registered here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, PrivateAttr

from fairqueue.jobs.retries import NO_RETRY, RetryPolicy

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RegisteredTask:
    name: str
    func: Callable[..., Any]
    args_model: type[BaseModel]
    retry: RetryPolicy = NO_RETRY


class HoldLost(Exception):
    """Raised by JobContext.check_hold: this worker no longer holds the job (its lease was
    reclaimed, or could not be renewed for most of a lease), so another delivery may run
    it. The task stops; nothing is recorded for this delivery."""


def _never_lost() -> bool:
    return False


class JobContext(BaseModel):
    """What a task may know about the job running it.

    `generation` is the fencing token: it grows with every delivery of the job, so a side
    effect written with it (a conditional write, a version column) can refuse a stale
    delivery's write once a newer one has written. `hold_lost()` / `check_hold()` tell a
    long task to stop when this worker can no longer trust it holds the job.
    """

    job_id: str
    attempt: int
    worker: str
    generation: int = 0
    _hold_lost: Callable[[], bool] = PrivateAttr(default_factory=lambda: _never_lost)

    def bind_hold(self, hold_lost: Callable[[], bool]) -> JobContext:
        self._hold_lost = hold_lost
        return self

    def hold_lost(self) -> bool:
        return self._hold_lost()

    def check_hold(self) -> None:
        if self._hold_lost():
            raise HoldLost(f"job {self.job_id} generation {self.generation}: hold lost")


_REGISTRY: dict[str, RegisteredTask] = {}


def fairqueue_task(name: str, *, args: type[BaseModel], retry: RetryPolicy | None = None) -> Callable[[F], F]:
    """Register `func(ctx, args_model_instance)` as the task `name` customers may submit.
    `retry` is its retry policy (fairqueue.jobs.retries); without one a failure is final."""

    def register(func: F) -> F:
        if name in _REGISTRY and _REGISTRY[name].func is not func:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = RegisteredTask(name=name, func=func, args_model=args, retry=retry or NO_RETRY)
        return func

    return register


def task_get(name: str) -> RegisteredTask | None:
    return _REGISTRY.get(name)


def task_names() -> list[str]:
    return sorted(_REGISTRY)
