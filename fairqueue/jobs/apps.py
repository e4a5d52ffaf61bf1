"""App config for the jobs side."""

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "fairqueue.jobs"
    label = "jobs"
    verbose_name = "Jobs"
