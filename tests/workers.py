"""Real Celery worker processes for tests: started with `manage.py worker`, killed for real."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from django.conf import settings
from django.db import connection

from fairqueue.bench.stack import ROLE_URL_VARIABLES, die_with_parent, engine_url_of, worker_argv
from fairqueue.engine.cluster import connect
from fairqueue.jobs.fleet import SEEN_KEY

ROOT = Path(__file__).resolve().parent.parent
# A test shard (scripts/test_shards.py) keeps its workers' logs apart.
LOG_DIR = Path(os.environ.get("FAIRQUEUE_TEST_LOG_DIR") or ROOT / "var" / "test-logs")


def worker_env(**overrides: str) -> dict[str, str]:
    """Point a child process at the test Redis database and the test SQLite file. Every role
    uses REDIS_URL unless `overrides` give it a URL of its own (ROLE_URL_VARIABLES), but for
    the broker of a test class on RabbitMQ (tests/rabbitmq.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ROLE_URL_VARIABLES}
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        env["DATABASE_URL"] = f"sqlite:///{db['NAME']}"
    else:
        password = f":{quote(db['PASSWORD'], safe='')}" if db.get("PASSWORD") else ""
        host = db["HOST"] or "127.0.0.1"
        env["DATABASE_URL"] = (
            f"postgres://{quote(db['USER'], safe='')}{password}@{host}:{db['PORT'] or 5432}/{db['NAME']}"
        )
    env["REDIS_URL"] = settings.REDIS_URL
    if settings.CELERY_BROKER_URL != settings.REDIS_URL:
        env["CELERY_BROKER_URL"] = settings.CELERY_BROKER_URL
    env["FAIRQUEUE_DEMO"] = "1"
    env.update(overrides)
    return env


_started: list[WorkerProcess] = []


def kill_all_workers() -> None:
    """Kill every worker a test started, even ones a failed assertion left running."""
    while _started:
        _started.pop().kill()


atexit.register(kill_all_workers)


class WorkerProcess:
    """One `manage.py worker` subprocess with `slots` thread slots."""

    def __init__(
        self,
        *,
        slots: int = 4,
        name: str | None = None,
        argv_prefix: Sequence[str] = (),
        options: Sequence[str] = (),
        quarantine: bool = False,
        **env: str,
    ) -> None:
        """`argv_prefix` runs the worker through another command (e.g. in a network namespace);
        `options` are more of `manage.py worker`'s (`--events`, say); `quarantine`: a worker of
        the quarantine lane only (`manage.py worker --quarantine`)."""
        self.slots = slots
        self.quarantine = quarantine
        self.argv_prefix = list(argv_prefix)
        self.options = list(options)
        self.hostname = f"{name or 'test'}-{uuid.uuid4().hex[:6]}@localhost"
        self.env = worker_env(**env)
        self.proc: subprocess.Popen[bytes] | None = None
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{self.hostname.split('@')[0]}.log"

    def start(self, timeout: float = 30.0) -> WorkerProcess:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                *self.argv_prefix,
                *worker_argv(hostname=self.hostname, slots=self.slots, loglevel="info"),
                *self.options,
                *(["--quarantine"] if self.quarantine else []),
            ],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # a crashed test run leaves no worker behind
        )
        _started.append(self)
        client = connect(engine_url_of(self.env))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if client.zscore(SEEN_KEY, self.hostname) is not None:
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited early; see {self.log_path}")
            time.sleep(0.1)
        raise RuntimeError(f"worker did not register in {timeout}s; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers run, exactly like a node that vanishes."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode if self.proc else None

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1, message: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")
