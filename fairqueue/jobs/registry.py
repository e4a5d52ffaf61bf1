"""Explicit registry of submittable tasks: nothing runs unless it was registered here."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, Field, PrivateAttr

from fairqueue.jobs.retry_policy import DEFAULT_RETRY, RetryPolicy
from fairqueue.jobs.task_limits import TaskTimeout, valid_limit

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RegisteredTask:
    name: str
    func: Callable[..., Any]
    args_model: type[BaseModel]
    # Runs in a child process of the worker's isolated pool (fairqueue.jobs.isolation),
    # which is killed at the timeout or the memory limit without harming the worker.
    isolated: bool = False
    timeout_seconds: float | None = None  # wall clock per attempt; a job may lower it
    memory_limit_mb: float | None = None  # isolated tasks only: growth of the child's memory
    # Outside resources every job of this task calls (tenants.models.Resource names): each
    # is a throttle key of its admissions, besides those a submit names.
    resources: tuple[str, ...] = ()
    retry: RetryPolicy = DEFAULT_RETRY


class HoldLost(Exception):
    """Raised by JobContext.check_hold: this worker no longer holds the job (its lease was
    reclaimed, or could not be renewed for most of a lease), so another delivery may run
    it. The task stops; nothing is recorded for this delivery."""


def _never_lost() -> bool:
    return False


class ChildSubmit(Protocol):
    """Submits a running job's children (fairqueue.jobs.fanout.children_submit, bound by
    the worker that runs the job): returns their ids, in order."""

    def __call__(
        self, task: str, args: Sequence[Mapping[str, Any]], then: str | None, max_fan_out: int | None
    ) -> list[str]: ...


class ChildOutcome(BaseModel):
    """How one child of a fanned-out job ended, as its continuation receives it: its
    result inline, or a payload store reference for a large one (fairqueue.jobs.payloads)."""

    index: int
    status: str
    result: Any = None
    result_ref: str = ""
    error_reason: str = ""


class JoinArgs(BaseModel):
    """The arguments of a continuation (`then`) task: the parent's id and arguments, each
    child's outcome by index, and the indexes of those that did not succeed. A task given
    as `then` takes this model (or a subclass) as its args."""

    parent_id: str
    parent_args: dict[str, Any] = Field(default_factory=dict)
    children: list[ChildOutcome] = Field(default_factory=list)
    failed: list[int] = Field(default_factory=list)


class JobContext(BaseModel):
    """What a task may know about the job running it.

    `generation` is the fencing token: it grows with every delivery of the job, so a side
    effect written with it (a conditional write, a version column) can refuse a stale
    delivery's write once a newer one has written. `hold_lost()` / `check_hold()` tell a
    long task to stop when this worker can no longer trust it holds the job.

    `timeout_seconds` is this attempt's wall-clock limit (None: none). A task that is not
    isolated cannot be killed, so it stops itself: `deadline_passed()` / `check_deadline()`
    (which raises TaskTimeout, failing the attempt with the reason `timeout`).
    """

    job_id: str
    attempt: int
    worker: str
    generation: int = 0
    timeout_seconds: float | None = None
    _hold_lost: Callable[[], bool] = PrivateAttr(default_factory=lambda: _never_lost)
    _deadline: float | None = PrivateAttr(default=None)  # time.monotonic() when the limit is reached
    _submit_children: ChildSubmit | None = PrivateAttr(default=None)
    _children: int = PrivateAttr(default=0)

    def bind_hold(self, hold_lost: Callable[[], bool]) -> JobContext:
        self._hold_lost = hold_lost
        return self

    def hold_lost(self) -> bool:
        return self._hold_lost()

    def bind_children(self, submit: ChildSubmit) -> JobContext:
        self._submit_children = submit
        return self

    def submit_children(
        self, task: str, args: Sequence[Mapping[str, Any]], *, then: str | None = None, max_fan_out: int | None = None
    ) -> list[str]:
        """Fan out: submit one child job of `task` per item of `args` (same tenant and
        sub-tenant, this job as their parent), at most `max_fan_out` of them running at once
        (never more than the tenant's "max fan-out per job"). The job's run then ends as it
        returns, holding no slot; when the last child ends, `then` (a task taking JoinArgs)
        runs with their outcomes, and its outcome becomes this job's. Without `then`, this
        job succeeds if every child did. Called again by a re-delivery, it submits nothing
        new: a child is its parent plus its index. Returns the children's ids."""
        if self._submit_children is None:
            raise RuntimeError(f"job {self.job_id}: only a task a worker runs in its own thread submits children")
        ids = self._submit_children(task, args, then, max_fan_out)
        self._children = len(ids)
        return ids

    @property
    def fanned_out(self) -> bool:
        """True once this run submitted children: it ends awaiting them, not finished."""
        return self._children > 0

    def check_hold(self) -> None:
        if self._hold_lost():
            raise HoldLost(f"job {self.job_id} generation {self.generation}: hold lost")

    def start_clock(self) -> JobContext:
        """Start the attempt's wall clock (whoever runs the task calls it right before)."""
        self._deadline = None if self.timeout_seconds is None else time.monotonic() + self.timeout_seconds
        return self

    def seconds_left(self) -> float | None:
        """Seconds until the attempt's limit (negative once past it); None without a limit."""
        return None if self._deadline is None else self._deadline - time.monotonic()

    def deadline_passed(self) -> bool:
        left = self.seconds_left()
        return left is not None and left <= 0

    def check_deadline(self) -> None:
        if self.deadline_passed():
            raise TaskTimeout(f"timeout: job {self.job_id} ran past its limit of {self.timeout_seconds:g} s")


_REGISTRY: dict[str, RegisteredTask] = {}


def fairqueue_task(
    name: str,
    *,
    args: type[BaseModel],
    isolated: bool = False,
    timeout_seconds: float | None = None,
    memory_limit_mb: float | None = None,
    resources: Sequence[str] = (),
    retry: RetryPolicy | None = None,
) -> Callable[[F], F]:
    """Register `func(ctx, args_model_instance)` as the task `name` customers may submit.

    `isolated=True` runs it in a child process of the worker (a module-level function,
    since the child imports it by name), which is killed past `timeout_seconds` or when
    it grows by more than `memory_limit_mb`; a task that is not isolated checks its
    timeout itself (JobContext.check_deadline). `resources` names the outside resources
    each of its jobs calls (docs/resources.md). `retry` is its retry policy
    (fairqueue.jobs.retries); without one a failure is final.
    """
    if not valid_limit(timeout_seconds) or not valid_limit(memory_limit_mb):
        raise ValueError(f"task {name!r}: timeout_seconds and memory_limit_mb must be positive numbers")
    if memory_limit_mb is not None and not isolated:
        raise ValueError(f"task {name!r}: a memory limit needs isolated=True (only a child process can be killed)")

    def register(func: F) -> F:
        if name in _REGISTRY and _REGISTRY[name].func is not func:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = RegisteredTask(
            name=name,
            func=func,
            args_model=args,
            isolated=isolated,
            timeout_seconds=timeout_seconds,
            memory_limit_mb=memory_limit_mb,
            resources=tuple(resources),
            retry=retry or DEFAULT_RETRY,
        )
        return func

    return register


def task_get(name: str) -> RegisteredTask | None:
    return _REGISTRY.get(name)


def is_continuation(task: RegisteredTask) -> bool:
    """A task taking JoinArgs runs only as a fan-out's join (fairqueue.jobs.fanout), never
    submitted by itself: its arguments are the children's outcomes, which only the join knows."""
    return issubclass(task.args_model, JoinArgs)


def task_names() -> list[str]:
    return sorted(_REGISTRY)
