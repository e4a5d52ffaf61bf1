"""The `fairqueue` app: carries FairQueue's templates and its settings' system checks.

A host lists it in INSTALLED_APPS beside the apps that hold the models (README, "Add
FairQueue to your Django project").
"""

from pathlib import Path

from django.apps import AppConfig

_PACKAGE = Path(__file__).resolve().parent


def _templates_home() -> str:
    """The folder whose `templates/` Django's app-directories loader reads for this app.

    An installed FairQueue carries the templates in the package (the wheel maps the
    repository's top-level templates/ to fairqueue/templates); a checkout keeps them at
    the top level, so there the app's folder is the repository's root.
    """
    return str(_PACKAGE if (_PACKAGE / "templates").is_dir() else _PACKAGE.parent)


class FairQueueConfig(AppConfig):
    name = "fairqueue"
    label = "fairqueue"
    verbose_name = "FairQueue"
    path = _templates_home()

    def ready(self) -> None:
        # Registers the settings check with Django's check framework.
        from fairqueue import checks  # noqa: F401
