"""Web servers for tests, on the test database and Redis: the production server
(gunicorn + uvicorn workers, static files collected) or daphne (development)."""

from __future__ import annotations

from fairqueue.bench.stack import WebServer
from tests.workers import LOG_DIR, ROOT, worker_env

# Tests collect static files here, never into a demo's var/static.
STATIC_ROOT = ROOT / "var" / "test-static"


def web_server(*, production: bool = True, processes: int = 2, **env: str) -> WebServer:
    """A server (not started) whose processes use the test database, Redis and STATIC_ROOT,
    with the static files collected there."""
    return WebServer(
        env=worker_env(STATIC_ROOT=str(STATIC_ROOT), **env),
        log_dir=LOG_DIR,
        production=production,
        processes=processes,
        collect_static=True,
    )
