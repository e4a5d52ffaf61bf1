"""The Redis commands this test process sent, and those its scripts ran, counted from
MONITOR: a count no other client of the same server changes (a worker still shutting down,
another test's duties), where the server's INFO commandstats counts every client's.

Redis runs one command at a time, and MONITOR lists a script's own commands right after
the script's call: a script's lines belong to whoever sent the call before them.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psutil
import redis

LUA_CLIENT = "lua"
JOIN_SECONDS = 10.0


class ProcessCommands:
    """`with ProcessCommands(url) as own: ...`, then `own.counts`: {"cmdstat_<name>": calls}
    (INFO commandstats' names) of the commands this process sent to the server at `url`
    inside the block."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.counts: dict[str, int] = {}
        self._lines: list[dict[str, Any]] = []
        self._marker = f"fq-monitor-end-{uuid.uuid4().hex}"

    def __enter__(self) -> ProcessCommands:
        self._client = redis.Redis.from_url(self.url)
        self._port = int(self._client.connection_pool.connection_kwargs.get("port", 6379))
        self._monitor = self._client.monitor()
        self._monitor.__enter__()  # MONITOR answered: every later command is listed
        self._thread = threading.Thread(target=self._read, name="redis-monitor", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._monitor.listen():
            if self._marker in line["command"]:
                return
            self._lines.append(line)

    def __exit__(self, *exc: object) -> None:
        ours = self._own_ports()
        self._client.echo(self._marker)
        self._thread.join(JOIN_SECONDS)
        self._monitor.__exit__(None, None, None)
        self._client.close()
        counts: dict[str, int] = {}
        owner_is_us = False
        for line in self._lines:
            if line["client_type"] != LUA_CLIENT:
                owner_is_us = int(line["client_port"] or 0) in ours
            if owner_is_us:
                name = "cmdstat_" + line["command"].split(" ", 1)[0].lower()
                counts[name] = counts.get(name, 0) + 1
        self.counts = counts

    def _own_ports(self) -> set[int]:
        """The local ports of this process's connections to the server."""
        return {
            c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.raddr and c.raddr.port == self._port
        }
