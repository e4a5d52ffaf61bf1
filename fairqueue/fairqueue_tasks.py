"""FairQueue's own bridge tasks: `django.task` runs a Django Tasks `@task` enqueued through
fairqueue.tasks_backend on a FairQueue worker.

Only a `@task` whose backend is FairQueue's runs: any other path (a module's function, a
task of another backend) fails the job, so a tenant submitting `django.task` over REST can
run nothing the project did not give to FairQueue.
"""

from __future__ import annotations

from typing import Any

from django.utils.module_loading import import_string
from pydantic import BaseModel, ConfigDict, Field

from fairqueue.jobs.registry import JobContext, fairqueue_task
from fairqueue.tasks_backend import DJANGO_TASK, FairQueueBackend, Task

MODULE_PATH_MAX = 300
#: FairQueue's own tasks, registered in every process, demo or not.
BRIDGE_TASKS = frozenset({DJANGO_TASK})


class DjangoTaskArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: str = Field(min_length=1, max_length=MODULE_PATH_MAX, pattern=r"^[A-Za-z_][\w.]*$")
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class NotAFairQueueTask(Exception):
    pass


@fairqueue_task(DJANGO_TASK, args=DjangoTaskArgs)
def run_django_task(ctx: JobContext, args: DjangoTaskArgs) -> Any:
    try:
        task = import_string(args.task)
    except ImportError as exc:
        raise NotAFairQueueTask(f"{args.task}: no such task ({exc})") from None
    if not isinstance(task, Task) or not isinstance(task.get_backend(), FairQueueBackend):
        raise NotAFairQueueTask(f"{args.task} is not a Django task of FairQueue's backend")
    return task.call(*args.args, **args.kwargs)
