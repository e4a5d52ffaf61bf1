"""Tasks that only test workers load (FAIRQUEUE_TASK_MODULES=tests.worker_tasks).

The test process imports this module too, so it can submit them.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import redis
from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field

from fairqueue.jobs.registry import JobContext, fairqueue_task

HOLD_POLL_SECONDS = 0.1
MIB = 1024 * 1024


class HogArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    megabytes: int = Field(ge=1, le=4096)
    hold_key: str  # the task keeps its memory while this Redis key exists
    max_seconds: float = Field(default=120, ge=0, le=600)


@fairqueue_task("test.hog", args=HogArgs)
def memory_hog(ctx: JobContext, args: HogArgs) -> dict[str, Any]:
    """Allocate and touch `megabytes` (so it is resident), hold it, free it, then finish."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    block = bytearray(b"\x01") * (args.megabytes * MIB)  # filled, so every page is resident
    deadline = time.monotonic() + args.max_seconds
    while client.exists(args.hold_key) and time.monotonic() < deadline:
        time.sleep(HOLD_POLL_SECONDS)
    size = len(block)
    del block
    return {"bytes": size}


class SpinArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float = Field(default=600, ge=0, le=3600)


SPIN_TIMEOUT_SECONDS = 3.0


@fairqueue_task("test.spin", args=SpinArgs, isolated=True, timeout_seconds=SPIN_TIMEOUT_SECONDS)
def spin(ctx: JobContext, args: SpinArgs) -> dict[str, Any]:
    """Burn CPU and never look at the clock or the hold: only a kill stops it in time."""
    end = time.monotonic() + args.seconds
    turns = 0
    while time.monotonic() < end:
        turns += 1
    return {"turns": turns}


class GrowArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chunk_mb: int = Field(default=16, ge=1, le=256)
    lift_cap: bool = False  # lift the child's address-space cap first: only the worker's RSS watch is left


GROW_MEMORY_LIMIT_MB = 200.0


@fairqueue_task("test.grow", args=GrowArgs, isolated=True, timeout_seconds=300, memory_limit_mb=GROW_MEMORY_LIMIT_MB)
def grow(ctx: JobContext, args: GrowArgs) -> None:
    """Allocate (and touch) memory without bound."""
    if args.lift_cap:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    chunks = []
    while True:
        chunks.append(bytearray(b"\x01") * (args.chunk_mb * MIB))


class IsolatedInfoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fail: bool = False


@fairqueue_task("test.isolated_info", args=IsolatedInfoArgs, isolated=True, timeout_seconds=60)
def isolated_info(ctx: JobContext, args: IsolatedInfoArgs) -> dict[str, Any]:
    """Where it ran and with what context; raises when asked to."""
    if args.fail:
        raise ValueError(f"asked to fail on attempt {ctx.attempt}")
    return {"pid": os.getpid(), "attempt": ctx.attempt, "generation": ctx.generation, "timeout": ctx.timeout_seconds}
