"""Isolated tasks: each attempt runs in a child process of the worker, killed at its limits.

A worker process keeps a small pool of long-lived children (`FAIRQUEUE["ISOLATED_POOL_SIZE"]`,
started on first use and replaced once killed). A child is a fresh interpreter (the
`spawn` start method: forking a worker that runs threads could copy a lock another thread
holds) that sets Django up once, then runs one task at a time, sent over a pipe by name
with its JSON arguments. The worker's slot thread that sent it waits on the pipe and
meanwhile watches:

- the wall clock: past the attempt's timeout (plus KILL_GRACE_SECONDS, in which a task
  that checks `ctx.check_deadline()` stops by itself) the child is SIGKILLed: TaskTimeout;
- memory: the child caps its address space (RLIMIT_AS) at its size when the task starts
  plus the task's limit, so an allocation past it fails in the task (MemoryError, turned
  into TaskMemoryLimit, and the child retires). The cap is exact but cannot see memory
  reserved before the task started, nor a task that lifts it; so the worker also samples
  the child's resident memory and kills it once it has grown by more than the limit plus
  RSS_SLACK_MB (the slack lets the exact cap act first): TaskMemoryLimit;
- the hold: once the worker can no longer trust it holds the job (fencing), the child's
  `ctx.hold_lost()` turns true, it has STOP_GRACE_SECONDS to stop, then it is killed; the
  delivery ends fenced (HoldLost), like a task that runs in the worker;
- the child itself: one that dies under a task (a signal, a crash in native code) ends
  the attempt with TaskCrashed.

A kill takes out one child: the worker, its other slots and the other children go on.
The child records nothing about the job: its result (or the exception it raised) comes
back over the pipe and the worker writes the job's row, so the status changes stay the
compare-and-set updates of fairqueue.jobs.execution.

Why a pool of our own: concurrent.futures' ProcessPoolExecutor cannot stop one task
without breaking the pool, and billiard's pool (Celery's prefork) forks the threaded
worker and has no per-task memory limit.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import resource
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import django
import psutil
from django.db import close_old_connections

from fairqueue.conf import fq_settings
from fairqueue.jobs.registry import HoldLost, JobContext, task_get
from fairqueue.jobs.task_limits import TaskCrashed, TaskMemoryLimit, TaskTimeout

log = logging.getLogger("fairqueue.jobs.isolation")

MIB = 1024 * 1024
POLL_SECONDS = 0.05  # how often a waiting slot looks at the clock, the hold and the child's memory
KILL_GRACE_SECONDS = 0.5  # past the timeout, for a task that checks its deadline to stop by itself
STOP_GRACE_SECONDS = 1.0  # for a child told its hold is lost to stop before it is killed
START_TIMEOUT_SECONDS = 120.0  # a fresh child imports Django and the tasks; slow on a loaded host
PARENT_CHECK_SECONDS = 1.0  # how often a child checks that its worker still lives
RSS_SLACK_MB = 32.0  # the resident-memory watch's margin over the limit (see the module docstring)


class IsolatedTaskError(Exception):
    """An exception an isolated task raised that could not be sent back as itself."""


# --- the worker's side ----------------------------------------------------------------------


@dataclass(eq=False)
class _Child:
    process: BaseProcess
    conn: Connection
    pid: int = 0

    def alive(self) -> bool:
        return self.process.is_alive()

    def resident_bytes(self) -> int:
        try:
            return int(psutil.Process(self.pid).memory_info().rss)
        except psutil.Error:
            return 0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self.conn.close()

    def exit_description(self) -> str:
        self.process.join(1)
        code = self.process.exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class IsolatedPool:
    """At most `size` children run isolated tasks at once; a slot thread that finds none
    free waits (watching its hold) until one is."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._places = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._context = multiprocessing.get_context("spawn")

    def run(self, *, task: str, raw_args: Any, ctx: JobContext, memory_limit_mb: float | None) -> Any:
        """Run the task in a child and return its result, or raise what ended it."""
        while not self._places.acquire(timeout=POLL_SECONDS):
            ctx.check_hold()
        try:
            child = self._take(ctx)
            keep = False
            try:
                reply, fenced = self._watch(child, task=task, raw_args=raw_args, ctx=ctx, limit_mb=memory_limit_mb)
                keep = not (reply[0] == "raised" and reply[3])  # a child that ran out of memory retires
            finally:
                if keep and child.alive():
                    with self._lock:
                        self._idle.append(child)
                else:
                    child.kill()
        finally:
            self._places.release()
        if fenced:  # it stopped when told (or finished meanwhile): nothing of it may be recorded
            raise HoldLost(f"job {ctx.job_id}: hold lost while its isolated task ran")
        return _reply_value(reply, pid=child.pid)

    def idle_pids(self) -> list[int]:
        """The children waiting for a task."""
        with self._lock:
            return [child.pid for child in self._idle]

    def stop(self) -> None:
        """Stop the idle children (a worker shutting down); busy ones end with their task
        or with the worker (they watch it)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()

    def _take(self, ctx: JobContext) -> _Child:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.alive():
                    return child
                child.kill()
        return self._spawn(ctx)

    def _spawn(self, ctx: JobContext) -> _Child:
        ours, theirs = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_child_main, args=(theirs, os.getpid()), name="fairqueue-isolated", daemon=True
        )
        process.start()
        theirs.close()
        child = _Child(process=process, conn=ours)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        try:
            while not ours.poll(POLL_SECONDS):
                ctx.check_hold()
                if not process.is_alive():
                    raise TaskCrashed(f"the isolated process exited while starting ({child.exit_description()})")
                if time.monotonic() > deadline:
                    raise TaskCrashed(f"the isolated process did not start within {START_TIMEOUT_SECONDS:g} s")
            _, child.pid = ours.recv()
        except BaseException:
            child.kill()
            raise
        log.info("isolated process %s started", child.pid)
        return child

    def _watch(
        self, child: _Child, *, task: str, raw_args: Any, ctx: JobContext, limit_mb: float | None
    ) -> tuple[tuple[Any, ...], bool]:
        """Send the task and watch it until the child replies; returns the reply and whether
        the child had been told its hold is lost. Raises (having killed the child) when a
        limit is crossed, the child ignores the stop or dies."""
        timeout = ctx.timeout_seconds
        baseline = child.resident_bytes() if limit_mb is not None else 0
        try:
            child.conn.send(("run", task, raw_args, ctx.model_dump(), limit_mb))
        except OSError as exc:  # it died while idle
            raise TaskCrashed(f"the isolated process was gone before task {task} started: {exc}") from None
        started = time.monotonic()
        told_to_stop: float | None = None
        while True:
            if child.conn.poll(POLL_SECONDS):
                try:
                    reply = child.conn.recv()
                except EOFError:
                    raise TaskCrashed(
                        f"the isolated process of task {task} died ({child.exit_description()})"
                    ) from None
                return reply, told_to_stop is not None
            now = time.monotonic()
            if told_to_stop is None and ctx.hold_lost():
                child.conn.send(("stop",))
                told_to_stop = now
            elif told_to_stop is not None and now - told_to_stop > STOP_GRACE_SECONDS:
                child.kill()
                raise HoldLost(f"job {ctx.job_id}: hold lost; its isolated process was killed")
            if timeout is not None and now - started > timeout + KILL_GRACE_SECONDS:
                child.kill()
                raise TaskTimeout(f"timeout: task {task} ran past its limit of {timeout:g} s; its process was killed")
            if limit_mb is not None and (grown := child.resident_bytes() - baseline) > (limit_mb + RSS_SLACK_MB) * MIB:
                child.kill()
                raise TaskMemoryLimit(
                    f"memory_limit: task {task} grew by {grown / MIB:.0f} MiB, past its limit of "
                    f"{limit_mb:g} MiB; its process was killed"
                )


def _reply_value(reply: tuple[Any, ...], *, pid: int) -> Any:
    """The task's value, or the exception it raised (with the child's traceback as a note)."""
    if reply[0] == "ok":
        return reply[1]
    _, exc, text, _ = reply
    if text:
        exc.add_note(f"Raised in the isolated process {pid}:\n{text}")
    raise exc


_pool: IsolatedPool | None = None
_pool_lock = threading.Lock()


def isolated_pool() -> IsolatedPool:
    """This worker process's pool (created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = IsolatedPool(int(fq_settings().ISOLATED_POOL_SIZE))
        return _pool


