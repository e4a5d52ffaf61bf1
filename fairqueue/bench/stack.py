"""Start and stop the real stack for a benchmark: fresh SQLite file, a dedicated Redis
database (and, when asked, a RabbitMQ virtual host as the broker), `manage.py worker`
processes and (for the submit path) a web server: the production one (gunicorn +
uvicorn workers) or daphne.

Everything here works on explicit URLs and environments, never on this process's
settings, so one orchestrating process can run several isolated stacks in a row.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

import redis
from amqp.exceptions import NotFound
from kombu import Connection

from fairqueue.engine.cluster import connect
from fairqueue.queues import BATCH_QUEUE, JOBS_QUEUE, broker_is_amqp

ROOT = Path(__file__).resolve().parents[2]
# Where a bench keeps its databases, logs and records; FAIRQUEUE_BENCH_DIR gives each of the
# test suite's parallel shards its own (two benches in one folder share a template database).
BENCH_DIR = Path(os.environ.get("FAIRQUEUE_BENCH_DIR") or ROOT / "var" / "bench")
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/8"
ASGI_APP = "fairqueue.asgi:application"
SEEN_KEY = "fq:workers:seen"  # fairqueue.jobs.worker.SEEN_KEY (not imported: no Django needed here)
# Settings that give a role its own server (fairqueue/settings.py, Redis section): a stack
# inherits none from this process's environment, so its REDIS_URL serves every role unless
# the caller says otherwise.
ROLE_URL_VARIABLES = ("FAIRQUEUE_ENGINE_URL", "CELERY_BROKER_URL", "CHANNELS_REDIS_URL", "CACHE_URL")


class StackError(RuntimeError):
    pass


def add_redis_arguments(parser: Any) -> None:
    """--redis-url and --force, shared by the benches that run the whole stack
    (redis_db_prepare enforces them)."""
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="a Redis database for the bench alone (flushed)")
    parser.add_argument("--force", action="store_true", help="flush --redis-url even if it holds data")


def redis_db_prepare(url: str, *, force: bool) -> None:
    """Empty the bench's Redis database; refuse if it holds data unless forced."""
    client = redis.Redis.from_url(url)
    size = client.dbsize()
    if size and not force:
        raise StackError(
            f"Redis at {url} holds {size} keys; the benchmark flushes its database. "
            "Point --redis-url at an empty database or pass --force."
        )
    client.flushdb()


def redis_db_flush(url: str) -> None:
    redis.Redis.from_url(url).flushdb()


def amqp_broker_check(url: str) -> None:
    """Refuse anything but a RabbitMQ URL (the Redis broker is the bench's own database)."""
    if not broker_is_amqp(url):
        raise StackError(f"--broker-url takes an amqp:// URL, not {url!r}: the Redis broker is --redis-url")


def amqp_queues_waiting(url: str) -> int:
    """Messages waiting in FairQueue's queues on the RabbitMQ virtual host at `url`."""
    waiting = 0
    with Connection(url, connect_timeout=5) as conn:
        for name in (JOBS_QUEUE, BATCH_QUEUE):
            channel = conn.channel()
            try:
                _, count, _ = channel.queue_declare(name, passive=True)
                waiting += count
            except NotFound:  # never declared here (the error closes the channel)
                continue
            channel.close()
    return waiting


def amqp_broker_prepare(url: str, *, force: bool) -> None:
    """Check the bench's RabbitMQ virtual host answers and holds no FairQueue messages
    (unless forced: the bench deletes its queues), then empty it."""
    amqp_broker_check(url)
    try:
        waiting = amqp_queues_waiting(url)
    except OSError as exc:
        raise StackError(
            f"no RabbitMQ answers at {url} ({exc}); create the virtual host first "
            "(rabbitmqctl add_vhost NAME; rabbitmqctl set_permissions -p NAME USER '.*' '.*' '.*')"
        ) from exc
    if waiting and not force:
        raise StackError(
            f"{url} holds {waiting} messages in {JOBS_QUEUE}/{BATCH_QUEUE}; the benchmark deletes those "
            "queues. Point --broker-url at a virtual host of its own or pass --force."
        )
    amqp_broker_flush(url)


