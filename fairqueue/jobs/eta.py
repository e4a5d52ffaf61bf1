"""Where a waiting job stands and when it should start: its place on the key it waits on,
in the engine's own order, and an estimate from that place, the key's slots and the
tenant's mean job duration.

What is computed (a few O(log n) reads: the job's spec and its rank in the key's waiter
queue, the key's count and limit, the tenant's signals; and one indexed query of the
tenant's last DISPATCH_SAMPLE started jobs):

- `position`: the jobs ahead of it on that key now, in the engine's order (priority, then
  fair order across flows, FIFO within a flow); 0 when it is next. At a key shared by
  flows (a shard: tenants; a tenant: its sub-tenants) a flow that starts waiting later
  enters at the key's virtual time and may be served before it: the position is of now.
- `eta_seconds`: (position + 1) x hold / slots: the key runs `slots` jobs at once, each
  holding it `hold` seconds on average, so one of the position + 1 slots the job needs
  frees every hold / slots. slots is the key's limit, and for a tenant's key the limit the
  duty tick gives it, from the idle and fair shares it last published (read fresh: an
  admit from a process whose cache of them was a second old may have stored a lower
  limit, which the next tick lifts again), at most the pool's live slots. hold is the
  tenant's mean job duration (the moving average of its finished jobs; before that
  reaches Redis, the median of its last finished jobs in the database, else of its
  shard's; before any, the pool's default) plus the median wait of its last started jobs
  between getting their slots and starting (the broker, a worker's pick-up). It counts
  the wait on this key only; a later key (its shard) may add to it.
- a job admitted but not started (waiting for a worker) has position 0 and ETA 0: the
  engine holds its slots, a worker takes it next.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import redis

from fairqueue.jobs import live
from fairqueue.jobs.admission import shard_tag, tenant_key, tenant_limit_for
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.runtime import engine, redis_client
from tenants.policy import PolicySnapshot, policy_snapshot

DISPATCH_SAMPLE = 32


@dataclass(frozen=True)
class JobEta:
    key: str | None = None  # the key it waits on (None: not waiting on one)
    position: int | None = None
    limit: int | None = None
    holders: int | None = None
    mean_seconds: float | None = None
    eta_seconds: float | None = None


def eta_seconds(*, position: int, slots: int, mean_seconds: float) -> float:
    """When the job at `position` (0: next) starts, if `slots` jobs of `mean_seconds` run
    at once: each of the position + 1 slots it needs frees after mean / slots, on average."""
    return (position + 1) * mean_seconds / max(slots, 1)


def job_eta(job: Job) -> JobEta:
    """The job's place and ETA; an empty JobEta when it waits on nothing the engine knows
    (not admitted yet, running, finished) or Redis cannot be read."""
    if job.status not in (JobStatus.QUEUED, JobStatus.PARKED):
        return JobEta()
    tag = job.engine_tag or shard_tag(job.tenant.shard.name)
    policy = policy_snapshot()
    try:
        state = engine().inspect_job(tag=tag, job_id=job.engine_id)
        if state.status == "admitted":
            return JobEta(position=0, eta_seconds=0.0)
        if state.status != "parked" or not state.parked_on or not state.position:
            return JobEta()
        key = engine().inspect_key(tag=tag, key=state.parked_on, holders=False)
        slots, mean = _tenant_view(policy, job.tenant.slug, tenant_key_waited=state.parked_on)
    except redis.RedisError:
        return JobEta()
    dispatch, run = _recent_jobs(job)
    if mean is None:  # no moving average yet (nothing finished, or not flushed to Redis yet)
        mean = run if run is not None else _shard_run_seconds(tag)
    if mean is None:
        mean = policy.pool.default_job_seconds
    mean += dispatch
    ahead = state.position - 1
    fleet_slots = live.fleet_state().slots
    slots = max(key.limit or 0, slots or 0)
    if fleet_slots > 0:
        slots = min(slots, fleet_slots)
    return JobEta(
        key=state.parked_on,
        position=ahead,
        limit=key.limit,
        holders=key.held,
        mean_seconds=round(mean, 4),
        eta_seconds=round(eta_seconds(position=ahead, slots=slots, mean_seconds=mean), 3),
    )


def _recent_jobs(job: Job) -> tuple[float, float | None]:
    """From the tenant's last DISPATCH_SAMPLE started jobs (found through the (tenant,
    status, submitted_at) index): the median wait between getting their slots and starting
    (the broker, a worker's pick-up and claim: a key's slot is held for that long before
    the job runs), and the median duration of those that finished (None: none yet)."""
    rows = (
        Job.objects.filter(
            tenant_id=job.tenant_id,
            status__in=[JobStatus.RUNNING, JobStatus.SUCCEEDED, JobStatus.FAILED],
            admitted_at__isnull=False,
        )
        .order_by("-submitted_at")
        .values_list("admitted_at", "started_at", "finished_at")[:DISPATCH_SAMPLE]
    )
    gaps = [(started - admitted).total_seconds() for admitted, started, _ in rows if started and admitted]
    runs = [(finished - started).total_seconds() for _, started, finished in rows if started and finished]
    return (
        max(statistics.median(gaps), 0.0) if gaps else 0.0,
        statistics.median(runs) if runs else None,
    )


def _shard_run_seconds(tag: str) -> float | None:
    """The median duration of the last jobs that finished on the shard (the (status,
    finished_at) index), for a tenant with none of its own yet."""
    rows = (
        Job.objects.filter(status=JobStatus.SUCCEEDED, engine_tag=tag, started_at__isnull=False)
        .order_by("-finished_at")
        .values_list("started_at", "finished_at")[:DISPATCH_SAMPLE]
    )
    runs = [(finished - started).total_seconds() for started, finished in rows if started and finished]
    return statistics.median(runs) if runs else None


def _tenant_view(policy: PolicySnapshot, slug: str, *, tenant_key_waited: str) -> tuple[int | None, float | None]:
    """(the tenant's limit as the duty tick sets it, when the job waits on the tenant's
    key; its mean duration, None before one is in Redis): one pipelined round trip."""
    tp = policy.tenants.get(slug)
    pipe = redis_client().pipeline(transaction=False)
    pipe.hget(live.SHARES_KEY, slug)
    pipe.hget(live.FAIR_SHARES_KEY, slug)
    pipe.get(live.mean_key(slug))
    idle, fair, own = pipe.execute()
    mean = float(own) if own else None
    if tp is None or tenant_key_waited != tenant_key(slug):
        return None, mean
    signals = dataclasses.replace(
        live.live_signals(tenant_slug=slug),
        mean_seconds=mean,
        idle_share=int(idle or 0),
        fair_share=float(fair) if fair is not None else None,
    )
    return tenant_limit_for(policy, tp, signals).limit, mean
