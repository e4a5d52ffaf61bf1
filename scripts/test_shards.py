#!/usr/bin/env python3
"""Run the test suite as several `manage.py test` processes at once (`make test`).

Most of the suite's time is spent waiting (real workers starting, jobs sleeping, browsers
loading, deadlines polled), not computing, so shards running side by side finish sooner
even on two cores. Each shard is a whole test run of its own, configured only through the
environment the settings already read, so no test can see another shard's state:

- shard 0 uses the Redis the caller configured (FAIRQUEUE_TEST_REDIS_URL, the Makefile's
  db 15 on 127.0.0.1:6379); every other shard starts a private `redis-server` on a free
  port (tests read server-wide figures such as INFO commandstats and change server
  settings such as maxmemory, so a shared server would not do);
- its own test database (SQLite file or PostgreSQL database name), payload directory and
  worker-log directory.

Test modules are dealt to shards by their recorded duration (tests/durations.json, seconds
per module; `manage.py test --module-durations PATH` writes a fresh one), longest first,
each to the shard with the least work so far. A module not in the file counts as
DEFAULT_MODULE_SECONDS; `--record` rewrites the file from the run. Output of each shard
goes to var/test-logs/shard-N.log; a failed shard's whole log is printed at the end, a
passed one's summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
DURATIONS_FILE = ROOT / "tests" / "durations.json"
LOG_DIR = ROOT / "var" / "test-logs"
DEFAULT_MODULE_SECONDS = 10.0
REDIS_START_TIMEOUT_SECONDS = 15.0
SUMMARY_LINES = 6  # a passed shard's tail: "Ran N tests", "OK", the slowest, ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_modules(labels: list[str]) -> list[str]:
    """`tests` stands for each of its test modules; any other label is kept as given."""
    units: list[str] = []
    for label in labels:
        if label in ("tests", "tests/", "./tests"):
            units += sorted(f"tests.{p.stem}" for p in (ROOT / "tests").glob("test_*.py"))
        else:
            units.append(label)
    return units


def deal(units: list[str], shards: int, durations: dict[str, float]) -> list[list[str]]:
    """Longest first, each to the least loaded shard (a greedy multiway partition)."""
    buckets: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(shards)]
    for unit in sorted(units, key=lambda u: -durations.get(u, DEFAULT_MODULE_SECONDS)):
        index = min(range(shards), key=lambda i: buckets[i][0])
        total, members = buckets[index]
        buckets[index] = (total + durations.get(unit, DEFAULT_MODULE_SECONDS), [*members, unit])
    return [members for _, members in buckets if members]


class PrivateRedis:
    """A redis-server on a free port that keeps nothing on disk."""

    def __init__(self, log_path: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (.ci/run installs it)")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=log_path.open("ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + REDIS_START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise SystemExit(f"redis-server on port {self.port} did not start; see {log_path}")

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def shard_env(index: int, redis_server: PrivateRedis | None) -> dict[str, str]:
    env = dict(os.environ)
    if index == 0:
        return env
    assert redis_server is not None
    env["FAIRQUEUE_TEST_REDIS_URL"] = redis_server.url(15)
    env["FAIRQUEUE_BENCH_TEST_REDIS_URL"] = redis_server.url(11)
    database_url = env.get("DATABASE_URL", "")
    if database_url.startswith(("postgres://", "postgresql://")):
        name = urlsplit(database_url).path.lstrip("/") or "postgres"
        env["FAIRQUEUE_TEST_DB_NAME"] = f"test_{name}_shard{index}"
    else:
        env["FAIRQUEUE_TEST_DB_NAME"] = str(ROOT / f"test_db_shard{index}.sqlite3")
    env["FAIRQUEUE_PAYLOAD_DIR"] = str(ROOT / "var" / f"payloads-shard{index}")
    env["FAIRQUEUE_TEST_LOG_DIR"] = str(LOG_DIR / f"shard{index}")
    env["FAIRQUEUE_BENCH_DIR"] = str(ROOT / "var" / "bench" / f"shard{index}")
    return env


def main() -> int:
    # Labels before `--`, `manage.py test` options after it (argparse alone would take an
    # option's value, such as the tag of `--exclude-tag distributed`, for a label).
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    own, test_args = sys.argv[1:split], sys.argv[split + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s [options] [LABEL ...] -- [test options]"
    )
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--record", action="store_true", help=f"rewrite {DURATIONS_FILE.name} from this run")
    parser.add_argument("labels", nargs="*", default=["tests"])
    args = parser.parse_args(own)
    units = test_modules(args.labels)
    durations = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.exists() else {}
    groups = deal(units, max(1, args.shards), durations)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    servers: list[PrivateRedis] = []
    running: list[tuple[int, subprocess.Popen[bytes], Path]] = []
    started = time.monotonic()
    try:
        for index, group in enumerate(groups):
            server = PrivateRedis(LOG_DIR / f"shard{index}-redis.log") if index else None
            if server:
                servers.append(server)
            log_path = LOG_DIR / f"shard-{index}.log"
            argv = [sys.executable, str(ROOT / "manage.py"), "test", *test_args, *group]
            if args.record:
                argv[3:3] = ["--module-durations", str(LOG_DIR / f"durations-shard{index}.json")]
            expected = sum(durations.get(u, DEFAULT_MODULE_SECONDS) for u in group)
            print(f"shard {index}: {len(group)} modules, ~{expected:.0f} s recorded, log {log_path}", flush=True)
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=shard_env(index, server), stdout=log_path.open("wb"), stderr=subprocess.STDOUT
            )
            running.append((index, proc, log_path))
        failed = []
        for index, proc, log_path in running:
            code = proc.wait()
            print(f"shard {index} ended with {code} after {time.monotonic() - started:.0f} s", flush=True)
            if code:
                failed.append(log_path)
        for index, _, log_path in running:
            lines = log_path.read_text(errors="replace").splitlines()
            shown = lines if log_path in failed else lines[-SUMMARY_LINES:]
            print(f"\n===== shard {index} ({log_path})" + (" FAILED" if log_path in failed else ""))
            print("\n".join(shown))
        print(f"\n{len(running)} shards, {len(units)} modules, {time.monotonic() - started:.0f} s in all", flush=True)
        if args.record and not failed:
            recorded = {unit: seconds for unit, seconds in durations.items() if unit in units}
            for index in range(len(running)):
                recorded.update(json.loads((LOG_DIR / f"durations-shard{index}.json").read_text()))
            DURATIONS_FILE.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")
        return 1 if failed else 0
    finally:
        for _, proc, _ in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for server in servers:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
