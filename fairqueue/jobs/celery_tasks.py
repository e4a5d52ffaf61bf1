"""Existing Celery tasks sent through FairQueue's throttle, their bodies unchanged.

    # myapp/fairqueue_tasks.py (imported by FairQueue in the web process and every worker)
    from fairqueue.jobs.celery_tasks import celery_task_register
    from myapp.tasks import resize_image, send_report

    celery_task_register(resize_image)                      # schema from the signature
    celery_task_register(send_report, args=SendReportArgs)  # or a pydantic model of your own

Each becomes a FairQueue task under its Celery name (or `name=`): submitted in-process
(`fairqueue.submit(tenant, "myapp.tasks.resize_image", {"image_id": 7})`) or over REST, its
arguments validated by keyword, admitted through the tenant's limits, and run on a FairQueue
worker by calling the task's own `run` (its body; no Celery request around it). The task
stays what it was for `.delay()`: that still goes to the project's queues, around the throttle.
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from fairqueue.jobs.registry import JobContext, fairqueue_task


class SignatureNotInferable(TypeError):
    pass


def args_model_of(func: Any, name: str) -> type[BaseModel]:
    """A pydantic model of `func`'s parameters, by keyword: each annotated type (Any without
    one), required unless it has a default; unknown fields are refused."""
    fields: dict[str, Any] = {}
    for param in inspect.signature(func).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise SignatureNotInferable(
                f"task {name!r}: *args, **kwargs and positional-only parameters have no schema; pass args=<model>"
            )
        kind = Any if param.annotation is param.empty else param.annotation
        fields[param.name] = (kind, ... if param.default is param.empty else param.default)
    model_name = "".join(part.title() for part in name.replace(".", "_").split("_")) + "Args"
    return create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)


def celery_task_register(
    task: Any, *, name: str | None = None, args: type[BaseModel] | None = None, **options: Any
) -> str:
    """Register the Celery task `task` as a FairQueue task (its Celery name unless `name`);
    `args` is its argument model, inferred from the signature when not given; `options`
    are fairqueue_task's (timeout_seconds, resources, retry...). Returns the name."""
    task_name = name or task.name
    model = args or args_model_of(task.run, task_name)

    def run(ctx: JobContext, values: BaseModel) -> Any:
        return task.run(**{field: getattr(values, field) for field in type(values).model_fields})

    run.__name__ = f"celery_{task_name}"
    fairqueue_task(task_name, args=model, **options)(run)
    return task_name
