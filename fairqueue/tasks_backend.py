"""A Django Tasks backend whose tasks go through FairQueue's throttle.

    TASKS = {"default": {"BACKEND": "fairqueue.tasks_backend.FairQueueBackend",
                         "OPTIONS": {"TENANT": "acme"}}}

Written for the `django-tasks` backport on Django 5.2 and for `django.tasks` on 6.x: it
imports whichever the process has (Django's own first). `.enqueue()` submits a FairQueue
job of the task `django.task` (fairqueue/fairqueue_tasks.py runs it on a FairQueue worker):

- the tenant is the task's `queue_name` (`my_task.using(queue_name="acme")`), or
  OPTIONS["TENANT"] for the default queue name;
- `priority` picks a latency class: 0 (the default) is the tenant's default class, and
  -100..100 spread over the policy's classes by rank, 100 the most urgent;
- `run_after` is the job's `run_at` (a delay);
- `get_result()` reads the job: its status, return value, times, attempts and error.

Tasks that take a context are refused: FairQueue's own tasks get a JobContext instead.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils.module_loading import import_string

try:  # Django 6.0+
    from django.tasks import DEFAULT_TASK_QUEUE_NAME, TaskResult, TaskResultStatus  # type: ignore[import-not-found]
    from django.tasks.backends.base import BaseTaskBackend  # type: ignore[import-not-found]
    from django.tasks.base import (  # type: ignore[import-not-found]
        DEFAULT_TASK_PRIORITY,
        TASK_MAX_PRIORITY,
        TASK_MIN_PRIORITY,
        Task,
        TaskError,
    )
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist  # type: ignore[import-not-found]
    from django.tasks.signals import task_enqueued  # type: ignore[import-not-found]
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks import DEFAULT_TASK_QUEUE_NAME, TaskResult, TaskResultStatus
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import DEFAULT_TASK_PRIORITY, TASK_MAX_PRIORITY, TASK_MIN_PRIORITY, Task, TaskError
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued

from fairqueue.jobs import payloads
from fairqueue.jobs.inprocess import submit
from fairqueue.jobs.models import Job, JobStatus
from tenants.policy import policy_snapshot

#: The FairQueue task that runs a Django task (fairqueue/fairqueue_tasks.py).
DJANGO_TASK = "django.task"

_STATUS = {
    JobStatus.SCHEDULED: TaskResultStatus.READY,
    JobStatus.QUEUED: TaskResultStatus.READY,
    JobStatus.PARKED: TaskResultStatus.READY,
    JobStatus.RETRYING: TaskResultStatus.READY,
    JobStatus.RUNNING: TaskResultStatus.RUNNING,
    JobStatus.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    JobStatus.FAILED: TaskResultStatus.FAILED,
    JobStatus.CANCELLED: TaskResultStatus.FAILED,
}


def latency_class_of(priority: int) -> str | None:
    """The latency class of a Django task's priority: None (the tenant's default class) for
    the default priority, else the policy's classes by rank spread over -100..100."""
    if priority == DEFAULT_TASK_PRIORITY:
        return None
    ranked = sorted(policy_snapshot().classes.values(), key=lambda c: -c.rank)
    if not ranked:
        return None
    share = (TASK_MAX_PRIORITY - priority) / (TASK_MAX_PRIORITY - TASK_MIN_PRIORITY)
    return ranked[round(share * (len(ranked) - 1))].name


class FairQueueBackend(BaseTaskBackend):  # type: ignore[misc]
    supports_defer = True  # run_after is the job's run_at
    supports_async_task = True  # run on the worker through async_to_sync
    supports_get_result = True  # the job row, from any process
    supports_priority = True  # a latency class

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        # Queue names are tenants: any is valid unless the project lists them.
        self.queues = set(params.get("QUEUES", ()))
        self.default_tenant: str | None = self.options.get("TENANT")

    def validate_task(self, task: Task) -> None:
        super().validate_task(task)
        if task.takes_context:
            raise InvalidTask("FairQueue's backend does not pass a task context (FairQueue tasks get a JobContext).")

    def _tenant_of(self, task: Task) -> str:
        if task.queue_name != DEFAULT_TASK_QUEUE_NAME:
            return str(task.queue_name)
        if not self.default_tenant:
            raise InvalidTask(
                "Name the tenant: my_task.using(queue_name=<tenant slug>), or OPTIONS['TENANT'] for the default."
            )
        return self.default_tenant

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        self.validate_task(task)
        run_after: datetime | None = task.run_after
        job = submit(
            self._tenant_of(task),
            DJANGO_TASK,
            {"task": task.module_path, "args": list(args), "kwargs": dict(kwargs)},
            priority=latency_class_of(task.priority),
            run_at=run_after.isoformat() if run_after is not None else None,
        )
        result = self._result_of(job, task)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        job = Job.objects.filter(pk=result_id, task=DJANGO_TASK).first() if _uuid_like(result_id) else None
        if job is None:
            raise TaskResultDoesNotExist(result_id)
        task = import_string(job.args["task"])
        return self._result_of(job, task)

    def _result_of(self, job: Job, task: Task) -> TaskResult:
        status = _STATUS[JobStatus(job.status)]
        errors = []
        if status == TaskResultStatus.FAILED:
            errors.append(TaskError(exception_class_path=job.error_reason or "cancelled", traceback=job.error))
        result = TaskResult(
            task=task,
            id=str(job.pk),
            status=status,
            enqueued_at=job.submitted_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            last_attempted_at=job.started_at,
            args=job.args.get("args", []),
            kwargs=job.args.get("kwargs", {}),
            backend=self.alias,
            errors=errors,
            worker_ids=[job.worker] if job.worker else [],
        )
        if status == TaskResultStatus.SUCCESSFUL:
            value = payloads.payload_get(job.result_ref) if job.result_ref else job.result
            object.__setattr__(result, "_return_value", value)
        return result


def _uuid_like(value: str) -> bool:
    try:
        Job._meta.pk.to_python(value)  # type: ignore[union-attr]
    except Exception:
        return False
    return True
