"""App config for the jobs side."""

import importlib

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules

from fairqueue import tracing
from fairqueue.conf import fq_settings

# The module of an installed app that registers its tasks, as Celery finds `tasks.py`.
TASKS_MODULE_NAME = "fairqueue_tasks"


class JobsConfig(AppConfig):
    name = "fairqueue.jobs"
    label = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        # Every import below reads models, which Django allows only once the app registry is
        # ready (this method): not a cycle dodged, the registry's order. Register the
        # worker's and the admin's signal handlers in every process.
        from fairqueue.jobs import signals, tasks, worker  # noqa: F401

        # From the OTEL_* environment, in every process (web, worker, commands): off by
        # default. Here, before the first request loads the middleware Django's
        # instrumentation adds. The run task registered above is what Celery's
        # instrumentation finds when it publishes (its span and the message's headers).
        tracing.tracing_configure()

        # Tasks, in the web process and the worker alike: every installed app's
        # `fairqueue_tasks` module, the listed modules, and the demo's in the demo only.
        autodiscover_modules(TASKS_MODULE_NAME)
        for module in fq_settings().TASK_MODULES:
            importlib.import_module(module)
        if fq_settings().DEMO_TASKS:
            importlib.import_module("fairqueue.jobs.demo_tasks")
        # The jobs side's answers to the tenants admin (providers: tenants imports no jobs code).
        from fairqueue.jobs.moves import tenants_move_preview
        from fairqueue.jobs.selectors import tenant_admin_live_state
        from fairqueue.jobs.whatif import whatif_compare
        from tenants.selectors import live_state_provider_register, move_preview_provider_register
        from tenants.whatif import whatif_runner_register

        live_state_provider_register(tenant_admin_live_state)
        move_preview_provider_register(tenants_move_preview)
        whatif_runner_register(whatif_compare)
