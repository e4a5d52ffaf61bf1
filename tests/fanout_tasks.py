"""Document tasks for the fan-out tests (FAIRQUEUE_TASK_MODULES=tests.fanout_tasks): one
whose first attempt lingers after submitting its pages, so a test can kill its worker then,
and one whose pages retry (test.flaky) or fail.

The test process imports this module too, so it can submit it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fairqueue.jobs.demo_tasks import task_sleep
from fairqueue.jobs.registry import JobContext, JoinArgs, fairqueue_task
from tests import lifecycle_tasks  # noqa: F401  (registers test.flaky, the pages' task)


class SlowDocumentArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pages: int = Field(ge=1, le=1000)
    linger: float = Field(default=0.0, ge=0, le=600)  # seconds after submitting, first attempt only
    seconds_per_page: float = Field(default=0.1, ge=0, le=60)


@fairqueue_task("tests.slow_document", args=SlowDocumentArgs)
def slow_document(ctx: JobContext, args: SlowDocumentArgs) -> None:
    pages = [{"page": i, "seconds": args.seconds_per_page} for i in range(args.pages)]
    ctx.submit_children("demo.page", pages, then="demo.document_join")
    if ctx.attempt == 1:
        task_sleep(ctx, args.linger)


class FlakyPagesArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fail_times: list[int] = Field(max_length=100)  # per page: attempts that fail before one succeeds
    permanent: list[int] = Field(default_factory=list, max_length=100)  # pages that fail for good


@fairqueue_task("tests.flaky_document", args=FlakyPagesArgs)
def flaky_document(ctx: JobContext, args: FlakyPagesArgs) -> None:
    """Pages of test.flaky (its retry policy retries a transient error), joined by a
    continuation that records what it was given."""
    pages = [{"fail_times": n, "permanent": i in args.permanent} for i, n in enumerate(args.fail_times)]
    ctx.submit_children("test.flaky", pages, then="tests.record_join")


@fairqueue_task("tests.record_join", args=JoinArgs)
def record_join(ctx: JobContext, args: JoinArgs) -> dict[str, Any]:
    return {"failed": args.failed, "statuses": [c.status for c in args.children]}
