"""A cursor for the statements sent for every job (a worker's: the delivery's row read, the
group commit's claim and outcome batches; a web process's: a single submit's INSERT,
fairqueue.jobs.copy_insert.row_insert): on PostgreSQL each is prepared once per
connection and then only executed, with its parameters bound by the server.

Why: Django's psycopg cursors bind parameters on the client and send every statement as
new text, so PostgreSQL parsed and planned the row read (a three-table join over the job
table's many columns) and the batch UPDATEs anew for each job; that planning was most of
PostgreSQL's CPU per job and of the statements' round trip (docs/throughput.md, "Prepared
statements for the worker's per-job SQL"). The statements' texts are built once per shape
(fairqueue.jobs.jobrows, fairqueue.jobs.groupcommit), so a connection holds a few dozen
prepared statements at most; psycopg keeps them per connection (its `prepared_max`) and
prepares them again on a new one.

The cursor is wrapped as Django wraps its own, so the connection's execute wrappers see
its statements (the bench counts them so). SQLite, a connection that logs its queries
(DEBUG on, assertNumQueries: Django's log reads a statement's SQL from what psycopg
records of one it does not prepare), or FAIRQUEUE_DB_PREPARED=0 (say, behind a pooler in
transaction mode that does not carry prepared statements) gets the connection's ordinary
cursor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.postgresql.psycopg_any import register_tzloader
from psycopg.pq import Format

from fairqueue.conf import fq_settings

POSTGRESQL = "postgresql"
TIMESTAMPTZ_OID = 1184  # PostgreSQL's type oid of timestamptz (what Django's backend checks too)
# Django opens psycopg connections with prepared statements off (prepare_threshold None),
# which no cursor can override; this turns them on. It applies to server-binding cursors
# only (Django's own cursors bind on the client and never prepare), and PreparedCursor
# prepares at the first execution whatever the count.
PREPARE_THRESHOLD = 5  # psycopg's own default


class PreparedCursor(psycopg.Cursor[Any]):
    """Server-side binding, and every statement prepared: psycopg prepares a statement once
    per connection, then sends only its name and parameters."""

    def execute(  # type: ignore[override]
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> PreparedCursor:
        super().execute(query, params, prepare=True if prepare is None else prepare, binary=binary)
        return self


def prepared_raw_cursor(raw_connection: psycopg.Connection[Any]) -> PreparedCursor:
    """A PreparedCursor on an open psycopg connection, with the connection's prepared
    statements turned on."""
    if raw_connection.prepare_threshold is None:
        raw_connection.prepare_threshold = PREPARE_THRESHOLD
    return PreparedCursor(raw_connection)


def prepared_enabled(connection: BaseDatabaseWrapper) -> bool:
    """Whether `hot_cursor` prepares statements on this connection."""
    return connection.vendor == POSTGRESQL and bool(fq_settings().DB_PREPARED)


@contextmanager
def hot_cursor(connection: Any) -> Iterator[Any]:
    """A cursor on `connection`, used as `connection.cursor()` is, whose statements are
    prepared on PostgreSQL; the ordinary cursor elsewhere."""
    # A connection logging its queries (DEBUG, assertNumQueries) keeps Django's own cursor:
    # the log takes a statement's SQL from what psycopg records of one it sends unprepared.
    if not prepared_enabled(connection) or connection.queries_logged:
        with connection.cursor() as cursor:
            yield cursor
        return
    # What BaseDatabaseWrapper._cursor does, with this cursor class instead of the
    # connection's cursor factory, and the time zone as the backend's create_cursor sets it.
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors:
        raw = prepared_raw_cursor(connection.connection)
        tzloader = connection.connection.adapters.get_loader(TIMESTAMPTZ_OID, Format.TEXT)
        if connection.timezone != tzloader.timezone:
            register_tzloader(connection.timezone, raw)
        cursor = connection._prepare_cursor(raw)
    with cursor:
        yield cursor
