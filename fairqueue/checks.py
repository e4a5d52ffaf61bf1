"""System checks (`manage.py check`): a wrong FairQueue setting, named, before anything runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core.checks import CheckMessage, Error, register

from fairqueue.conf import configured_problems

SETTINGS_ERROR = "fairqueue.E001"


@register()
def fairqueue_settings_check(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """One error per wrong key, type or value in settings.FAIRQUEUE (fairqueue/conf.py)."""
    return [
        Error(problem, hint="docs/settings.md lists every setting and its default.", id=SETTINGS_ERROR)
        for problem in configured_problems()
    ]
