"""Where a policy change comes from: the field every historical policy row carries besides
django-simple-history's own (who, when, the row's values, the reason), and the source of
the change in progress.

django-simple-history keeps one history table per policy model (tenants.models); a row is
written in the same transaction as the change, so history and policy never disagree and
a deleted object's history stays. The source is said explicitly where it is known (a
policy file, a migration, a revert), else read from the request the history middleware
saw: the admin's pages, or any other HTTP request (a REST call); outside a request it is
a command (manage.py, a shell, a script).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from django.db import models
from django.urls import NoReverseMatch, reverse
from simple_history.models import HistoricalRecords


class Source(models.TextChoices):
    ADMIN = "admin", "admin"
    REST = "rest", "REST"
    COMMAND = "command", "command"
    FILE = "file", "policy file"
    MIGRATION = "migration", "migration"


_source: ContextVar[str | None] = ContextVar("fq_policy_change_source", default=None)


@contextmanager
def change_source(source: Source) -> Iterator[None]:
    """Record the policy changes made inside as coming from `source`."""
    token = _source.set(source.value)
    try:
        yield
    finally:
        _source.reset(token)


def _admin_prefix() -> str:
    try:
        return reverse("admin:index")
    except NoReverseMatch:  # a host without the admin
        return "\0"


def source_current() -> str:
    """The source of a policy change made now."""
    explicit = _source.get()
    if explicit is not None:
        return explicit
    request = getattr(HistoricalRecords.context, "request", None)
    if request is None:
        return Source.COMMAND.value
    return Source.ADMIN.value if request.path.startswith(_admin_prefix()) else Source.REST.value


class PolicyChangeFields(models.Model):
    """Added to every historical policy model (HistoricalRecords(bases=...))."""

    history_source = models.CharField(max_length=16, choices=Source.choices, default=Source.COMMAND)

    class Meta:
        abstract = True


# The reason an operator gives is free text; the admin's field and the command's option
# keep it to this many characters.
REASON_MAX_LENGTH = 500
