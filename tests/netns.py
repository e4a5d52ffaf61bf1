"""Test hosts in Linux network namespaces: several machines on this one.

Each host is a network namespace joined to the root namespace by its own veth pair (a
point-to-point /30: the root side is the host's gateway, the services the hosts share
listen there). Cutting a host sets the root side of its link down: everything it had
over the network (Redis, the broker, a PostgreSQL server) is gone, while its processes
keep running, as on a real partition; healing sets the link up again. Needs root (CI
has it) and iproute2.
"""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import subprocess
import threading
from collections.abc import Sequence

# 10.213.<host index>.0/30 per host: .1 is the root namespace's end, .2 the host's.
SUBNET_PREFIX = "10.213"
# Interface names are at most 15 bytes (IFNAMSIZ - 1).
IFNAME_MAX = 15


def netns_available() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (.ci/run installs it)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


class Host:
    """One network namespace with a veth link to the root namespace."""

    def __init__(self, name: str, index: int) -> None:
        suffix = f"{os.getpid() % 100000}-{index}"
        self.name = name
        self.namespace = f"fq-{name}-{suffix}"
        self.root_if = f"fqr{suffix}"[:IFNAME_MAX]
        self.host_if = f"fqh{suffix}"[:IFNAME_MAX]
        self.gateway = f"{SUBNET_PREFIX}.{index}.1"  # the root namespace, seen from this host
        self.address = f"{SUBNET_PREFIX}.{index}.2"
        self.created = False

    def create(self) -> Host:
        _ip("netns", "add", self.namespace)
        self.created = True
        _ip("link", "add", self.root_if, "type", "veth", "peer", "name", self.host_if, "netns", self.namespace)
        _ip("addr", "add", f"{self.gateway}/30", "dev", self.root_if)
        _ip("link", "set", self.root_if, "up")
        _ip("-n", self.namespace, "addr", "add", f"{self.address}/30", "dev", self.host_if)
        _ip("-n", self.namespace, "link", "set", self.host_if, "up")
        _ip("-n", self.namespace, "link", "set", "lo", "up")
        _ip("-n", self.namespace, "route", "add", "default", "via", self.gateway)
        return self

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def cut(self) -> None:
        """Partition the host: its only link goes down (its processes keep running)."""
        _ip("link", "set", self.root_if, "down")

    def heal(self) -> None:
        _ip("link", "set", self.root_if, "up")

    def destroy(self) -> None:
        if not self.created:
            return
        subprocess.run(["ip", "link", "del", self.root_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)
        self.created = False


class TcpForwarder:
    """Forward connections from every address of the root namespace on `port` to a server
    that only listens on loopback (the machine's PostgreSQL), so hosts in namespaces reach
    it through their gateway. Cutting a host's link cuts these connections too."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("0.0.0.0", 0), backlog=64, reuse_port=False)
        self.port: int = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-forwarder", daemon=True)

    def start(self) -> TcpForwarder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.listener.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        with selectors.DefaultSelector() as sel:
            sel.register(a, selectors.EVENT_READ)
            sel.register(b, selectors.EVENT_READ)
            try:
                while True:
                    for event, _ in sel.select():
                        sock = event.fileobj
                        assert isinstance(sock, socket.socket)
                        data = sock.recv(65536)
                        if not data:
                            return
                        peers[sock].sendall(data)
            except OSError:
                return
            finally:
                a.close()
                b.close()