def isolated_run(*, task: str, raw_args: Any, ctx: JobContext, memory_limit_mb: float | None) -> Any:
    """Run one attempt of an isolated task (see the module docstring)."""
    return isolated_pool().run(task=task, raw_args=raw_args, ctx=ctx, memory_limit_mb=memory_limit_mb)


def isolated_pool_stop() -> None:
    with _pool_lock:
        if _pool is not None:
            _pool.stop()


# --- the child's side -----------------------------------------------------------------------


def _child_main(conn: Connection, parent_pid: int) -> None:
    """A child's life: set Django up once, then run the tasks it is sent until its pipe
    closes (the worker let it go) or its worker dies."""
    # The worker alone decides when a child stops: a SIGTERM to the whole process group (a
    # service manager stopping the worker) or a Ctrl-C must not end a running task while
    # the worker drains; the child ends with its worker (see _watch_parent).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    django.setup()  # registers every task module, as in the worker
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="fairqueue-parent-watch", daemon=True).start()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] != "run":
            continue  # a stop notice that crossed the task's reply: nothing runs now
        reply, retire = _child_run(conn, *message[1:])
        try:
            conn.send(reply)
        except Exception as exc:  # the value could not be pickled: say so instead
            conn.send(("raised", IsolatedTaskError(f"the task's result could not be sent back: {exc}"), "", False))
        close_old_connections()
        if retire:
            return


