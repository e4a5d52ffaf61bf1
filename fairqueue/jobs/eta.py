"""Where a waiting job stands and when it should start: its place on the key it waits on,
in the engine's own order, and an estimate from that place, the key's slots and the
tenant's mean job duration.

What is computed (a few O(log n) reads: the job's spec and its rank in the key's waiter
queue, the key's count and limit, the tenant's signals; and one indexed query of the
tenant's last OWN_SAMPLE started jobs, and at times of its shard's last SHARD_SAMPLE finished):

- `position`: the jobs ahead of it on that key now, in the engine's order (priority, then
  fair order across flows, FIFO within a flow); 0 when it is next. At a key shared by
  flows (a shard: tenants; a tenant: its sub-tenants) a flow that starts waiting later
  enters at the key's virtual time and may be served before it: the position is of now.
- `eta_seconds`: (position + 1) / rate, the rate at which the key hands out slots. The key
  runs `slots` jobs at once, each holding its slot `hold` seconds on average, so it frees
  slots / hold per second; and the pool can run no more of them than the slots the other
  keys' jobs leave free, each busy `run` seconds: rate = min(slots / hold, free / run).
  slots is the key's limit, and for a tenant's key the limit the duty tick gives it, from
  the idle and fair shares it last published (read fresh: an admit from a process whose
  cache of them was a second old may have stored a lower limit, which the next tick lifts
  again). free is the pool's slots less those other keys' jobs hold. run is the tenant's
  mean job duration, estimated from its last OWN_SAMPLE started jobs with those still
  running counted as far as they got (the total time they ran over the number that
  finished: early in a burst its short jobs finish first, and their mean alone would be
  low), shrunk towards a prior worth PRIOR_JOBS finished jobs: the tenant's
  moving average, else its shard's last finished jobs, else the pool's default. hold is
  run plus the median wait between getting a slot and starting of those of them that were
  handed a freed slot (the broker, a worker's pick-up). It counts the wait on this key
  only; a later key (its shard) may add to it.
- a job admitted but not started (waiting for a worker) has position 0 and ETA 0: the
  engine holds its slots, a worker takes it next.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import redis
from django.utils import timezone

from fairqueue.jobs import live
from fairqueue.jobs.admission import shard_tag, tenant_key, tenant_limit_for
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.runtime import engine, redis_client
from tenants.policy import PolicySnapshot, policy_snapshot

OWN_SAMPLE = 64  # the tenant's last started jobs its duration and pick-up wait are read from
SHARD_SAMPLE = 32  # the shard's last finished jobs, for a prior
PRIOR_JOBS = 8  # how many of the tenant's own finished jobs the prior counts for


@dataclass(frozen=True)
class JobEta:
    key: str | None = None  # the key it waits on (None: not waiting on one)
    position: int | None = None
    limit: int | None = None
    holders: int | None = None
    mean_seconds: float | None = None
    eta_seconds: float | None = None


def handout_rate(*, slots: int, hold: float, pool_free: int | None, run: float) -> float:
    """Slots a key hands out per second: its `slots` each held `hold` seconds, and no more
    than the `pool_free` worker slots (None: no pool known) can run, each busy `run` s."""
    rate = max(slots, 1) / hold
    if pool_free is not None:
        rate = min(rate, max(pool_free, 1) / run)
    return rate


def mean_with_prior(*, ran_seconds: float, finished: int, prior: float) -> float:
    """The mean duration from `finished` jobs and the `ran_seconds` that they and those
    still running ran in all, shrunk towards `prior` as if PRIOR_JOBS more had finished
    at it (the total time run per job finished: an exponential duration's estimate
    under censoring, which a burst's first short jobs do not drag down)."""
    return (ran_seconds + PRIOR_JOBS * prior) / (finished + PRIOR_JOBS)


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
    sample = _recent_jobs(job)
    prior = mean
    if prior is None:  # no moving average yet (nothing finished, or not flushed to Redis yet)
        prior = _shard_run_seconds(tag)
    if prior is None:
        prior = policy.pool.default_job_seconds
    run = mean_with_prior(ran_seconds=sample.ran_seconds, finished=sample.finished, prior=prior)
    hold = run + sample.dispatch_seconds
    ahead = state.position - 1
    fleet = live.fleet_state()
    slots = max(key.limit or 0, slots or 0)
    # The pool's slots that this key's jobs can have: those the other keys' jobs do not hold.
    pool_free = fleet.slots - max(fleet.in_flight - (key.held or 0), 0) if fleet.slots > 0 else None
    if fleet.slots > 0:
        slots = min(slots, fleet.slots)
    rate = handout_rate(slots=slots, hold=hold, pool_free=pool_free, run=run)
    return JobEta(
        key=state.parked_on,
        position=ahead,
        limit=key.limit,
        holders=key.held,
        mean_seconds=round(hold, 4),
        eta_seconds=round((ahead + 1) / rate, 3),
    )


@dataclass(frozen=True)
class RecentJobs:
    """What a tenant's last started jobs say: the time they ran (those still running, as
    far as they got), how many finished, and their median wait from slot to start."""

    ran_seconds: float = 0.0
    finished: int = 0
    dispatch_seconds: float = 0.0


def _recent_jobs(job: Job) -> RecentJobs:
    """From the tenant's last OWN_SAMPLE started jobs (found through the (tenant, status,
    submitted_at) index). The wait from slot to start is read off the jobs that waited for
    their slot (admitted after their submit): handed a freed slot, they show how long one
    stays held between two jobs. A job admitted at its submit may instead wait for a worker
    behind the others admitted with it, which the pool's rate counts already."""
    rows = (
        Job.objects.filter(
            tenant_id=job.tenant_id,
            status__in=[JobStatus.RUNNING, JobStatus.SUCCEEDED, JobStatus.FAILED],
            admitted_at__isnull=False,
        )
        .order_by("-submitted_at")
        .values_list("submitted_at", "admitted_at", "started_at", "finished_at")[:OWN_SAMPLE]
    )
    now = timezone.now()
    handed = [
        (started - admitted).total_seconds()
        for submitted, admitted, started, _ in rows
        if started and admitted and admitted > submitted
    ]
    ran = [((finished or now) - started).total_seconds() for _, _, started, finished in rows if started]
    return RecentJobs(
        ran_seconds=max(sum(ran), 0.0),
        finished=sum(1 for _, _, started, finished in rows if started and finished),
        dispatch_seconds=max(statistics.median(handed), 0.0) if handed else 0.0,
    )


def _shard_run_seconds(tag: str) -> float | None:
    """The mean duration of the last SHARD_SAMPLE jobs that finished on the shard (the
    (status, finished_at) index), for a tenant with no moving average yet."""
    rows = (
        Job.objects.filter(status=JobStatus.SUCCEEDED, engine_tag=tag, started_at__isnull=False)
        .order_by("-finished_at")
        .values_list("started_at", "finished_at")[:SHARD_SAMPLE]
    )
    runs = [(finished - started).total_seconds() for started, finished in rows if started and finished]
    return statistics.fmean(runs) if runs else None


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
