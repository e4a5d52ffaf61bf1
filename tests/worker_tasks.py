"""Tasks that only test workers load (FAIRQUEUE_TASK_MODULES=tests.worker_tasks).

The test process imports this module too, so it can submit them.
"""

from __future__ import annotations

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
