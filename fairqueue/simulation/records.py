"""What a replay takes in: the jobs' arrivals (what the model runs) and their timings
(what the stack's latencies are measured from). Plain records, no Django."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Arrival:
    """One submitted job as the replay needs it."""

    at: float  # submit time, unix seconds
    tenant: str
    duration: float  # measured: finished_at - started_at
    sub_tenant: str = ""
    latency_class: str = "default"
    priority: int = 0  # the engine priority it was admitted with (its class's rank)
    batch: bool = False


@dataclass(frozen=True, slots=True)
class JobTiming:
    """A finished job's timestamps (unix seconds), the worker that ran it, its tenant."""

    submitted: float
    admitted: float
    started: float
    finished: float
    worker: str = ""
    tenant: str = ""
