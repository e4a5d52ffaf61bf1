"""What a worker reads about its own resources: memory, CPU and Linux pressure stalls.

A worker in a container is limited by its cgroup (v2: `memory.max`, `cpu.max`), and the
kernel kills it by the cgroup's count, so when the cgroup has a memory limit the sample
uses it and the cgroup's working set (`memory.current` less reclaimable `inactive_file`,
what the kubelet and the OOM killer look at). Outside a limited cgroup the worker's own
RSS (with its children's) is measured against the machine's RAM, or against
`memory_limit_bytes` when configured. Pressure stall information (`/proc/pressure/*`,
Linux 4.20+) is the share of the last 10 s in which some task waited on a resource.
Every reading is optional: what the machine does not offer is None, never an error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
PRESSURE_DIR = Path("/proc/pressure")
PRESSURE_RESOURCES = ("cpu", "memory", "io")
UNLIMITED = "max"


@dataclass(frozen=True)
class ResourceSample:
    """One reading. Fractions are 0..1; None where the machine does not tell."""

    memory_used_bytes: int
    memory_limit_bytes: int
    memory_source: str  # "cgroup" (working set of a limited cgroup) or "rss" (this worker)
    cpu: float | None  # busy share of the CPUs this worker may use
    pressure: dict[str, float] = field(default_factory=dict)  # resource -> "some" avg10 share

    @property
    def memory(self) -> float:
        return self.memory_used_bytes / self.memory_limit_bytes if self.memory_limit_bytes else 0.0


def cgroup_dir(*, proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> Path | None:
    """This process's cgroup v2 directory (the `0::<path>` line), if it is mounted."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            path = root / line[3:].lstrip("/")
            return path if (path / "cgroup.controllers").exists() else None
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_memory(directory: Path) -> tuple[int, int] | None:
    """(working set, limit) of a cgroup v2 with a memory limit; None without a limit."""
    limit, current = _read(directory / "memory.max"), _read(directory / "memory.current")
    if not limit or limit == UNLIMITED or current is None:
        return None
    inactive_file = 0
    for line in (_read(directory / "memory.stat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "inactive_file":
            inactive_file = int(value)
            break
    return max(0, int(current) - inactive_file), int(limit)


def cgroup_cpu_quota(directory: Path) -> float | None:
    """CPUs the cgroup may use (`cpu.max` quota / period); None when unlimited."""
    text = _read(directory / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == UNLIMITED or not period:
        return None
    return int(quota) / int(period)


def cgroup_cpu_usage_seconds(directory: Path) -> float | None:
    for line in (_read(directory / "cpu.stat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "usage_usec":
            return int(value) / 1_000_000
    return None


def pressure_read(resource: str, *, directory: Path = PRESSURE_DIR) -> float | None:
    """The `some avg10` share (0..1) of /proc/pressure/<resource>, None if absent."""
    text = _read(directory / resource)
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            for part in line.split()[1:]:
                name, _, value = part.partition("=")
                if name == "avg10":
                    return float(value) / 100
    return None


class ResourceSampler:
    """Reads this worker's resources; keeps what it needs between reads (CPU deltas)."""

    def __init__(
        self,
        *,
        memory_limit_bytes: int = 0,
        cgroup: Path | None = None,
        pressure_dir: Path = PRESSURE_DIR,
        detect_cgroup: bool = True,
    ) -> None:
        self.cgroup = cgroup if cgroup is not None else (cgroup_dir() if detect_cgroup else None)
        self.pressure_dir = pressure_dir
        self.configured_limit = memory_limit_bytes
        self.process = psutil.Process()
        self.cpu_quota = cgroup_cpu_quota(self.cgroup) if self.cgroup else None
        self._cpu_last: tuple[float, float] | None = None  # (monotonic, usage seconds)
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement

    def _rss(self) -> int:
        rss = self.process.memory_info().rss
        for child in self.process.children(recursive=True):
            try:
                rss += child.memory_info().rss
            except psutil.Error:  # the child ended between the listing and the read
                continue
        return rss

    def _memory(self) -> tuple[int, int, str]:
        if not self.configured_limit and self.cgroup is not None:
            cgroup = cgroup_memory(self.cgroup)
            if cgroup is not None:
                return cgroup[0], cgroup[1], "cgroup"
        limit = self.configured_limit or psutil.virtual_memory().total
        return self._rss(), limit, "rss"

    def _cpu(self) -> float | None:
        if self.cgroup is not None and self.cpu_quota:
            usage = cgroup_cpu_usage_seconds(self.cgroup)
            if usage is not None:
                now = time.monotonic()
                last, self._cpu_last = self._cpu_last, (now, usage)
                if last is None or now <= last[0]:
                    return None
                return min(1.0, (usage - last[1]) / (now - last[0]) / self.cpu_quota)
        return psutil.cpu_percent(interval=None) / 100

    def sample(self) -> ResourceSample:
        used, limit, source = self._memory()
        pressure = {}
        for resource in PRESSURE_RESOURCES:
            value = pressure_read(resource, directory=self.pressure_dir)
            if value is not None:
                pressure[resource] = value
        return ResourceSample(
            memory_used_bytes=used, memory_limit_bytes=limit, memory_source=source, cpu=self._cpu(), pressure=pressure
        )
