"""Many new rows in one PostgreSQL COPY: what bulk_create writes, without its per-value work.

bulk_create prepares every field of every object through the field's methods and sends the
columns as arrays that psycopg quotes value by value in Python; for a bulk submit that cost
more than the rest of the job's write. COPY takes the rows as they are (psycopg formats them
in C). The values are those bulk_create would write: each field's `pre_save` where it sets
the value (auto_now_add), JSON fields adapted as the backend adapts them, anything else as
the object holds it (the database's own types: UUID, datetime, numbers, strings).

The COPY goes through the connection's execute wrappers and its query log like any other
statement, and a database error (a unique key taken) is raised as Django's.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

from django.db import connection
from django.db.models import DateField, Field, JSONField, Model

Value = Callable[[Model], Any]


def rows_copy(model: type[Model], objs: Sequence[Model]) -> None:
    """Insert `objs` (new rows, primary keys set) in one COPY, in the caller's transaction."""
    fields = list(model._meta.concrete_fields)
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    sql = f"COPY {connection.ops.quote_name(model._meta.db_table)} ({columns}) FROM STDIN"
    # Every value read at once (operator.attrgetter), then the few fields that need more.
    read_all = operator.attrgetter(*(f.attname for f in fields))
    ops = connection.ops  # looked up once: `connection` is a proxy to this thread's connection
    special = [(i, value) for i, f in enumerate(fields) if (value := _special_value(f, ops)) is not None]
    rows = []
    for obj in objs:
        row = list(read_all(obj))
        for i, value in special:
            row[i] = value(obj)
        rows.append(row)
    with connection.cursor() as cursor:
        executor = _copy_executor(rows)
        for wrapper in reversed(connection.execute_wrappers):
            executor = functools.partial(wrapper, executor)
        started = time.monotonic()
        with connection.wrap_database_errors:
            executor(sql, None, False, {"connection": connection, "cursor": cursor})
        if connection.queries_logged:
            connection.queries_log.append({"sql": sql, "time": f"{time.monotonic() - started:.3f}"})
    for obj in objs:  # saved, as bulk_create leaves them: a later save() updates
        obj._state.adding = False
        obj._state.db = connection.alias


def _copy_executor(rows: list[list[Any]]) -> Callable[..., None]:
    def execute(sql: str, params: Any, many: bool, context: dict[str, Any]) -> None:
        with context["cursor"].cursor.copy(sql) as copy:
            for row in rows:
                copy.write_row(row)

    return execute


def _special_value(field: Field[Any, Any], ops: Any) -> Value | None:
    """How a field's value is read from an object for COPY, where it is not the attribute
    as it is (see the module docstring); `ops`: the connection's operations."""
    if isinstance(field, DateField) and (field.auto_now or field.auto_now_add):
        return lambda obj: field.pre_save(obj, add=True)
    if isinstance(field, JSONField):
        attname, encoder = field.attname, field.encoder

        def json_value(obj: Model) -> Any:
            value = getattr(obj, attname)
            return None if value is None else ops.adapt_json_value(value, encoder)

        return json_value
    return None