def _watch_parent(parent_pid: int) -> None:
    """A child whose worker died (SIGKILL included) must not run on unsupervised: its job
    is delivered again elsewhere."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(1)


class _StopNotice:
    """The child's JobContext.hold_lost: true once the worker sent a stop notice."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.seen = False

    def __call__(self) -> bool:
        if not self.seen and self.conn.poll(0):
            self.conn.recv()
            self.seen = True
        return self.seen


def _child_run(
    conn: Connection, task: str, raw_args: Any, ctx_fields: dict[str, Any], limit_mb: float | None
) -> tuple[tuple[Any, ...], bool]:
    """Run one task; returns (the reply for the worker, whether this child must retire)."""
    ctx = JobContext(**ctx_fields).bind_hold(_StopNotice(conn))
    restore = _cap_address_space(limit_mb)
    try:
        registered = task_get(task)
        if registered is None:
            raise LookupError(f"task {task!r} is not registered in the isolated process")
        args = registered.args_model.model_validate(raw_args)
        ctx.start_clock()
        value = registered.func(ctx, args)
        restore()
        pickle.dumps(value)  # fails here, as the task's error, rather than in the send
        return ("ok", value), False
    except MemoryError:
        restore()  # first: what follows needs memory
        if limit_mb is None:
            return _raised(MemoryError("out of memory"), retire=True)
        return _raised(
            TaskMemoryLimit(f"memory_limit: task {task} needed more than its limit of {limit_mb:g} MiB"), True
        )
    except Exception as exc:
        restore()
        return _raised(exc, retire=False)


def _raised(exc: Exception, retire: bool) -> tuple[tuple[Any, ...], bool]:
    text = traceback.format_exc(limit=8)
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        exc = IsolatedTaskError(f"{type(exc).__name__}: {exc}")
    return ("raised", exc, text, retire), retire


def _cap_address_space(limit_mb: float | None) -> Any:
    """Let the task's allocations grow the address space by at most `limit_mb`; returns
    the function that lifts the cap again."""
    if limit_mb is None:
        return lambda: None
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = psutil.Process().memory_info().vms + int(limit_mb * MIB)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
