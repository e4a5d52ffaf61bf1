"""The database going away and coming back: which errors mean it is unreachable, how a
thread's connections heal, and how a worker's bookkeeping waits for it.

A restart, failover or maintenance window of PostgreSQL kills every open connection. A
connection Django holds (a pool thread's, the duty thread's) then fails its next query
and keeps failing until it is closed; the connections idle in psycopg's pool are dead too.
`connections_heal` closes the calling thread's broken connections (Django's own check,
which a request does at its start and end) and asks the pool to check its idle ones, so
the next query opens a live one. Every long-lived thread calls it after a failure.

A worker's own record keeping (reading a delivery's row, the claim, the outcome) is not
the customer's job: while the database is unreachable it waits for it (`db_wait`),
holding the job's slot and lease, rather than failing the job or dropping the delivery.
A task's own database errors go through its retry policy (TRANSIENT_DB_ERRORS are retried
by the default policy: fairqueue.jobs.retry_policy).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import InterfaceError, OperationalError, connections

log = logging.getLogger("fairqueue.jobs.database")

T = TypeVar("T")

# The database is unreachable or the connection broke: refused, reset, closed by a
# restart, a pool that could not hand out a connection in time (psycopg_pool.PoolTimeout
# is an OperationalError), a server shutting down. Errors about the statement itself
# (IntegrityError, DataError, ProgrammingError) are not among them.
TRANSIENT_DB_ERRORS: tuple[type[Exception], ...] = (OperationalError, InterfaceError)

# A worker waits this long at most for the database before it gives a job's bookkeeping up
# (the job's hold then runs out and it is delivered again, as after a worker's death).
DB_WAIT_SECONDS = 600.0
DB_WAIT_FIRST_SECONDS = 0.1
DB_WAIT_MAX_SECONDS = 2.0
# The pool's idle connections are checked at most this often per process.
POOL_CHECK_EVERY_SECONDS = 1.0

_pool_checked = 0.0
_pool_lock = threading.Lock()


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT_DB_ERRORS)


def connections_heal() -> None:
    """Close this thread's connections that failed and no longer answer (outside a
    transaction: one in progress is its owner's to end), and have the pool drop its dead
    idle connections. Cheap when nothing failed: Django only checks a connection that saw
    an error."""
    for conn in connections.all(initialized_only=True):
        if conn.in_atomic_block:
            continue
        try:
            conn.close_if_unusable_or_obsolete()
        except Exception:  # closing a dead connection may fail too; it is gone either way
            log.debug("closing a broken connection failed", exc_info=True)
    _pools_check()


def _pools_check() -> None:
    global _pool_checked
    with _pool_lock:
        if time.monotonic() - _pool_checked < POOL_CHECK_EVERY_SECONDS:
            return
        _pool_checked = time.monotonic()
    for conn in connections.all(initialized_only=True):
        # Only a PostgreSQL connection has a pool (None when pooling is off).
        pool = getattr(conn, "pool", None) if conn.vendor == "postgresql" else None
        if pool is None:
            continue
        try:
            pool.check()
        except Exception:  # the server is still away: the pool reconnects by itself later
            log.debug("the connection pool's check failed", exc_info=True)


def db_wait(fn: Callable[[], T], *, what: str, wait_seconds: float = DB_WAIT_SECONDS) -> T:
    """`fn()`, called again after each transient database error (the connection healed
    between tries, waits growing to DB_WAIT_MAX_SECONDS) until it succeeds or
    `wait_seconds` have passed; then the last error is raised. Only for work that is
    safe to repeat: a compare-and-set, a read. `what` names it in the log (once when the
    waiting starts, once when it ends)."""
    deadline = time.monotonic() + wait_seconds
    pause = DB_WAIT_FIRST_SECONDS
    started: float | None = None
    while True:
        try:
            result = fn()
        except TRANSIENT_DB_ERRORS as exc:
            connections_heal()
            now = time.monotonic()
            if started is None:
                started = now
                log.warning("database unreachable during %s (%s); waiting for it", what, exc)
            if now + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, DB_WAIT_MAX_SECONDS)
            continue
        if started is not None:
            log.warning("database back after %.1f s; %s done", time.monotonic() - started, what)
        return result
