"""App config for the jobs side."""

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "fairqueue.jobs"
    label = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        # Register the demo tasks and the worker's signal handlers in every process.
        from fairqueue.jobs import demo_tasks, worker  # noqa: F401
