"""Dependencies a run restarts under load, each on a server of the run's own, and a watcher of
the live dashboard that tells when its updates resume after the channel layer's restart.

- "database": a private PostgreSQL (fairqueue.bench.postgres), stopped `immediate` and
  started again on the same data: what a crash, a failover or a minor upgrade does;
- "broker": the Celery broker on a Redis server of its own, killed and started empty (it
  keeps nothing on disk, so its deliveries are lost);
- "channels": the channel layer on a Redis server of its own, killed and started empty.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.sync.client import connect as ws_connect

from fairqueue.bench.postgres import PostgresServer
from fairqueue.bench.redis_server import RedisServer
from fairqueue.bench.stack import ROOT, StackError

DASHBOARD_PATH = "/ws/dashboard/"
RECONNECT_PAUSE_SECONDS = 0.5  # the page's own first reconnect delay


class RestartedServers:
    """The private servers of the dependencies a run restarts (none when it restarts none)."""

    def __init__(self, restarts: tuple[str, ...], *, run_dir: Path, log_dir: Path) -> None:
        self.postgres = PostgresServer(base_dir=run_dir) if "database" in restarts else None
        self.broker = RedisServer(log_dir=log_dir) if "broker" in restarts else None
        self.channels = RedisServer(log_dir=log_dir) if "channels" in restarts else None
        self.database_url: str | None = None

    def start(self) -> Self:
        if self.postgres is not None:
            self.database_url = self.postgres.start().create_database("chaos")
        for server in (self.broker, self.channels):
            if server is not None:
                server.start()
        return self

    @property
    def role_urls(self) -> dict[str, str]:
        """The stack's settings that put a restarted role on its own server."""
        urls = {}
        if self.broker is not None:
            urls["CELERY_BROKER_URL"] = self.broker.url
        if self.channels is not None:
            urls["CHANNELS_REDIS_URL"] = self.channels.url
        return urls

    def describe(self) -> str:
        parts = [f"{role} on {url}" for role, url in self.role_urls.items()]
        return "".join(f", {part}" for part in parts)

    def switch(self, dependency: str, *, up: bool) -> None:
        server: PostgresServer | RedisServer | None = {
            "database": self.postgres,
            "broker": self.broker,
            "channels": self.channels,
        }[dependency]
        if server is None:
            raise StackError(f"{dependency} has no server of the run's own to restart")
        if up:
            server.start()
        else:
            server.stop()

    def stop(self) -> None:
        for server in (self.broker, self.channels):
            if server is not None:
                server.stop()
        if self.postgres is not None:
            self.postgres.destroy()


_SESSION_CODE = """
from django.contrib.auth.models import User
from django.contrib.sessions.backends.db import SessionStore
user, _ = User.objects.get_or_create(username="chaos-operator", defaults={"is_staff": True})
session = SessionStore()
session["_auth_user_id"] = str(user.pk)
session["_auth_user_backend"] = "django.contrib.auth.backends.ModelBackend"
session["_auth_user_hash"] = user.get_session_auth_hash()
session.create()
print(session.session_key)
"""


def staff_session(env: dict[str, str]) -> str:
    """A logged-in staff user's session key in the stack's database (the dashboard needs one)."""
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", _SESSION_CODE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode:
        raise StackError(f"could not make a staff session:\n{done.stdout}\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


class DashboardWatch:
    """Watches the live dashboard as a browser does: one websocket, reconnected whenever it
    closes; records when each update arrived."""

    def __init__(self, base_url: str, session_key: str) -> None:
        self.base_url = base_url
        self.session_key = session_key
        self.frames: list[float] = []  # monotonic times
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-watch", daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def first_after(self, moment: float) -> float | None:
        """Seconds from `moment` (monotonic) to the first update after it, if one came."""
        later = [t for t in self.frames if t > moment]
        return round(later[0] - moment, 2) if later else None

    def _run(self) -> None:
        url = self.base_url.replace("http", "ws", 1) + DASHBOARD_PATH
        headers = {"Cookie": f"sessionid={self.session_key}", "Origin": self.base_url}
        while not self._stop.is_set():
            try:
                with ws_connect(url, additional_headers=headers, open_timeout=5) as socket:
                    while not self._stop.is_set():
                        try:
                            socket.recv(timeout=1)
                        except TimeoutError:
                            continue
                        self.frames.append(time.monotonic())
            except (ConnectionClosed, InvalidHandshake, OSError, TimeoutError):
                self._stop.wait(RECONNECT_PAUSE_SECONDS)


def restarts_report(events: list[dict[str, Any]], dashboard: DashboardWatch | None) -> list[dict[str, Any]]:
    """One entry per outage: when it started, how long, and for the channel layer how long
    after its return the dashboard's updates resumed (None: they did not)."""
    out: list[dict[str, Any]] = []
    downs = [e for e in events if e["event"] == "down"]
    for down in downs:
        up = next((e for e in events if e["event"] == "up" and e["dependency"] == down["dependency"]), None)
        entry: dict[str, Any] = {
            "dependency": down["dependency"],
            "down_at_s": down["at_s"],
            "outage_s": round(up["at_s"] - down["at_s"], 2) if up else None,
        }
        if down["dependency"] == "channels":
            entry["dashboard_resumed_s"] = dashboard.first_after(up["_t"]) if dashboard and up else None
        out.append(entry)
    return out
