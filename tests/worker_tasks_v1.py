"""An "old version" of a task, loaded only by the old worker of the rolling-deploy test
(FAIRQUEUE_TASK_MODULES=tests.worker_tasks_v1); tests.worker_tasks_v2 is the new one."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from fairqueue.jobs.registry import JobContext, fairqueue_task


class VersionedArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int


@fairqueue_task("test.versioned", args=VersionedArgs)
def versioned(ctx: JobContext, args: VersionedArgs) -> dict[str, Any]:
    return {"version": 1, "n": args.n, "worker": ctx.worker}
