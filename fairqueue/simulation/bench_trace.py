"""A `bench noisy` run's jobs as a compact replay trace, and back: what the what-if's
validation test replays (tests/fixtures/whatif/).

`python -m fairqueue.simulation.bench_trace var/bench/noisy-records.json fair 16 OUT.json`
writes the trace of one mode of the bench's last run (its per-job records side file; 16:
the run's slots, `workload.slots` in its JSON).
Times are seconds after the first submit, rounded to 0.1 ms; tenants and workers are
indexed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fairqueue.simulation.records import Arrival, JobTiming

TRACE_VERSION = 1
DIGITS = 4


def trace_from_records(records: Sequence[dict[str, Any]], *, source: str, slots: int) -> dict[str, Any]:
    """The trace of a bench mode's records (every job must have started and finished)."""
    rows = sorted(records, key=lambda r: r["submitted"])
    t0 = rows[0]["submitted"]
    tenants = sorted({r["tenant"] for r in rows})
    workers = sorted({r.get("worker") or "" for r in rows})

    def rel(x: float) -> float:
        return round(x - t0, DIGITS)

    return {
        "version": TRACE_VERSION,
        "source": source,
        "slots": slots,
        "tenants": tenants,
        "workers": workers,
        "columns": ["tenant", "submitted", "admitted", "started", "finished", "worker"],
        "jobs": [
            [
                tenants.index(r["tenant"]),
                rel(r["submitted"]),
                rel(r["admitted"] if r.get("admitted") is not None else r["started"]),
                rel(r["started"]),
                rel(r["finished"]),
                workers.index(r.get("worker") or ""),
            ]
            for r in rows
        ],
    }


def trace_jobs(trace: dict[str, Any]) -> tuple[list[Arrival], list[JobTiming]]:
    """The arrivals (duration = finished - started) and timings of a trace, by submit."""
    if trace.get("version") != TRACE_VERSION:
        raise ValueError(f"unknown trace version {trace.get('version')!r}")
    tenants, workers = trace["tenants"], trace["workers"]
    arrivals, timings = [], []
    for tenant, submitted, admitted, started, finished, worker in trace["jobs"]:
        arrivals.append(Arrival(at=submitted, tenant=tenants[tenant], duration=max(finished - started, 0.0)))
        timings.append(JobTiming(submitted, admitted, started, finished, workers[worker], tenants[tenant]))
    return arrivals, timings


def main(argv: list[str]) -> None:
    if len(argv) != 5 or not argv[3].isdigit():
        raise SystemExit("usage: python -m fairqueue.simulation.bench_trace RECORDS.json MODE SLOTS OUT.json")
    records_path, mode, slots, out = argv[1], argv[2], int(argv[3]), argv[4]
    records = json.loads(Path(records_path).read_text())[mode]
    trace = trace_from_records(records, source=f"bench noisy, mode {mode}, from {records_path}", slots=slots)
    Path(out).write_text(json.dumps(trace, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main(sys.argv)