def amqp_broker_flush(url: str) -> None:
    """Delete FairQueue's queues on the virtual host (with their messages): each run declares
    them afresh, with the arguments of the code under test."""
    with Connection(url, connect_timeout=5) as conn:
        for name in (JOBS_QUEUE, BATCH_QUEUE):
            conn.default_channel.queue_delete(name)


def broker_label(url: str) -> str:
    """A broker URL without its credentials, for reports."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or ''}{parts.path}"


def stack_env(*, redis_url: str, db_path: Path, database_url: str | None = None, **extra: str) -> dict[str, str]:
    """Environment for every process of one stack: its Redis database and its database
    (the SQLite file `db_path`, or `database_url` when given). `extra` may give roles
    their own servers (ROLE_URL_VARIABLES)."""
    env = {k: v for k, v in os.environ.items() if k not in ROLE_URL_VARIABLES}
    env.update(
        {
            "REDIS_URL": redis_url,
            "DATABASE_URL": database_url or f"sqlite:///{db_path}",
            "FAIRQUEUE_DEMO": "1",
            "DEBUG": "0",  # measure production-like: no SQL debug logging (the demo's .env sets DEBUG=1)
            "DJANGO_SETTINGS_MODULE": "fairqueue.settings",
            "LOG_LEVEL": "WARNING",
            "FAIRQUEUE_LOG_LEVEL": "WARNING",
        }
    )
    env.update(extra)
    return env


def engine_url_of(env: dict[str, str]) -> str:
    """Where a stack's engine state and worker registry live."""
    return env.get("FAIRQUEUE_ENGINE_URL") or env["REDIS_URL"]


def fresh_database(db_path: Path, env: dict[str, str]) -> None:
    """Delete the SQLite file (and its WAL) and migrate a new one."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{db_path}{suffix}").unlink(missing_ok=True)
    migrate(env)


def fresh_postgres(server_url: str, name: str) -> str:
    """Drop and create database `name` on the PostgreSQL server; return its URL (migrate next)."""
    import psycopg  # optional: only a run with --database-url needs the PostgreSQL driver here

    base = server_url.rstrip("/")
    server, _, _ = base.rpartition("/") if base.count("/") > 2 else (base, "", "")
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{server}/{name}"


def migrate(env: dict[str, str]) -> None:
    """Run `manage.py migrate` against the database named in `env`."""
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise StackError(f"migrate failed:\n{done.stdout}\n{done.stderr}")


class Workers:
    """`count` real `manage.py worker` processes with `slots` thread slots each."""

    def __init__(self, *, count: int, slots: int, env: dict[str, str], log_dir: Path, name: str = "bench") -> None:
        self.count = count
        self.slots = slots
        self.env = env
        self.log_dir = log_dir
        self.hostnames = [f"{name}{i}-{uuid.uuid4().hex[:6]}@localhost" for i in range(count)]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def total_slots(self) -> int:
        return self.count * self.slots

    def start(self, *, timeout: float = 60.0) -> Workers:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for hostname in self.hostnames:
            log = (self.log_dir / f"{hostname.split('@')[0]}.log").open("wb")
            self.procs.append(
                subprocess.Popen(
                    worker_argv(hostname=hostname, slots=self.slots),
                    cwd=ROOT,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=die_with_parent,
                )
            )
        client = connect(engine_url_of(self.env))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(client.zscore(SEEN_KEY, h) is not None for h in self.hostnames):
                return self
            for proc, hostname in zip(self.procs, self.hostnames, strict=True):
                if proc.poll() is not None:
                    self.stop()
                    raise StackError(f"worker {hostname} exited early; see {self.log_dir}")
            time.sleep(0.1)
        self.stop()
        raise StackError(f"workers did not register within {timeout}s; see {self.log_dir}")

    def stop(self, timeout: float = 15.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs = []

    def __enter__(self) -> Workers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def worker_argv(*, hostname: str, slots: int, loglevel: str = "warning") -> list[str]:
    """The command line of one real worker process (threads pool), for benches, chaos, tests."""
    return [
        sys.executable,
        "manage.py",
        "worker",
        f"--concurrency={slots}",
        "--pool=threads",
        f"--hostname={hostname}",
        "-l",
        loglevel,
    ]


def die_with_parent() -> None:
    """preexec_fn for child processes: SIGKILL them when the process that started them dies,
    so a crashed benchmark or test run can never leave workers consuming from its Redis."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_static_collected: set[str] = set()


