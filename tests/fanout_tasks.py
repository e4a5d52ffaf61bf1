"""A document task for the fan-out tests (FAIRQUEUE_TASK_MODULES=tests.fanout_tasks): its
first attempt lingers after submitting its pages, so a test can kill its worker then.

The test process imports this module too, so it can submit it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from fairqueue.jobs.demo_tasks import task_sleep
from fairqueue.jobs.registry import JobContext, fairqueue_task


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
