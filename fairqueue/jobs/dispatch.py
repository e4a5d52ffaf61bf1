"""Admission and handoff: ask the engine for slots, publish what it admits or wakes,
re-deliver what it reclaims.

These three close a loop (a re-delivered job is admitted again, and an admission can
reclaim another job's expired hold), so they live together. Everything that asks the
engine for a slot or publishes a delivery goes through here.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from django.db import transaction
from django.db.models import Q, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from fairqueue import tracing
from fairqueue.conf import fq_settings
from fairqueue.engine import Admission, AdmitRequest, Woken
from fairqueue.jobs import cells, live, stats
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.admission import (
    AdmissionPlan,
    admission_plan,
    class_level,
    job_placement,
    known_resources,
    lane_room,
    shard_tag,
)
from fairqueue.jobs.broker import deliveries_publish, delivery_route, route_carry, split_engine_id
from fairqueue.jobs.database import TRANSIENT_DB_ERRORS, connections_heal
from fairqueue.jobs.models import KEY_SEPARATOR, TERMINAL_STATUSES, WAITING_STATUSES, Job, JobStatus
from fairqueue.jobs.quarantine import WORKER_LOST, Death, death_outcome
from fairqueue.jobs.runtime import engine
from tenants.policy import PolicySnapshot, TenantPolicy, policy_snapshot
from tenants.resource_limits import resource_limits_read
from webhooks.outbox import event_record

WAITING = sorted(WAITING_STATUSES)

log = logging.getLogger("fairqueue.jobs.dispatch")


def jobs_admit(
    jobs: Sequence[Job],
    *,
    policy: PolicySnapshot | None = None,
    dispatch: bool = True,
    running: bool = False,
    rebuilding: bool = False,
    strict: bool = False,
    fresh: bool = False,
    enter_cells: bool = False,
) -> None:
    """Ask the engine for a slot for each job (one pipelined round trip); dispatch or park.

    `enter_cells=True`: the jobs start to wait with this admission (submitted, due,
    re-delivered, requeued): they enter their cells (fairqueue.jobs.cells) in the same
    round trip, just before the admissions.

    Redis trouble here leaves the jobs `queued` in the database, where recovery admits
    them later (fairqueue.jobs.recovery). `running=True` re-enters jobs that are already
    running (after Redis lost its state) with a running lease and no dispatch.

    Normal admissions require the shard's engine tag to be ready: after Redis lost its
    state the engine does not know the jobs still running until a worker rebuilds it, and
    admitting a newcomer then could run a tenant above its limit. Such jobs stay `queued`
    with no admission; the rebuild (`rebuilding=True`, unguarded) or the pending sweep
    admits them. A shard with no unfinished job at all has nothing to rebuild: its tag is
    marked ready on the spot and the admission retried once (a fresh Redis, tests).

    `strict=True` lets a Redis error through instead (the rebuild must know it failed).

    `fresh=True`: the rows were just written `queued` with `admitted_at` set by the caller
    (the submit path, fairqueue.jobs.submission; the due promotion, fairqueue.jobs.due),
    which is what an admission records, so
    an admitted job costs no write; only parked or unready ones are updated.
    """
    if not jobs:
        return
    try:
        _jobs_admit(
            jobs,
            policy=policy or policy_snapshot(),
            dispatch=dispatch,
            running=running,
            require_ready=not running and not rebuilding,
            fresh=fresh,
            enter_cells=enter_cells,
        )
    except redis.RedisError:
        if strict:
            raise
        log.warning("Redis unreachable: %d job(s) stay queued until it is back", len(jobs))


def resource_key_limits(jobs: Iterable[Job], policy: PolicySnapshot) -> dict[str, int]:
    """The key limit now of every outside resource these jobs call (one Redis read, none
    when no job calls any)."""
    names = known_resources(policy, [r for job in jobs for r in job.resource_names])
    return {name: state.limit for name, state in resource_limits_read(policy.resources[n] for n in names).items()}


def _tags_init_if_idle(tags: set[str], policy: PolicySnapshot, exclude: Sequence[Job]) -> set[str]:
    """Mark ready each tag where no unfinished job besides `exclude` is placed (nothing the
    engine could have lost there, so nothing to rebuild); returns the tags marked."""
    excluded = [j.id for j in exclude]
    shard_of = {shard_tag(name): name for name in policy.shards}
    ready: set[str] = set()
    for tag in tags:
        placed = Q(engine_tag=tag)
        if tag in shard_of:  # rows from before placements were stored
            placed |= Q(engine_tag="", tenant__shard__name=shard_of[tag])
        busy = (
            Job.objects.filter(placed, status__in=[JobStatus.RUNNING, JobStatus.QUEUED, JobStatus.PARKED])
            .exclude(id__in=excluded)
            .exists()
        )
        if not busy:
            engine().init_tag(tag=tag)
            ready.add(tag)
    return ready


def _placement(job: Job, tenant: TenantPolicy, resources: Sequence[str] = ()) -> tuple[str, list[str]]:
    """The job's stored placement; a row without one (written before placements were
    stored) gets the current one, stored here so its later engine calls find it."""
    now_tag, now_names = job_placement(
        tenant=tenant,
        sub_tenant=job.sub_tenant,
        batch=job.in_batch_lane,
        resources=resources,
        document=job.document,
        quarantined=job.quarantined,
    )
    names = job.engine_key_names
    if job.engine_tag and len(names) == len(now_names):
        return job.engine_tag, names
    job.engine_tag, job.engine_keys = now_tag, KEY_SEPARATOR.join(now_names)
    Job.objects.filter(id=job.id, generation=job.generation).update(
        engine_tag=job.engine_tag, engine_keys=job.engine_keys
    )
    return now_tag, now_names


def _by_generation(pairs: Iterable[tuple[Any, int]]) -> dict[int, list[Any]]:
    """Group job ids by generation, for conditional updates keyed on (id, generation)."""
    groups: dict[int, list[Any]] = defaultdict(list)
    for job_id, generation in pairs:
        groups[generation].append(job_id)
    return groups


def _update_where(jobs: Iterable[Job], statuses: Sequence[str], **fields: Any) -> None:
    """Compare-and-set: update each job only while it is still this generation in one of `statuses`."""
    for generation, ids in _by_generation((j.id, j.generation) for j in jobs).items():
        Job.objects.filter(id__in=ids, generation=generation, status__in=statuses).update(**fields)


def _by_fresh_line(jobs: Sequence[Job], *, fresh: bool) -> list[list[Job]]:
    """`jobs` grouped by the `admitted` line they were written with (fresh rows, see
    `jobs_admit`), which an update that finds them not admitted takes back."""
    if not fresh:
        return [list(jobs)]
    groups: dict[str, list[Job]] = defaultdict(list)
    for job in jobs:
        groups[_fresh_admitted_line(job)].append(job)
    return list(groups.values())


def _fresh_admitted_line(job: Job) -> str:
    return tl.line(tl.ADMITTED, at=job.admitted_at) if job.admitted_at is not None else ""


def _timeline_then(job: Job, fresh: bool, new_line: str) -> Any:
    """The timeline update for a job just found not admitted: a fresh row loses the
    `admitted` line it was written with."""
    if fresh and job.admitted_at is not None:
        return tl.replaced(_fresh_admitted_line(job), new_line)
    return tl.appended(new_line)


def _admissions_trace(
    jobs: Sequence[Job],
    plans: Sequence[AdmissionPlan],
    outcomes: Sequence[Admission],
    *,
    policy: PolicySnapshot,
    start_ns: int,
    running: bool,
) -> None:
    """The admission in each job's trace, spanning the engine call that admitted the batch
    (one round trip). The jobs of one request (a bulk submit) share its trace: they get one
    span there that names each job (`job_ids`, with `outcomes` and `parked_on` in the same
    order), not a span each, which would cost more than the rest of a bulk job's admission.
    Jobs with no trace (submitted with tracing off, or by a caller outside any span) share
    one span in the current context."""
    end_ns = time.time_ns()
    by_trace: defaultdict[str, list[int]] = defaultdict(list)
    for i, job in enumerate(jobs):
        by_trace[job.traceparent].append(i)
    for parent, members in by_trace.items():
        if len(members) == 1:
            for i in members:
                _admission_span(
                    jobs[i], plans[i], outcomes[i], policy=policy, start_ns=start_ns, end_ns=end_ns, running=running
                )
            continue
        _admissions_span(
            parent,
            [jobs[i] for i in members],
            [plans[i] for i in members],
            [outcomes[i] for i in members],
            policy=policy,
            start_ns=start_ns,
            end_ns=end_ns,
            running=running,
        )


def _outcome_name(outcome: Admission) -> str:
    if outcome.admitted:
        return "admitted"
    return "not_ready" if outcome.not_ready else "parked"


def _admission_span(
    job: Job,
    plan: AdmissionPlan,
    outcome: Admission,
    *,
    policy: PolicySnapshot,
    start_ns: int,
    end_ns: int,
    running: bool,
) -> None:
    result = _outcome_name(outcome)
    tp = policy.tenants.get(job.tenant.slug)
    tracing.span_record(
        "fairqueue.admission",
        parent=job.traceparent,
        start_ns=start_ns,
        end_ns=end_ns,
        events=[(result, {"key": outcome.parked_on, "position": outcome.position})],
        job_id=str(job.id),
        generation=job.generation,
        tenant=job.tenant.slug,
        sub_tenant=job.sub_tenant or None,
        shard=tp.shard if tp is not None else None,
        latency_class=job.latency_class,
        batch=job.in_batch_lane,
        keys=[k.name for k in plan.keys],
        limits=[k.limit for k in plan.keys],
        priority=plan.priority,
        outcome=result,
        parked_on=outcome.parked_on,
        position=outcome.position,
        woken=len(outcome.woken),
        reclaimed=len(outcome.reclaimed),
        rebuild=running or None,
    )


def _uniform(values: Iterable[Any]) -> Any:
    """One value if all are the same, else the distinct ones in order (span attributes)."""
    distinct = list(dict.fromkeys(values))
    return distinct[0] if len(distinct) == 1 else distinct


def _admissions_span(
    parent: str,
    jobs: Sequence[Job],
    plans: Sequence[AdmissionPlan],
    outcomes: Sequence[Admission],
    *,
    policy: PolicySnapshot,
    start_ns: int,
    end_ns: int,
    running: bool,
) -> None:
    """One admission span for the jobs of one trace: per job only its id, outcome and the
    key it parked on; what they share once; an event per (outcome, key) with its count."""
    results = [_outcome_name(o) for o in outcomes]
    counts: defaultdict[tuple[str, str], int] = defaultdict(int)
    for result, outcome in zip(results, outcomes, strict=True):
        counts[(result, outcome.parked_on or "")] += 1
    limits = {k.name: k.limit for plan in plans for k in plan.keys}  # the limits passed, per key
    tenant_policies = {j.tenant.slug: policy.tenants.get(j.tenant.slug) for j in jobs}
    tracing.span_record(
        "fairqueue.admission",
        parent=parent,
        start_ns=start_ns,
        end_ns=end_ns,
        events=[(result, {"key": key or None, "jobs": n}) for (result, key), n in counts.items()],
        jobs=len(jobs),
        job_ids=[str(j.id) for j in jobs],
        generation=_uniform(j.generation for j in jobs),
        tenant=_uniform(tenant_policies),
        sub_tenant=_uniform(j.sub_tenant for j in jobs) or None,
        shard=_uniform(tp.shard for tp in tenant_policies.values() if tp is not None) or None,
        latency_class=_uniform(j.latency_class for j in jobs),
        batch=_uniform(j.in_batch_lane for j in jobs),
        keys=list(limits),
        limits=list(limits.values()),
        priority=_uniform(p.priority for p in plans),
        outcomes=results,
        parked_on=[o.parked_on or "" for o in outcomes],
        admitted=results.count("admitted"),
        parked=results.count("parked"),
        not_ready=results.count("not_ready") or None,
        woken=sum(len(o.woken) for o in outcomes),
        reclaimed=sum(len(o.reclaimed) for o in outcomes),
        rebuild=running or None,
    )


def _jobs_admit(
    jobs: Sequence[Job],
    *,
    policy: PolicySnapshot,
    dispatch: bool,
    running: bool,
    require_ready: bool,
    fresh: bool,
    enter_cells: bool,
) -> None:
    lease_seconds = float(fq_settings().LEASE_SECONDS if running else fq_settings().DISPATCH_LEASE_SECONDS)
    items = []
    plans: list[AdmissionPlan] = []
    admitted_jobs = []
    outside = resource_key_limits(jobs, policy)
    started_ns = time.time_ns()  # the admission spans' start: before each job's carry is stamped
    # Jobs alike (a bulk's, mostly) share one plan: the same keys and limits, from the same
    # signals, read once per call rather than once per job.
    shared: dict[tuple[Any, ...], AdmissionPlan] = {}
    # Quarantined jobs of this call, by shard: the lane's slots are shared over the shards,
    # so each counts against the others' room (as held) whether it is admitted or parks.
    lane_granted: dict[str, int] = {}
    # Read now, not from the fleet's cache: the leader moves jobs into the lane and admits
    # them in calls a moment apart, and each must see what the last one admitted.
    lane_held = live.lane_held_read(policy) if any(j.quarantined for j in jobs) else {}
    for job in jobs:
        tp = policy.tenants.get(job.tenant.slug)
        if tp is None or job.status in TERMINAL_STATUSES:
            continue
        resources = {r: outside[r] for r in known_resources(policy, job.resource_names)}
        tag, names = placement = _placement(job, tp, sorted(resources))
        batch = job.in_batch_lane
        document = (job.document, job.fan_out_cap or tp.max_fan_out) if job.document else None
        alike = (tp.slug, job.sub_tenant, job.priority, batch, tag, tuple(names), tuple(resources.items()), document)
        quarantined = job.quarantined
        # A quarantined job's lane room depends on the jobs before it here: no plan shared.
        plan = None if quarantined else shared.get(alike)
        if plan is None:
            fleet = live.fleet_state()
            plan = shared[alike] = admission_plan(
                policy=policy,
                tenant=tp,
                sub_tenant=job.sub_tenant,
                priority=job.priority,
                signals=live.live_signals(tenant_slug=tp.slug),
                batch=batch,
                # Batch work must see the pool as it is now, not as cached a second ago.
                batch_limit=live.fleet_state(max_age=0.05).batch_limit(tp.shard) if batch else 0,
                placement=placement,
                resource_limits=resources,
                # Jobs already running (re-entered after a loss of Redis) hold their slots
                # whatever the pool's size now.
                pool_room=None if running else fleet.pool_room(tp.shard),
                document=document,
                quarantined=quarantined,
                quarantine_room=(
                    _lane_room(policy, tp.shard, lane_granted, lane_held) if quarantined and not running else None
                ),
            )
        if quarantined:
            lane_granted[tp.shard] = lane_granted.get(tp.shard, 0) + 1
        items.append(
            AdmitRequest(
                tag=plan.tag,
                job_id=job.engine_id,
                keys=plan.keys,
                priority=plan.priority,
                lease_seconds=lease_seconds,
                data=delivery_route(
                    level=class_level(policy, job.latency_class),
                    batch=job.in_batch_lane,
                    carry=tracing.job_carry(job.traceparent),
                    quarantined=quarantined,
                ),
                require_ready=require_ready,
            )
        )
        plans.append(plan)
        admitted_jobs.append(job)
    entry = cells.entry_prepare(admitted_jobs, policy=policy) if enter_cells else None
    started = time.perf_counter()
    replies, outcomes = engine().admit_many_after(entry.commands if entry else [], items)
    stats.observe("admit", (time.perf_counter() - started) / max(len(items), 1))
    if entry is not None:
        cells.entry_done(entry, replies)
    unready = [i for i, o in enumerate(outcomes) if o.not_ready]
    if unready:
        retry = _tags_init_if_idle({items[i].tag for i in unready}, policy, admitted_jobs)
        again = [i for i in unready if items[i].tag in retry]
        if again:
            for i, o in zip(again, engine().admit_many([items[i] for i in again]), strict=True):
                outcomes[i] = o
    if tracing.tracing_enabled():
        _admissions_trace(admitted_jobs, plans, outcomes, policy=policy, start_ns=started_ns, running=running)
    if running:
        return
    now = timezone.now()
    pairs = list(zip(admitted_jobs, outcomes, strict=True))
    was_parked = [str(j.id) for j, o in pairs if (o.admitted or o.not_ready) and j.status == JobStatus.PARKED]
    waiting = [j for j, o in pairs if o.not_ready]
    parked = [(j, o) for j, o in pairs if not o.admitted and not o.not_ready]
    go = [j for j, o in pairs if o.admitted]
    if waiting:
        # Not admitted: recovery's pending sweep (or the state rebuild) admits them later.
        log.warning("scheduling state not rebuilt yet: %d job(s) wait for recovery", len(waiting))
        for group in _by_fresh_line(waiting, fresh=fresh):
            _update_where(
                group,
                WAITING,
                status=JobStatus.QUEUED,
                admitted_at=None,
                timeline=_timeline_then(group[0], fresh, tl.line(tl.PENDING, "engine state not rebuilt", at=now)),
            )
    if parked:
        by_key: dict[str, list[Job]] = defaultdict(list)
        for job, outcome in parked:
            by_key[outcome.parked_on or ""].append(job)
        for key, keyed in by_key.items():
            for group in _by_fresh_line(keyed, fresh=fresh):
                _update_where(
                    group,
                    [JobStatus.QUEUED],
                    status=JobStatus.PARKED,
                    admitted_at=None,
                    timeline=_timeline_then(group[0], fresh, tl.line(tl.PARKED, key, at=now)),
                )
    if go and not fresh:
        _update_where(
            go,
            WAITING,
            status=JobStatus.QUEUED,
            admitted_at=Coalesce("admitted_at", Value(now)),
            timeline=tl.appended(tl.line(tl.ADMITTED, at=now)),
        )
    if parked:
        cells.jobs_park([j for j, _ in parked], policy=policy)
    if was_parked:
        cells.jobs_unpark(was_parked)
    for job, outcome in pairs:
        if outcome.admitted:
            if job.admitted_at is None:
                job.admitted_at = now
            job.status = JobStatus.QUEUED
        elif outcome.not_ready:
            job.status = JobStatus.QUEUED
            job.admitted_at = None
        elif job.status == JobStatus.QUEUED:
            job.status = JobStatus.PARKED
            job.admitted_at = None
    if not dispatch:
        return
    _publish([(j.engine_id, i.data) for j, i, o in zip(admitted_jobs, items, outcomes, strict=True) if o.admitted])
    outcomes_handle(woken=[w for o in outcomes for w in o.woken], reclaimed=[r for o in outcomes for r in o.reclaimed])


def _publish(deliveries: Sequence[tuple[str, str]]) -> None:
    """Publish (engine id, route) deliveries in one broker round trip. If the broker refused
    them they go back to `queued` with no admission: the pending sweep admits them again
    (the engine still knows them as holders, so that admission succeeds at once) and
    publishes them then."""
    if not deliveries:
        return
    try:
        deliveries_publish(deliveries)
        return
    except Exception:
        log.exception("could not publish %d job(s); the pending sweep publishes them again", len(deliveries))
    failed = [split_engine_id(engine_id) for engine_id, _ in deliveries]
    line = tl.line(tl.PENDING, "publish failed")
    for generation, ids in _by_generation(failed).items():
        Job.objects.filter(id__in=ids, generation=generation, status__in=WAITING).update(
            status=JobStatus.QUEUED, admitted_at=None, timeline=tl.appended(line)
        )


def outcomes_handle(*, woken: Iterable[Woken], reclaimed: Iterable[Woken]) -> None:
    """Dispatch jobs the engine just handed slots to; re-deliver jobs whose lease ran out."""
    woken = list(woken)
    if woken:
        # Publish first: the slot is already theirs, and every millisecond here is a worker
        # slot held but idle. The claim accepts `parked` as well, so the order is safe.
        now = timezone.now()
        waits_trace(woken)
        _publish([(w.job_id, w.data) for w in woken])
        cells.jobs_unpark(split_engine_id(w.job_id)[0] for w in woken)
        line = tl.line(tl.WOKEN, at=now)
        try:
            for generation, ids in _by_generation(split_engine_id(w.job_id) for w in woken).items():
                Job.objects.filter(id__in=ids, generation=generation, status=JobStatus.PARKED).update(
                    status=JobStatus.QUEUED, admitted_at=now, timeline=tl.appended(line)
                )
        except TRANSIENT_DB_ERRORS:
            # Published already, and their claim takes them from `parked` too: the rows
            # only say `parked` a little longer (the claim sets admitted_at).
            log.warning("database unreachable: %d woken job(s) still read parked", len(woken), exc_info=True)
            connections_heal()
    reclaimed = list(reclaimed)
    if reclaimed:
        jobs_redeliver([r.job_id for r in reclaimed])


def waits_trace(woken: Iterable[Woken]) -> None:
    """Each woken job's wait, in its own trace: from its admission (the park) to now,
    linked to the current span (the release, or the admission, that woke it)."""
    if not tracing.tracing_enabled():
        return
    cause = tracing.traceparent()
    end_ns = time.time_ns()
    for w in woken:
        tp, parked_ns = tracing.carry_read(route_carry(w.data)[1])
        if not tp:
            continue
        job_id, generation = split_engine_id(w.job_id)
        tracing.span_record(
            "fairqueue.wait",
            parent=tp,
            start_ns=parked_ns or end_ns,
            end_ns=end_ns,
            links=[cause] if cause else [],
            events=[("woken", {})],
            job_id=job_id,
            generation=generation,
        )


def _lane_room(policy: PolicySnapshot, shard: str, granted: dict[str, int], held: dict[str, int]) -> int:
    """A quarantined job's lane room: the lane's slots less what the other shards hold (as
    read at the start of this call: `held`) and the jobs given to other shards' lane keys
    earlier in it."""
    counted = {s: held.get(s, 0) + granted.get(s, 0) for s in {*held, *granted}}
    return lane_room(slots=policy.pool.quarantine_slots, held_by_shard=counted, shard=shard)


def jobs_redeliver(engine_ids: Iterable[str]) -> None:
    """A hold expired: its worker died (or the broker lost the message). Run it again, once;
    a job its workers died under too often moves to the quarantine lane, or fails as a
    poison pill (fairqueue.jobs.quarantine)."""
    policy = policy_snapshot()
    again: list[Job] = []
    failed: list[str] = []
    for engine_id in engine_ids:
        job_id, gen = split_engine_id(engine_id)
        with transaction.atomic():
            job = Job.objects.select_for_update().select_related("tenant").filter(id=job_id, generation=gen).first()
            if job is None or job.status in TERMINAL_STATUSES:
                continue
            # Running when its hold ran out: its worker died under it. Not yet running (its
            # delivery was lost on the way, say): no death.
            died = job.status == JobStatus.RUNNING
            if died:
                job.worker_losses += 1
                if job.quarantined:
                    job.quarantine_losses += 1
            with tracing.span("fairqueue.reclaim", parent=job.traceparent, job_id=str(job.id), generation=gen):
                tracing.event("reclaimed", was=job.status, worker_losses=job.worker_losses)
            job.timeline += tl.line(tl.RECLAIMED, f"generation {gen} {job.status}")
            job.generation += 1
            job.admitted_at = None
            outcome = death_outcome(job, policy.pool) if died else None
            if outcome is not None and outcome.death == Death.POISON:
                job.status = JobStatus.FAILED
                job.error_reason = WORKER_LOST
                job.error = outcome.reason
                job.finished_at = timezone.now()
                job.timeline += tl.line(tl.FINISHED, f"failed {WORKER_LOST}", at=job.finished_at)
                stats.count("finished:failed")
            else:
                if outcome is not None and outcome.death == Death.QUARANTINE:
                    job.quarantined_at = timezone.now()
                    job.quarantine_reason = outcome.reason
                    job.timeline += tl.line(tl.QUARANTINED, outcome.reason, at=job.quarantined_at)
                    stats.count("quarantine:moved")
                job.status = JobStatus.QUEUED
                tenant = policy.tenants.get(job.tenant.slug)
                if tenant is not None:  # a new admission: wherever the tenant is now
                    job.engine_tag, names = job_placement(
                        tenant=tenant,
                        sub_tenant=job.sub_tenant,
                        batch=job.in_batch_lane,
                        resources=known_resources(policy, job.resource_names),
                        document=job.document,
                        quarantined=job.quarantined,
                    )
                    job.engine_keys = KEY_SEPARATOR.join(names)
                again.append(job)
            if job.status == JobStatus.FAILED:
                failed.append(str(job.id))
            job.save(
                update_fields=[
                    "engine_tag",
                    "engine_keys",
                    "worker_losses",
                    "quarantined_at",
                    "quarantine_reason",
                    "quarantine_losses",
                    "generation",
                    "admitted_at",
                    "status",
                    "error",
                    "error_reason",
                    "finished_at",
                    "timeline",
                ]
            )
            event_record(job)  # a no-op unless it just failed for good and has a webhook target
        log.warning("re-delivering job %s (lease expired, generation %s)", job_id, gen)
    cells.jobs_leave(failed)
    jobs_admit(again, policy=policy, enter_cells=True)


# Picks, among the jobs a release woke, one the caller runs itself in the slot it freed
# (fairqueue.jobs.handoff.inline_pick), or None.
KeepPick = Callable[[Sequence[Woken]], Woken | None]


def job_release(
    *, tag: str, engine_id: str, keys: list[str] | None = None, keep: KeepPick | None = None
) -> Woken | None:
    """Give a job's slots back; the engine hands each to its next waiter, dispatched here.

    `keep` may pick one woken job that the caller runs itself, at once, in the slot the
    release freed: that one is neither published nor marked `queued` (its claim takes it
    from `parked` to `running`); it is returned. Should the pick fail, everything is
    published as usual."""
    with tracing.span("fairqueue.release", job_id=split_engine_id(engine_id)[0], tag=tag):
        started = time.perf_counter()
        result = engine().release(tag=tag, job_id=engine_id, keys=keys)
        stats.observe("release", time.perf_counter() - started)
        tracing.set_attributes(found=result.found, woken=len(result.woken), reclaimed=len(result.reclaimed))
        kept = _keep_one(keep, result.woken)
        if kept is not None:
            waits_trace([kept])
        return _release_dispatch(result.woken, result.reclaimed, kept)


def _release_dispatch(woken: Sequence[Woken], reclaimed: Sequence[Woken], kept: Woken | None) -> Woken | None:
    try:
        outcomes_handle(woken=[w for w in woken if w is not kept], reclaimed=reclaimed)
    except Exception:
        if kept is not None:  # the caller will not get to run it: it goes the usual way
            _publish([(kept.job_id, kept.data)])
        raise
    return kept


def _keep_one(keep: KeepPick | None, woken: Sequence[Woken]) -> Woken | None:
    if keep is None or not woken:
        return None
    try:
        return keep(woken)
    except Exception:  # the broker check failed, say: publishing is always safe
        log.warning("could not decide on running a woken job here; publishing it", exc_info=True)
        return None


def job_release_or_defer(job: Job) -> bool:
    """Release a finished job's slots; if the engine cannot be reached, flag the row so the
    reconciler releases them later (a finished job's outcome never depends on Redis).
    True if released now."""
    released, _ = _release_or_defer(job, keep=None)
    return released


def job_release_keeping(job: Job, keep: KeepPick | None) -> Woken | None:
    """`job_release_or_defer`, where `keep` may pick one woken job for the caller to run in
    the slot the release freed (see `job_release`); returns it."""
    return _release_or_defer(job, keep=keep)[1]


def _release_or_defer(job: Job, *, keep: KeepPick | None) -> tuple[bool, Woken | None]:
    try:
        kept = job_release(tag=job.engine_tag, engine_id=job.engine_id, keys=job.engine_key_names or None, keep=keep)
        return True, kept
    except Exception:
        log.warning("could not release job %s now; the reconciler will", job.engine_id, exc_info=True)
        Job.objects.filter(id=job.id, generation=job.generation).update(release_pending=True)
        return False, None
