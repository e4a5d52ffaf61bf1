"""A private PostgreSQL server for the runs and tests that restart the database for real.

Stopping the machine's own server would break everything else using it, so a restart is
rehearsed on a server of the run's own: `initdb` into a fresh folder, started on a free
local port, stopped `immediate` (what a crash or a failover does to every connection) and
started again on the same data. PostgreSQL refuses to run as root: as root the server runs
as the `postgres` user (Debian's packages create it), which owns the folder.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

import psycopg

from fairqueue.bench.stack import StackError, free_port

SERVER_USER = "postgres"
START_TIMEOUT_SECONDS = 60


def postgres_bin(name: str) -> str:
    """A PostgreSQL server program: on PATH, else the newest Debian install's."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    if not candidates:
        raise StackError(f"{name} not found: install PostgreSQL's server (Debian: apt-get install postgresql)")
    return candidates[-1]


class PostgresServer:
    """initdb'd into its own folder; `stop()` then `start()` is a restart that keeps the data."""

    def __init__(self, *, base_dir: Path | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fq-pg-", dir=base_dir))
        self.data = self.dir / "data"
        self.log_path = self.dir / "server.log"
        self.port = free_port()
        self._as_root = os.geteuid() == 0
        if self._as_root:
            user = pwd.getpwnam(SERVER_USER)
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        self._run(postgres_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8")

    def _run(self, *argv: str) -> None:
        command = ["runuser", "-u", SERVER_USER, "--", *argv] if self._as_root else list(argv)
        done = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_SECONDS, check=False)
        if done.returncode:
            raise StackError(f"{' '.join(argv[:2])} failed: {done.stdout}{done.stderr}")

    def url(self, database: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> Self:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run(postgres_bin("pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.log_path), "-w", "start")
        return self

    def stop(self, *, mode: str = "immediate") -> None:
        """`immediate`: every connection dies at once, as in a crash or a failover."""
        self._run(postgres_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def running(self) -> bool:
        try:
            psycopg.connect(self.url(), connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    def wait_running(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while not self.running():
            if time.monotonic() > deadline:
                raise StackError(f"the private PostgreSQL on port {self.port} did not start; see {self.log_path}")
            time.sleep(0.2)

    def destroy(self) -> None:
        if self.running():
            self.stop(mode="fast")
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
