"""The "new version" of tests.worker_tasks_v1: the versioned task accepts one more
argument, and a task the old version does not have. The test process imports it too (the
web tier is already on the new version), so it can submit both."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from fairqueue.jobs.registry import JobContext, fairqueue_task


class VersionedArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int
    label: str = ""


class NewArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


@fairqueue_task("test.versioned", args=VersionedArgs)
def versioned(ctx: JobContext, args: VersionedArgs) -> dict[str, Any]:
    return {"version": 2, "n": args.n, "label": args.label, "worker": ctx.worker}


@fairqueue_task("test.new_only", args=NewArgs)
def new_only(ctx: JobContext, args: NewArgs) -> dict[str, Any]:
    return {"text": args.text.upper(), "worker": ctx.worker}
