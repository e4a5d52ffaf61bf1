"""A real Redis Cluster on this machine: 3 primaries and 3 replicas of `redis-server
--cluster-enabled yes`, joined with `redis-cli --cluster create`, for the cluster tests and
`manage.py chaos --cluster`.

Nodes keep nothing on disk but their cluster configuration, in a temporary directory, so a
node killed and started again rejoins the cluster (as a replica of whoever took its slots)
with no data. The node timeout is short (`NODE_TIMEOUT_MS`), so a primary that dies is
replaced by its replica within a few seconds, and `cluster-require-full-coverage no` lets the
other primaries serve their slots meanwhile (the default stops the whole cluster while any
slot has no primary).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.cluster import key_slot

from fairqueue.bench.stack import die_with_parent

NODE_TIMEOUT_MS = 1500
SLOTS = 16384
NODES = 6  # 3 primaries, each with one replica
BUS_PORT_OFFSET = 10000  # Redis Cluster's bus listens on port + 10000
PORTS_ENV = "FAIRQUEUE_TEST_CLUSTER_PORTS"  # e.g. "7101-7106": fixed ports instead of free ones


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    node_id: str
    port: int
    primary: bool
    primary_id: str  # the primary it replicates ("" for a primary)
    slots: tuple[tuple[int, int], ...]
    failed: bool


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_ports(count: int = NODES) -> list[int]:
    """`count` ports whose cluster bus ports (port + 10000) are free too."""
    ports: list[int] = []
    candidates = list(range(20000, 30000))
    random.shuffle(candidates)
    for port in candidates:
        if _bindable(port) and _bindable(port + BUS_PORT_OFFSET):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise ClusterError("no free ports for a local Redis Cluster")


def ports_from_env(default: Sequence[int] | None = None) -> list[int]:
    """Ports from FAIRQUEUE_TEST_CLUSTER_PORTS ("7101-7106" or "7101,7102,..."), else
    `default`, else free ones."""
    raw = os.environ.get(PORTS_ENV, "").strip()
    if raw:
        return parse_ports(raw)
    return list(default) if default else free_cluster_ports()


def parse_ports(spec: str) -> list[int]:
    """ "7111-7116" or "7111,...": the ports of a cluster's nodes."""
    if "-" in spec:
        first, last = (int(p) for p in spec.split("-", 1))
        return list(range(first, last + 1))
    return [int(p) for p in spec.split(",")]


