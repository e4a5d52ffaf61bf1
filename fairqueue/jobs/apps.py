"""App config for the jobs side."""

import importlib

from django.apps import AppConfig
from django.conf import settings

from fairqueue import tracing


class JobsConfig(AppConfig):
    name = "fairqueue.jobs"
    label = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        # Every import below reads models, which Django allows only once the app registry is
        # ready (this method): not a cycle dodged, the registry's order. Register the demo
        # tasks, the worker's and the admin's signal handlers in every process.
        from fairqueue.jobs import demo_tasks, signals, tasks, worker  # noqa: F401

        # From the OTEL_* environment, in every process (web, worker, commands): off by
        # default. Here, before the first request loads the middleware Django's
        # instrumentation adds. The run task registered above is what Celery's
        # instrumentation finds when it publishes (its span and the message's headers).
        tracing.tracing_configure()

        # The deployment's own task modules: each registers its tasks on import.
        for module in settings.FAIRQUEUE["TASK_MODULES"]:
            importlib.import_module(module)
        # The jobs side's answers to the tenants admin (providers: tenants imports no jobs code).
        from fairqueue.jobs.moves import tenants_move_preview
        from fairqueue.jobs.selectors import tenant_admin_live_state
        from fairqueue.jobs.whatif import whatif_compare
        from tenants.selectors import live_state_provider_register, move_preview_provider_register
        from tenants.whatif import whatif_runner_register

        live_state_provider_register(tenant_admin_live_state)
        move_preview_provider_register(tenants_move_preview)
        whatif_runner_register(whatif_compare)