def static_collect(env: dict[str, str]) -> None:
    """`manage.py collectstatic` into the STATIC_ROOT of `env`, once per folder and process
    (the production server serves hashed, compressed copies from there)."""
    root = env.get("STATIC_ROOT", "")
    if root in _static_collected:
        return
    done = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise StackError(f"collectstatic failed:\n{done.stdout}\n{done.stderr}")
    _static_collected.add(root)


def gunicorn_argv(*, port: int, processes: int) -> list[str]:
    """The production web server (README): gunicorn supervising uvicorn worker processes,
    with gunicorn.conf.py's settings (metrics across processes, no control socket)."""
    return [
        sys.executable,
        "-m",
        "gunicorn",
        ASGI_APP,
        "--config",
        str(ROOT / "gunicorn.conf.py"),
        "-k",
        "uvicorn_worker.UvicornWorker",
        "-w",
        str(processes),
        "--bind",
        f"127.0.0.1:{port}",
    ]


def daphne_argv(*, port: int) -> list[str]:
    """The development server: one daphne process."""
    return [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), ASGI_APP]


class WebServer:
    """fairqueue.asgi on a free local port: daphne, one process, as in development; or with
    `production=True` gunicorn supervising `processes` uvicorn worker processes, ready once
    every process has started. `collect_static=True` runs collectstatic first (needed for
    pages, not for the API)."""

    def __init__(
        self,
        *,
        env: dict[str, str],
        log_dir: Path,
        port: int | None = None,
        production: bool = False,
        processes: int = 2,
        collect_static: bool = False,
    ) -> None:
        self.env = env
        self.port = port or free_port()
        self.production = production
        self.processes = processes if production else 1
        self.collect_static = collect_static
        self.name = "gunicorn" if production else "daphne"
        self.log_path = log_dir / f"web-{self.name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, timeout: float = 60.0) -> Self:
        if self.collect_static:
            static_collect(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_from = self.log_path.stat().st_size if self.log_path.exists() else 0  # a restart appends
        argv = (
            gunicorn_argv(port=self.port, processes=self.processes) if self.production else daphne_argv(port=self.port)
        )
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=self.env,
            stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StackError(f"{self.name} exited early; see {self.log_path}")
            if self.ready(log_from):
                return self
            time.sleep(0.1)
        self.stop()
        raise StackError(f"{self.name} did not start within {timeout}s; see {self.log_path}")

    def argv(self) -> list[str]:
        if self.production:
            return gunicorn_argv(port=self.port, processes=self.processes)
        return daphne_argv(port=self.port)

    def ready(self, log_from: int) -> bool:
        """gunicorn: every worker process says it started (gunicorn listens before they
        boot); daphne: it accepts connections."""
        if not self.production:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return True
            except OSError:
                return False
        with self.log_path.open("rb") as log:
            log.seek(log_from)
            return log.read().count(b"Application startup complete") >= self.processes

    def stop(self) -> None:
        """SIGTERM: gunicorn stops its workers gracefully (open websockets are closed)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def web_processes_default() -> int:
    """The web processes a production server runs here unless told otherwise: WEB_CONCURRENCY,
    else two per core (gunicorn.conf.py's rule; the benchmarks pass the number explicitly)."""
    return int(os.environ.get("WEB_CONCURRENCY", 2 * (os.cpu_count() or 1)))


class GunicornServer(WebServer):
    """The production server with `processes` worker processes (the benchmarks' name for it)."""

    def __init__(self, *, env: dict[str, str], log_dir: Path, processes: int, port: int | None = None) -> None:
        super().__init__(env=env, log_dir=log_dir, port=port, production=True, processes=processes)


def run_child(module: str, args: list[str], *, env: dict[str, str], timeout: float) -> None:
    """Run `python -m module args` in the stack's environment (its own Django settings)."""
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, timeout=timeout)
    if done.returncode:
        raise StackError(f"{module} {' '.join(args)} failed with exit code {done.returncode}")
