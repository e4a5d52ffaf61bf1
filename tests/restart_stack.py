"""A whole FairQueue stack on servers of its own, for tests that restart a dependency for
real: a private PostgreSQL (fairqueue.bench.postgres), private Redis servers for the engine
and, when asked, for the broker or the channel layer, the production web server and one
worker. Nothing is shared with the suite's own database or Redis, so stopping a server
here disturbs no other test."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.rows import dict_row

from fairqueue.bench.outages import staff_session
from fairqueue.bench.postgres import PostgresServer
from fairqueue.bench.stack import WebServer, Workers, migrate, stack_env
from tests.redis_server import RedisServer
from tests.web import STATIC_ROOT
from tests.workers import LOG_DIR, ROOT

TERMINAL = ("succeeded", "failed", "cancelled")
JOBS = "/api/v1/jobs"

_TENANTS_CODE = """
import json
from tenants.models import Shard, Tenant
shard, _ = Shard.objects.get_or_create(name="default")
keys = {}
for slug, floor, cap in json.loads(%r):
    t = Tenant(slug=slug, name=slug, shard=shard, floor=floor, max_concurrency=cap)
    keys[slug] = t.rotate_api_key()
    t.full_clean()
    t.save()
print(json.dumps(keys))
"""


@dataclass
class Answer:
    status: int
    body: Any
    content_type: str
    seconds: float
    headers: dict[str, str] = field(default_factory=dict)


class OutageStack:
    """Start with `start()`, stop with `stop()`; `broker` is "redis" (a server of its own,
    which can be restarted) or an amqp:// URL; `own_channels` gives the channel layer a
    Redis server of its own."""

    def __init__(
        self, *, broker: str = "engine", own_channels: bool = False, slots: int = 4, lease_seconds: float = 10.0
    ) -> None:
        self.pg = PostgresServer(base_dir=LOG_DIR)
        self.engine_redis = RedisServer()
        self.broker_redis = RedisServer() if broker == "redis" else None
        self.channels_redis = RedisServer() if own_channels else None
        self.broker = broker
        self.slots = slots
        self.lease_seconds = lease_seconds
        self.web: WebServer | None = None
        self.workers: Workers | None = None
        self.keys: dict[str, str] = {}
        self.database_url = ""

    def start(self, tenants: list[tuple[str, int, int | None]]) -> OutageStack:
        self.pg.start()
        self.engine_redis.start()
        extra: dict[str, str] = {}
        if self.broker_redis is not None:
            extra["CELERY_BROKER_URL"] = self.broker_redis.start().url
        elif self.broker.startswith("amqp"):
            extra["CELERY_BROKER_URL"] = self.broker
        if self.channels_redis is not None:
            extra["CHANNELS_REDIS_URL"] = self.channels_redis.start().url
        self.database_url = self.pg.create_database("fq")
        self.env = stack_env(
            redis_url=self.engine_redis.url,
            db_path=ROOT / "unused.sqlite3",
            database_url=self.database_url,
            STATIC_ROOT=str(STATIC_ROOT),
            FAIRQUEUE_LEASE_SECONDS=str(self.lease_seconds),
            FAIRQUEUE_PAYLOAD_DIR=str(self.pg.dir / "payloads"),
            **extra,
        )
        migrate(self.env)
        from_shell = self.manage_shell(_TENANTS_CODE % json.dumps(tenants))
        self.keys = json.loads(from_shell.strip().splitlines()[-1])
        self.web = WebServer(env=self.env, log_dir=LOG_DIR, production=True, processes=1, collect_static=True).start()
        self.workers = Workers(count=1, slots=self.slots, env=self.env, log_dir=LOG_DIR, name="outage").start()
        return self

    def manage_shell(self, code: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", "shell", "-c", code],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode:
            raise RuntimeError(f"manage.py shell failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def staff_session(self) -> str:
        """A logged-in staff user's session key (the admin and the dashboard need one)."""
        return staff_session(self.env)

    def stop(self) -> None:
        for stop in (
            self.workers.stop if self.workers else None,
            self.web.stop if self.web else None,
            self.engine_redis.stop,
            self.broker_redis.stop if self.broker_redis else None,
            self.channels_redis.stop if self.channels_redis else None,
            self.pg.destroy,
        ):
            if stop is not None:
                with contextlib.suppress(Exception):  # best effort: the rest must stop too
                    stop()

    # --- HTTP ---------------------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, *, tenant: str | None = None, session: str | None = None
    ) -> Answer:
        assert self.web is not None
        headers = {"Content-Type": "application/json"}
        if session is not None:
            headers["Cookie"] = f"sessionid={session}"
        if tenant is not None:
            headers["Authorization"] = f"Bearer {self.keys[tenant]}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.web.base_url + path, data=data, headers=headers, method=method)
        started = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                raw, status, message = resp.read(), resp.status, resp.headers
        except urllib.error.HTTPError as exc:
            raw, status, message = exc.read(), exc.code, exc.headers
        seconds = time.monotonic() - started
        got = {name.title(): value for name, value in message.items()}
        content_type = got.get("Content-Type", "")
        parsed: Any = raw.decode(errors="replace")
        if content_type.startswith("application/json"):
            parsed = json.loads(raw or b"null")
        return Answer(status=status, body=parsed, content_type=content_type, seconds=seconds, headers=got)

    def submit(self, tenant: str, job: dict[str, Any]) -> Answer:
        return self.request("POST", JOBS, job, tenant=tenant)

    # --- the record, read straight from the private database -----------------------------------

    def rows(self, sql: str, *params: Any) -> list[dict[str, Any]]:
        with psycopg.connect(self.database_url, row_factory=dict_row, connect_timeout=5) as conn:
            return list(conn.execute(sql, params).fetchall())

    def jobs(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        found = self.rows(
            "SELECT id::text AS id, status, error_reason, attempts, worker_losses, started_at, timeline "
            "FROM jobs_job WHERE id::text = ANY(%s)",
            ids,
        )
        return {row["id"]: row for row in found}

    def ledger_writes(self, ids: list[str]) -> dict[str, int]:
        found = self.rows("SELECT job_id::text AS id, writes FROM jobs_ledgerentry WHERE job_id::text = ANY(%s)", ids)
        return {row["id"]: row["writes"] for row in found}

    def wait_terminal(self, ids: list[str], *, timeout: float) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.jobs(ids)
            if len(jobs) == len(ids) and all(j["status"] in TERMINAL for j in jobs.values()):
                return jobs
            if time.monotonic() > deadline:
                waiting = {i: jobs[i]["status"] if i in jobs else "missing" for i in ids}
                raise AssertionError(f"jobs not finished within {timeout}s: {waiting}")
            time.sleep(0.25)
