"""The what-if replay on real rows: the last hours of a shard's jobs, simulated under the
current policy and a proposed one (tenants.whatif asks; fairqueue.simulation simulates).

What it reads: every job of the shard (by where it was admitted, `engine_tag`) submitted
in the window that started and finished (its measured duration is what the model runs),
the submissions of the rate window before it (to fill the rate ring as the fleet had it)
and the durations finished before it (the tenants' mean duration at the start). Jobs still
waiting or running at the end of the window, or cancelled before they started, have no
duration and are left out (the comparison says how many).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from django.utils import timezone

from fairqueue.jobs.admission import shard_tag
from fairqueue.jobs.fleet import fleet_read
from fairqueue.jobs.models import Job
from fairqueue.simulation.calibration import latencies_measure
from fairqueue.simulation.records import Arrival, JobTiming
from fairqueue.simulation.scheduler import (
    REFRESH_SECONDS,
    SimConfig,
    SimResult,
    ewma,
    percentile,
    simulate,
)
from tenants.whatif import PolicyOutcome, TenantWaits, WhatIfComparison, WhatIfError, WhatIfRequest

SERIES_SAMPLES = 120
# The model refreshes limits every 0.25 s (jittered) like the fleet, skipping the time no
# job waits; a refresh costs about as much as a few jobs. Past this many jobs a replay
# refreshes proportionally less often, to keep 1,000x real time on a day of a busy shard;
# the comparison says which period it used.
JOBS_AT_FULL_REFRESH = 1_000_000


class Replay:
    """The rows of one window, as the simulation takes them."""

    def __init__(self, *, shard: str, start: datetime, end: datetime, rate_window_seconds: int) -> None:
        self.shard, self.start, self.end = shard, start, end
        tag = shard_tag(shard)
        rows = (
            Job.objects.filter(engine_tag=tag, submitted_at__gte=start, submitted_at__lt=end)
            .order_by("submitted_at")
            .values_list(
                "tenant__slug",
                "sub_tenant",
                "latency_class",
                "priority",
                "batch",
                "submitted_at",
                "admitted_at",
                "started_at",
                "finished_at",
                "worker",
            )
        )
        self.arrivals: list[Arrival] = []
        self.timings: list[JobTiming] = []
        self.unmeasured = 0
        for slug, sub, cls, prio, batch, submitted, admitted, started, finished, worker in rows.iterator(
            chunk_size=5000
        ):
            if started is None or finished is None:
                self.unmeasured += 1
                continue
            s, f = started.timestamp(), finished.timestamp()
            self.arrivals.append(
                Arrival(
                    at=submitted.timestamp(),
                    tenant=slug,
                    duration=max(f - s, 0.0),
                    sub_tenant=sub,
                    latency_class=cls,
                    priority=prio,
                    batch=batch,
                )
            )
            if admitted is not None:
                self.timings.append(JobTiming(submitted.timestamp(), admitted.timestamp(), s, f, worker, slug))
        history = Job.objects.filter(
            engine_tag=tag, submitted_at__gte=start - timedelta(seconds=rate_window_seconds), submitted_at__lt=start
        )
        self.history = [(at.timestamp(), slug) for at, slug in history.values_list("submitted_at", "tenant__slug")]
        self.initial_means: dict[str, float] = {}
        finished_before = (
            history.filter(batch=False, started_at__isnull=False, finished_at__isnull=False, finished_at__lt=start)
            .order_by("finished_at")
            .values_list("tenant__slug", "started_at", "finished_at")
        )
        for slug, started, finished in finished_before:
            if started is None or finished is None:  # excluded by the filter; for the type checker
                continue
            seconds = (finished - started).total_seconds()
            self.initial_means[slug] = ewma(self.initial_means.get(slug), seconds)

    def peak_concurrency(self) -> int:
        """The most jobs that ran at once in the window (a floor for the pool's size)."""
        edges = sorted([(t.started, 1) for t in self.timings] + [(t.finished, -1) for t in self.timings])
        peak = running = 0
        for _, step in edges:
            running += step
            peak = max(peak, running)
        return peak


def _outcome(result: SimResult) -> PolicyOutcome:
    return PolicyOutcome(
        waits={
            slug: TenantWaits(jobs=len(w), p50=percentile(w, 50), p99=percentile(w, 99))
            for slug, w in result.waits.items()
            if w
        },
        utilisation=result.utilisation,
        backlog_utilisation=result.backlog_utilisation,
        series_t=result.series_t,
        series_waiting=result.series_waiting,
        peak_waiting=result.peak_waiting,
        stranded=result.stranded,
        elapsed_s=round(result.elapsed_s, 3),
    )


def whatif_compare(request: WhatIfRequest, *, now: datetime | None = None, seed: int = 0) -> WhatIfComparison:
    """Replay the last `request.hours` of the shard under both policies."""
    if request.shard not in request.current.shards:
        raise WhatIfError(f"No shard {request.shard!r}.")
    if request.shard not in request.proposed.shards:
        raise WhatIfError(f"Shard {request.shard!r} is not in the proposed policy.")
    end = now or timezone.now()
    start = end - timedelta(hours=request.hours)
    replay = Replay(
        shard=request.shard, start=start, end=end, rate_window_seconds=request.current.pool.rate_window_seconds
    )
    notes: list[str] = []
    if request.slots is not None:
        slots, source = request.slots, "given"
    else:
        slots, source = fleet_read()["slots"], "the fleet's live slots"
        if slots <= 0:
            slots, source = max(replay.peak_concurrency(), 1), "no live workers: the most jobs that ran at once"
    if not replay.arrivals:
        raise WhatIfError(
            f"No finished job of shard {request.shard} was submitted in the last {request.hours:g} h: "
            "nothing to replay."
        )
    latencies = latencies_measure(replay.timings, slots=slots)
    refresh = REFRESH_SECONDS * max(1.0, len(replay.arrivals) / JOBS_AT_FULL_REFRESH)
    if refresh > REFRESH_SECONDS:
        notes.append(f"limits refreshed every {refresh:.2f} s in the model (the fleet: every {REFRESH_SECONDS} s)")
    if replay.unmeasured:
        notes.append(f"{replay.unmeasured} job(s) not replayed: not finished, or never started")
    config = SimConfig(
        slots=slots,
        latencies=latencies,
        seed=seed,
        refresh_seconds=refresh,
        samples=SERIES_SAMPLES,
        start=start.timestamp(),
        end=end.timestamp(),
    )
    results = [
        simulate(
            replay.arrivals,
            policy=policy,
            shard=request.shard,
            config=config,
            history=replay.history,
            initial_means=replay.initial_means,
        )
        for policy in (request.current, request.proposed)
    ]
    for label, result in zip(("current", "proposed"), results, strict=True):
        if result.skipped:
            notes.append(f"{label}: {result.skipped} job(s) of tenants not in the policy left out")
        if result.stranded:
            notes.append(f"{label}: {result.stranded} job(s) never start (a limit of 0?)")
    return WhatIfComparison(
        shard=request.shard,
        hours=request.hours,
        start=start,
        end=end,
        jobs=len(replay.arrivals),
        slots=slots,
        slots_source=source,
        current=_outcome(results[0]),
        proposed=_outcome(results[1]),
        changes=request.changes,
        latencies=latencies.as_dict(),
        notes=tuple(notes),
    )


def speed_ratio(comparison: WhatIfComparison) -> float:
    """Simulated seconds per wall second, over both runs."""
    wall = comparison.current.elapsed_s + comparison.proposed.elapsed_s
    return math.inf if wall <= 0 else 2 * comparison.hours * 3600 / wall
