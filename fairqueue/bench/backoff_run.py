"""One run of the backoff workload: `jobs` demo.call jobs against a fake upstream that
refuses more than `max_concurrent` calls at once, on workers that are already running.

Shared by `bench backoff` (its child process, on the bench's own stack) and the test that
asserts the run's correctness (tests/test_backoff.py, on the test stack). Needs Django set up.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.db import connections

from fairqueue.bench.upstream import FakeUpstream
from fairqueue.jobs.models import TERMINAL_STATUSES, Job, JobStatus
from fairqueue.jobs.submission import JobRequest, job_submit_bulk
from tenants.models import Resource, Shard, Tenant
from tenants.policy import CHECK_INTERVAL_SECONDS, policy_invalidate, policy_snapshot
from tenants.resource_limits import resource_limits_read, resource_limits_reset

RESOURCE = "fake-upstream"
TENANT = "caller"
# The first seconds after the first call, in which the effective limit comes down from the
# configured one to what the upstream takes: refusals then are how it learns.
WARM_UP_SECONDS = 5.0
SAMPLE_SECONDS = 0.05
TENANT_FLOOR = 32  # the tenant's own limit never binds: only the resource's does


@dataclass(frozen=True)
class Workload:
    jobs: int = 200
    call_seconds: float = 0.25
    max_concurrent: int = 3
    configured_limit: int = 8  # what the operator set: more than the upstream takes
    decrease_factor: float = 0.8
    increase_per_success: float = 0.25
    recovery_seconds: float = 10.0

    @property
    def ideal_seconds(self) -> float:
        """Every call back to back, `max_concurrent` at a time."""
        return self.jobs * self.call_seconds / self.max_concurrent


def policy_setup(w: Workload) -> Tenant:
    """One tenant whose own limits never bind, one resource at its configured limit."""
    shard, _ = Shard.objects.get_or_create(name="backoff", defaults={"capacity": 1000})
    tenant = Tenant.objects.filter(slug=TENANT).first() or Tenant.objects.create(
        slug=TENANT, name=TENANT, shard=shard, floor=TENANT_FLOOR, burst_floor=TENANT_FLOOR
    )
    Resource.objects.update_or_create(
        name=RESOURCE,
        defaults={
            "limit": w.configured_limit,
            "decrease_factor": w.decrease_factor,
            "increase_per_success": w.increase_per_success,
            "recovery_seconds": w.recovery_seconds,
        },
    )
    return tenant


def _resource_ready(w: Workload, deadline: float) -> None:
    """Wait until the policy every process reads has the resource (synced on commit)."""
    while time.monotonic() < deadline:
        policy_invalidate()
        if (
            RESOURCE in policy_snapshot().resources
            and policy_snapshot().resources[RESOURCE].limit == w.configured_limit
        ):
            return
        time.sleep(0.05)
    raise RuntimeError("the resource never reached the policy in Redis")


def backoff_run(w: Workload, tenant: Tenant, *, timeout: float = 600.0) -> dict[str, Any]:
    """Submit the jobs, wait for all to finish, and return what happened: refusals (all, and
    after the warm-up), elapsed and ideal seconds, the effective limit's range."""
    _resource_ready(w, time.monotonic() + 30)
    # A worker reads the policy at most CHECK_INTERVAL_SECONDS after it changed: until then
    # its releases carry the resource's old limit to the engine (the run before's 8, say,
    # against a known limit of 3), so the run starts once every worker has read it.
    time.sleep(2 * CHECK_INTERVAL_SECONDS)
    resource_limits_reset(RESOURCE)
    samples: list[tuple[float, float, int]] = []  # (time, effective, key limit)
    stop = threading.Event()

    def sample() -> None:
        resource = policy_snapshot().resources[RESOURCE]
        try:
            while not stop.is_set():
                state = resource_limits_read([resource])[RESOURCE]
                samples.append((time.time(), state.effective, state.limit))
                stop.wait(SAMPLE_SECONDS)
        finally:
            connections.close_all()

    with FakeUpstream(max_concurrent=w.max_concurrent, call_seconds=w.call_seconds) as upstream:
        req = JobRequest(task="demo.call", args={"url": upstream.url, "resource": RESOURCE}, resources=[RESOURCE])
        sampler = threading.Thread(target=sample, name="backoff-sampler", daemon=True)
        sampler.start()
        started = time.time()
        ids = [r.job.id for r in job_submit_bulk(tenant=tenant, reqs=[req] * w.jobs)]
        deadline = time.monotonic() + timeout
        try:
            while Job.objects.filter(id__in=ids).exclude(status__in=TERMINAL_STATUSES).exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"backoff jobs not all finished within {timeout:.0f} s")
                time.sleep(0.1)
        finally:
            stop.set()
            sampler.join(5)
        rows = list(Job.objects.filter(id__in=ids).values_list("status", "finished_at", "attempts", "worker_losses"))
        last = max(f for _, f, _, _ in rows if f is not None).timestamp()
        refusals = upstream.refusals_after(0)
        first_call = upstream.first_call_at() or started
        late = upstream.refusals_after(first_call + WARM_UP_SECONDS)
        served, peak = upstream.served(), upstream.peak
    succeeded = sum(1 for status, _, _, _ in rows if status == JobStatus.SUCCEEDED)
    effective = [e for _, e, _ in samples]
    steady = [e for t, e, _ in samples if t >= first_call + WARM_UP_SECONDS]
    return {
        "jobs": w.jobs,
        "succeeded": succeeded,
        "worker_losses": sum(losses for _, _, _, losses in rows),
        "calls_served": served,
        "refusals": refusals,
        "refusals_after_warm_up": late,
        "upstream_peak_concurrency": peak,
        # From the first call to the last job's end: the submit itself (a bulk insert) is
        # not the upstream's time.
        "first_call_after_s": round(first_call - started, 3),
        "submit_to_last_s": round(last - started, 3),
        "elapsed_s": round(last - first_call, 3),
        "ideal_s": round(w.ideal_seconds, 3),
        "throughput_ratio": round(w.ideal_seconds / (last - first_call), 3),
        "effective_min": round(min(effective), 3) if effective else None,
        "effective_max": round(max(effective), 3) if effective else None,
        "effective_median_after_warm_up": round(statistics.median(steady), 3) if steady else None,
        "key_limit_min": min((k for _, _, k in samples), default=None),
        "key_limit_max": max((k for _, _, k in samples), default=None),
        "configured_limit": w.configured_limit,
        "upstream_max_concurrent": w.max_concurrent,
        "call_seconds": w.call_seconds,
    }
