"""CPU time per job of one `bench throughput --only noop` run, by phase (plain Celery, then
FairQueue) and by process role: counted from /proc, not timed, so it stays comparable on a
machine shared with other work (docs/throughput.md, "A no-op job's CPU on the worker").

    python scripts/noop_cpu_by_phase.py sample OUT.jsonl SECONDS --redis-port P --match TEXT &
    python manage.py bench throughput --only noop ... --redis-url redis://127.0.0.1:P/12 ...
    python scripts/noop_cpu_by_phase.py report OUT.jsonl [--jobs 5000]

`sample` writes, every SAMPLE_SECONDS, Redis's command counts and the utime + stime of the
run's processes: its workers, web processes and bench client (the processes whose command
line or working directory contains TEXT, say the checkout's path), its PostgreSQL backends
(whose command line names a database containing TEXT) and the Redis server on port P. A
sample is in the FairQueue phase when Redis ran more than FCALLS_PER_SAMPLE FCALLs in it
(the engine's calls), in the Celery phase when it ran pushes and pops but not that many
FCALLs (the duty tick's few calls run in both). Use one run per file (the phases repeat).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import time
from pathlib import Path

import redis

SAMPLE_SECONDS = 0.5
FCALLS_PER_SAMPLE = 20
PUSHES_PER_SAMPLE = 20
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _role(pid: str, cmd: str, match: str, port: int) -> str | None:
    if cmd.startswith("postgres") and match in cmd:
        return "pg"
    if "redis-server" in cmd and f":{port}" in cmd:
        return "redis"
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    if match not in cwd and match not in cmd:
        return None
    if "bench-throughput-" in cmd:
        return "worker"
    if "gunicorn" in cmd:
        return "web"
    if "--child" in cmd:
        return "client"
    return None


def _cpu_ticks(match: str, port: int) -> dict[str, int]:
    ticks: collections.Counter[str] = collections.Counter()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        role = _role(pid, cmd, match, port)
        if role:
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks[role] += int(fields[11]) + int(fields[12])  # utime, stime
    return dict(ticks)


def sample(out: Path, seconds: float, *, port: int, match: str) -> None:
    client = redis.Redis(port=port)
    end = time.monotonic() + seconds
    with out.open("w") as f:
        while time.monotonic() < end:
            calls = {name: stats["calls"] for name, stats in client.info("commandstats").items()}
            f.write(json.dumps({"t": time.time(), "redis": calls, "cpu": _cpu_ticks(match, port)}) + "\n")
            f.flush()
            time.sleep(SAMPLE_SECONDS)


def report(path: Path, *, jobs: int) -> dict[str, dict[str, float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    ticks: dict[str, collections.Counter[str]] = {"celery": collections.Counter(), "fairqueue": collections.Counter()}
    for before, after in itertools.pairwise(rows):
        calls = {name: n - before["redis"].get(name, 0) for name, n in after["redis"].items()}
        if calls.get("cmdstat_fcall", 0) > FCALLS_PER_SAMPLE:
            phase = "fairqueue"
        elif calls.get("cmdstat_lpush", 0) + calls.get("cmdstat_brpop", 0) > PUSHES_PER_SAMPLE:
            phase = "celery"
        else:
            continue
        for role, value in after["cpu"].items():
            ticks[phase][role] += max(0, value - before["cpu"].get(role, 0))
    return {
        phase: {role: 1000.0 * t / CLOCK_TICKS / jobs for role, t in counter.most_common()}
        for phase, counter in ticks.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample")
    s.add_argument("out", type=Path)
    s.add_argument("seconds", type=float)
    s.add_argument("--redis-port", type=int, required=True)
    s.add_argument("--match", required=True)
    r = sub.add_parser("report")
    r.add_argument("path", type=Path)
    r.add_argument("--jobs", type=int, default=5000)
    args = parser.parse_args()
    if args.command == "sample":
        sample(args.out, args.seconds, port=args.redis_port, match=args.match)
        return
    by_phase = report(args.path, jobs=args.jobs)
    for phase, roles in by_phase.items():
        total = sum(roles.values())
        print(f"{phase}: CPU ms/job {total:.2f} (" + ", ".join(f"{k} {v:.2f}" for k, v in roles.items()) + ")")
    celery, fairqueue = (sum(by_phase[p].values()) for p in ("celery", "fairqueue"))
    if fairqueue:
        print(f"CPU ratio celery / fairqueue: {celery / fairqueue:.3f}")


if __name__ == "__main__":
    main()
