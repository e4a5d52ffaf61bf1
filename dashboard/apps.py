"""App config for the dashboard: registers the Prometheus collector once."""

from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"
    verbose_name = "Dashboard"

    def ready(self) -> None:
        from dashboard.metrics import collector_register

        collector_register()
