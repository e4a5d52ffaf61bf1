"""A private redis-server for the tests and runs that stop Redis for real (an outage) or
break it: a restart of one role's server (the broker's, the channel layer's) must not touch
the others."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from fairqueue.bench.stack import ROOT, die_with_parent, free_port

DEFAULT_LOG_DIR = ROOT / "var" / "logs"


class RedisServer:
    """redis-server on a free local port, keeping nothing on disk; stop() and start()
    again is an outage after which it comes back empty, as a restarted Redis does."""

    def __init__(self, *, bind: str = "127.0.0.1", data_dir: str | None = None, log_dir: Path | None = None) -> None:
        """`bind` "0.0.0.0" serves hosts in network namespaces too (tests/netns.py). With
        `data_dir`, a SAVE writes a snapshot there and a restart loads it (as a server with
        persistence does), instead of coming back empty."""
        self.bind = bind
        self.data_dir = data_dir
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (.ci/run installs it)")
        self.binary = binary
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        log_dir = log_dir or DEFAULT_LOG_DIR
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)

    def start(self, timeout: float = 15.0) -> RedisServer:
        argv = [self.binary, "--port", str(self.port), "--bind", self.bind, "--save", "", "--appendonly", "no"]
        if self.bind != "127.0.0.1":  # reachable from the test's own hosts, without a password
            argv += ["--protected-mode", "no"]
        if self.data_dir:
            argv += ["--dir", self.data_dir]
        self.proc = subprocess.Popen(
            argv, stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}; see {self.log_path}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