class LocalCluster:
    """Six `redis-server` processes in cluster mode on local `ports`, 3 primaries with a
    replica each. `start()` creates the cluster and waits until every node agrees."""

    def __init__(self, ports: Sequence[int], *, node_timeout_ms: int = NODE_TIMEOUT_MS, log_dir: Path) -> None:
        if len(ports) != NODES:
            raise ClusterError(f"a local cluster needs {NODES} ports, got {list(ports)}")
        for binary in ("redis-server", "redis-cli"):
            if shutil.which(binary) is None:
                raise ClusterError(f"{binary} is not installed (.ci/run installs redis-server, which has both)")
        self.ports = list(ports)
        self.node_timeout_ms = node_timeout_ms
        self.log_dir = log_dir
        self.dir = Path(tempfile.mkdtemp(prefix="fq-cluster-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    # --- processes --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The URL clients are given: any node will do, the client finds the others."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def client(self, port: int) -> redis.Redis:
        """A plain client of one node (not of the cluster)."""
        return redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=5)

    def start_node(self, port: int) -> None:
        argv = [
            "redis-server",
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--cluster-enabled", "yes",
            "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-require-full-coverage", "no",
            "--save", "",
            "--appendonly", "no",
        ]  # fmt: skip
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"cluster-{port}.log").open("ab")
        self.procs[port] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError):
                if self.client(port).ping():
                    return
            time.sleep(0.05)
        raise ClusterError(f"redis-server did not answer on port {port}; see {self.log_dir}")

    def start(self, timeout: float = 60.0) -> LocalCluster:
        for port in self.ports:
            self.start_node(port)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        done = subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode:
            raise ClusterError(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}")
        self.wait_healthy(timeout=timeout)
        return self

    def kill(self, port: int) -> None:
        """SIGKILL one node: no shutdown, no last words to its replica."""
        proc = self.procs.get(port)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def restart(self, port: int) -> None:
        """Start a killed node again: it rejoins with its node id and no data."""
        self.kill(port)
        self.start_node(port)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- topology -----------------------------------------------------------------------------------

    def alive(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def nodes(self) -> list[Node]:
        """The cluster's view of itself (CLUSTER NODES), asked of a live node."""
        for port in self.alive():
            with contextlib.suppress(redis.RedisError):
                return _nodes(self.client(port).cluster("NODES"))
        raise ClusterError("no node of the cluster answers")

    def primary_of_slot(self, slot: int) -> Node:
        for node in self.nodes():
            if node.primary and not node.failed and any(a <= slot <= b for a, b in node.slots):
                return node
        raise ClusterError(f"no primary serves slot {slot}")

    def primary_of(self, key: str) -> Node:
        """The primary that holds `key` (hash tags count, as for the engine's keys)."""
        return self.primary_of_slot(key_slot(key.encode()))

    def replicas_of(self, primary: Node) -> list[Node]:
        return [n for n in self.nodes() if n.primary_id == primary.node_id and not n.failed]

    def primaries(self) -> list[Node]:
        return sorted((n for n in self.nodes() if n.primary and not n.failed and n.slots), key=lambda n: n.port)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until every live node says the cluster is ok with 3 primaries serving every slot and
        every replica's link to its primary is up and caught up."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                last = self._health_problem()
            except redis.RedisError as exc:
                last = repr(exc)
            if not last:
                return
            time.sleep(0.1)
        raise ClusterError(f"the cluster did not settle within {timeout}s: {last}")

    def _health_problem(self) -> str:
        for port in self.alive():
            info = self.client(port).cluster("INFO")
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != SLOTS:
                return f"node {port} says: {info}"
        primaries = self.primaries()
        if len(primaries) != NODES // 2:
            return f"{len(primaries)} primaries"
        for primary in primaries:
            offset = int(self.client(primary.port).info("replication")["master_repl_offset"])
            replicas = self.replicas_of(primary)
            if not replicas:
                return f"primary {primary.port} has no replica"
            for replica in replicas:
                rinfo = self.client(replica.port).info("replication")
                if rinfo.get("master_link_status") != "up":
                    return f"replica {replica.port} is not linked to its primary"
                if int(rinfo.get("slave_repl_offset", -1)) < offset:
                    return f"replica {replica.port} is behind"
        return ""

    def wait_failover(self, old: Node, timeout: float = 30.0) -> tuple[Node, float]:
        """After `old` died: until another node serves its slots; (that node, seconds waited)."""
        started = time.monotonic()
        slot = old.slots[0][0]
        while time.monotonic() - started < timeout:
            with contextlib.suppress(ClusterError, redis.RedisError):
                node = self.primary_of_slot(slot)
                if node.node_id != old.node_id:
                    return node, time.monotonic() - started
            time.sleep(0.05)
        raise ClusterError(f"no replica took over the slots of {old.port} within {timeout}s")

    def flush_all(self) -> None:
        """Empty every primary (data and functions): a cluster with nothing in it."""
        for primary in self.primaries():
            client = self.client(primary.port)
            client.flushall()
            client.function_flush()

    def dbsize(self) -> int:
        return sum(int(self.client(p.port).dbsize()) for p in self.primaries())

    def keys(self, pattern: str = "*") -> Iterator[str]:
        for primary in self.primaries():
            yield from self.client(primary.port).scan_iter(match=pattern, count=1000)


def _nodes(parsed: dict[str, dict[str, Any]]) -> list[Node]:
    """Nodes from redis-py's parsed CLUSTER NODES ({"host:port": fields})."""
    nodes = []
    for addr, fields in parsed.items():
        flags = fields["flags"].split(",")
        nodes.append(
            Node(
                node_id=fields["node_id"],
                port=int(addr.rsplit(":", 1)[1]),
                primary="master" in flags,
                primary_id="" if fields["master_id"] == "-" else fields["master_id"],
                slots=tuple((int(r[0]), int(r[-1])) for r in fields["slots"]),
                failed="fail" in flags or "fail?" in flags,
            )
        )
    return nodes
