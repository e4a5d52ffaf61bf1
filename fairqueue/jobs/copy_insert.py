"""New rows on PostgreSQL without the ORM's per-statement work: many in one COPY
(rows_copy, what bulk_create writes), one by an INSERT built once per model and process
(row_insert, what `save(force_insert=True)` writes).

bulk_create prepares every field of every object through the field's methods and sends the
columns as arrays that psycopg quotes value by value in Python; for a bulk submit that cost
more than the rest of the job's write. COPY takes the rows as they are (psycopg formats them
in C). The values are those bulk_create would write: each field's `pre_save` where it sets
the value (auto_now_add), JSON fields adapted as the backend adapts them, anything else as
the object holds it (the database's own types: UUID, datetime, numbers, strings).

A lone row's INSERT was dominated by the ORM compiling the same statement anew and the
client-side binding quoting every value in Python (Django's psycopg cursor binds on the
client); row_insert's statement is built once and its values bound by the server, and
prepared once per connection (fairqueue.jobs.prepared, unless FAIRQUEUE_DB_PREPARED=0),
which spares PostgreSQL the parse and plan.

Both statements go through the connection's execute wrappers and its query log like any
other statement, and a database error (a unique key taken) is raised as Django's.
"""

from __future__ import annotations

import functools
import operator
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import DateField, Field, JSONField, Model

from fairqueue.jobs.prepared import prepared_enabled, prepared_raw_cursor

# How one field's value is read from an object, for the connection it is written on.
Value = Callable[[Model, BaseDatabaseWrapper], Any]


def _connection() -> BaseDatabaseWrapper:
    # The default connection itself, looked up once per statement: each attribute read
    # through django.db.connection (a proxy) looks it up again in asgiref's Local.
    return connections[DEFAULT_DB_ALIAS]


def rows_copy(model: type[Model], objs: Sequence[Model]) -> None:
    """Insert `objs` (new rows, primary keys set) in one COPY, in the caller's transaction."""
    db = _connection()
    fields = list(model._meta.concrete_fields)
    columns = ", ".join(db.ops.quote_name(f.column) for f in fields)
    sql = f"COPY {db.ops.quote_name(model._meta.db_table)} ({columns}) FROM STDIN"
    # Every value read at once (operator.attrgetter), then the few fields that need more.
    read_all = operator.attrgetter(*(f.attname for f in fields))
    special = [(i, value) for i, f in enumerate(fields) if (value := _special_value(f)) is not None]
    rows = []
    for obj in objs:
        row = list(read_all(obj))
        for i, value in special:
            row[i] = value(obj, db)
        rows.append(row)
    _run(db, _copy_executor(rows), sql, None)
    for obj in objs:  # saved, as bulk_create leaves them: a later save() updates
        obj._state.adding = False
        obj._state.db = db.alias


@dataclass(frozen=True)
class _Insert:
    sql: str
    read_all: Callable[[Model], tuple[Any, ...]]
    special: list[tuple[int, Value]]


_inserts: dict[type[Model], _Insert] = {}
_inserts_lock = threading.Lock()


def _insert_plan(model: type[Model], db: BaseDatabaseWrapper) -> _Insert:
    plan = _inserts.get(model)
    if plan is None:
        with _inserts_lock:
            plan = _inserts.get(model)
            if plan is None:
                fields = list(model._meta.concrete_fields)
                qn = db.ops.quote_name
                columns = ", ".join(qn(f.column) for f in fields)
                marks = ", ".join(["%s"] * len(fields))
                plan = _inserts[model] = _Insert(
                    sql=f"INSERT INTO {qn(model._meta.db_table)} ({columns}) VALUES ({marks})",
                    read_all=operator.attrgetter(*(f.attname for f in fields)),
                    special=[(i, value) for i, f in enumerate(fields) if (value := _special_value(f)) is not None],
                )
    return plan


def row_insert(model: type[Model], obj: Model) -> None:
    """Insert `obj` (a new row, primary key set) by one INSERT of every column, in the
    caller's transaction or its own (autocommit), as `obj.save(force_insert=True)` would
    (without the model's save signals, as bulk_create and rows_copy). PostgreSQL only."""
    db = _connection()
    plan = _insert_plan(model, db)
    row = list(plan.read_all(obj))
    for i, value in plan.special:
        row[i] = value(obj, db)
    _run(db, _insert_executor, plan.sql, row)
    obj._state.adding = False  # saved, as save() leaves it: a later save() updates
    obj._state.db = db.alias


def _insert_executor(sql: str, params: Any, many: bool, context: dict[str, Any]) -> None:
    # A server-binding cursor on the same connection (Django's own binds on the client),
    # preparing the statement unless prepared statements are turned off.
    raw = context["cursor"].cursor.connection
    cursor = prepared_raw_cursor(raw) if prepared_enabled(context["connection"]) else psycopg.Cursor(raw)
    with cursor:
        cursor.execute(sql, params)


def _run(db: BaseDatabaseWrapper, executor: Callable[..., None], sql: str, params: Any) -> None:
    """Run `executor` as Django runs a statement: through the connection's execute
    wrappers, with its errors as Django's, in its query log when that is on."""
    with db.cursor() as cursor:
        for wrapper in reversed(db.execute_wrappers):
            executor = functools.partial(wrapper, executor)
        started = time.monotonic()
        with db.wrap_database_errors:
            executor(sql, params, False, {"connection": db, "cursor": cursor})
        if db.queries_logged:
            db.queries_log.append({"sql": sql, "time": f"{time.monotonic() - started:.3f}"})


def _copy_executor(rows: list[list[Any]]) -> Callable[..., None]:
    def execute(sql: str, params: Any, many: bool, context: dict[str, Any]) -> None:
        with context["cursor"].cursor.copy(sql) as copy:
            for row in rows:
                copy.write_row(row)

    return execute


def _special_value(field: Field[Any, Any]) -> Value | None:
    """How a field's value is read from an object for COPY, where it is not the attribute
    as it is (see the module docstring)."""
    if isinstance(field, DateField) and (field.auto_now or field.auto_now_add):
        return lambda obj, db: field.pre_save(obj, add=True)
    if isinstance(field, JSONField):
        attname, encoder = field.attname, field.encoder

        def json_value(obj: Model, db: BaseDatabaseWrapper) -> Any:
            value = getattr(obj, attname)
            return None if value is None else db.ops.adapt_json_value(value, encoder)

        return json_value
    return None
