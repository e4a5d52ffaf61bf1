"""Explicit registry of submittable tasks: nothing runs unless it was registered here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RegisteredTask:
    name: str
    func: Callable[..., Any]
    args_model: type[BaseModel]


class JobContext(BaseModel):
    """What a task may know about the job running it."""

    job_id: str
    attempt: int
    worker: str


_REGISTRY: dict[str, RegisteredTask] = {}


def fairqueue_task(name: str, *, args: type[BaseModel]) -> Callable[[F], F]:
    """Register `func(ctx, args_model_instance)` as the task `name` customers may submit."""

    def register(func: F) -> F:
        if name in _REGISTRY and _REGISTRY[name].func is not func:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = RegisteredTask(name=name, func=func, args_model=args)
        return func

    return register


def task_get(name: str) -> RegisteredTask | None:
    return _REGISTRY.get(name)


def task_names() -> list[str]:
    return sorted(_REGISTRY)
