"""App config of the invoices example: nothing to do in ready(), FairQueue finds the
app's `fairqueue_tasks` module itself."""

from django.apps import AppConfig


class InvoicesConfig(AppConfig):
    name = "examples.invoices"
    label = "invoices"
    verbose_name = "Invoices (example tasks)"
    default_auto_field = "django.db.models.BigAutoField"
