"""A project's existing Celery tasks, sent through FairQueue's throttle unchanged
(tests/test_celery_tasks.py); FAIRQUEUE_TASK_MODULES imports this in its workers."""

from __future__ import annotations

from celery import shared_task
from pydantic import BaseModel, ConfigDict, Field

from fairqueue.jobs.celery_tasks import celery_task_register


@shared_task(name="project.multiply")
def multiply(x: int, y: int = 2) -> int:
    return x * y


@shared_task(name="project.label")
def label(text, upper=False):  # type: ignore[no-untyped-def]  # an untyped task of old
    return text.upper() if upper else text


@shared_task(name="project.greet")
def greet(*names: str) -> str:
    return ", ".join(names)


class LabelArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=20)
    upper: bool = False


celery_task_register(multiply)
celery_task_register(label, args=LabelArgs)
