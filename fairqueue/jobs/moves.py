"""Moving a tenant to another shard, renaming it, or renaming a shard, with no job
stranded and no limit exceeded.

A job's engine calls go where it was admitted (`Job.engine_tag` / `engine_keys`). When a
tenant's place changes:
- its parked jobs are cancelled at the old place and admitted at the new one, in their
  submission order; jobs not admitted yet just get the new place;
- jobs that already hold their slots (running, or on their way to a worker) finish at
  the old place;
- until they have, the slots they hold there count against the tenant's (and, for a
  renamed shard, the shard's) limit at the new place: the move is registered in
  MOVES_KEY, and each tick publishes what is still held there
  (live.HELD_ELSEWHERE_KEY), which admissions subtract. A registration ends when
  nothing is held at the old place any more (a key with no holder has no waiter).

Sub-tenant caps are not carried across a move: for as long as the old place drains, a
sub-tenant may run its cap at the new place beside what it still runs at the old one
(the tenant's own limit still bounds the sum).
"""

from __future__ import annotations

import json
import logging

from django.db.models import QuerySet

from fairqueue.jobs import cells, live
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.admission import SHARD_KEY, job_placement, known_resources, shard_tag, tenant_key
from fairqueue.jobs.dispatch import jobs_admit, outcomes_handle
from fairqueue.jobs.models import KEY_SEPARATOR, UNFINISHED_STATUSES, Job, JobStatus
from fairqueue.jobs.runtime import engine, redis_client
from tenants.models import Shard, Tenant
from tenants.policy import PolicySnapshot, policy_invalidate, policy_snapshot
from tenants.sync import shard_policy_delete, shard_policy_sync, tenant_policy_delete, tenant_policy_sync

log = logging.getLogger("fairqueue.jobs.moves")

MOVES_KEY = "fq:moves"  # HASH "t:<slug>" / "s:<shard>" -> JSON [[old tag, old key], ...]
MIGRATE_CHUNK = 500

Place = tuple[str, str]  # (engine tag, key name)


def tenants_move_preview(tenants: QuerySet[Tenant]) -> str | None:
    """What moving (or renaming) these tenants would do to their unfinished jobs now, in
    words for the admin; None when they have none."""
    jobs = Job.objects.filter(tenant__in=tenants, status__in=sorted(UNFINISHED_STATUSES))
    holding = (
        jobs.filter(status=JobStatus.RUNNING).count()
        + jobs.filter(status=JobStatus.QUEUED, admitted_at__isnull=False).count()
    )
    waiting = jobs.count() - holding
    if not waiting and not holding:
        return None
    return (
        f"{waiting} waiting job(s) will be re-admitted at the new place, in their order; {holding} job(s) already "
        "holding slots finish where they are, and count against the limits at the new place until they do."
    )


def _label(kind: str, name: str) -> str:
    return f"{kind}:{name}"


def _register(label: str, old: Place, *, renamed_from: str | None = None) -> None:
    """Remember that `label`'s slots may still be held at `old` (and, after a rename, at
    every place the old label's slots still were)."""
    client = redis_client()
    places = [tuple(p) for p in json.loads(client.hget(MOVES_KEY, label) or "[]")]
    if renamed_from and renamed_from != label:
        places += [tuple(p) for p in json.loads(client.hget(MOVES_KEY, renamed_from) or "[]")]
        client.hdel(MOVES_KEY, renamed_from)
        client.hdel(live.HELD_ELSEWHERE_KEY, renamed_from)
    if old not in places:
        places.append(old)
    client.hset(MOVES_KEY, label, json.dumps(sorted(set(places))))


def _held(places: list[Place]) -> int:
    return sum(engine().counts(tag=tag, keys=[key]).get(key, 0) for tag, key in places)


def _publish_now(label: str) -> None:
    places = [tuple(p) for p in json.loads(redis_client().hget(MOVES_KEY, label) or "[]")]
    live.held_elsewhere_publish({label: _held(places)})  # type: ignore[arg-type]


def tenant_moved(*, tenant_id: int, old_slug: str, old_shard: str) -> int:
    """After a tenant's slug or shard changed (committed): carry its jobs over. Returns
    how many waiting jobs were re-admitted at the new place."""
    tenant = Tenant.objects.select_related("shard").filter(pk=tenant_id).first()
    if tenant is None or (tenant.slug, tenant.shard.name) == (old_slug, old_shard):
        return 0
    label = _label("t", tenant.slug)
    _register(label, (shard_tag(old_shard), tenant_key(old_slug)), renamed_from=_label("t", old_slug))
    _publish_now(label)  # before any process sees the new place
    if old_slug != tenant.slug:
        tenant_policy_delete(slug=old_slug)
    tenant_policy_sync(tenant=tenant)
    policy_invalidate()
    moved = _migrate(Job.objects.filter(tenant=tenant), policy_snapshot())
    _publish_now(label)
    log.warning("tenant %s moved from %s/%s: %d waiting job(s) re-admitted", tenant.slug, old_shard, old_slug, moved)
    return moved


def shard_renamed(*, shard_id: int, old_name: str) -> int:
    """After a shard's name changed (committed): every tenant on it moves with it."""
    shard = Shard.objects.filter(pk=shard_id).first()
    if shard is None or shard.name == old_name:
        return 0
    old_tag = shard_tag(old_name)
    tenants = list(Tenant.objects.select_related("shard").filter(shard=shard))
    labels = [_label("s", shard.name)] + [_label("t", t.slug) for t in tenants]
    _register(labels[0], (old_tag, SHARD_KEY), renamed_from=_label("s", old_name))
    for tenant in tenants:
        _register(_label("t", tenant.slug), (old_tag, tenant_key(tenant.slug)))
    for label in labels:
        _publish_now(label)
    shard_policy_delete(name=old_name)
    shard_policy_sync(shard=shard)
    for tenant in tenants:
        tenant_policy_sync(tenant=tenant)
    policy_invalidate()
    moved = _migrate(Job.objects.filter(tenant__shard=shard), policy_snapshot())
    for label in labels:
        _publish_now(label)
    return moved


def _migrate(jobs: QuerySet[Job], policy: PolicySnapshot) -> int:
    """Give every waiting job of `jobs` whose place is stale the current one. Parked jobs
    are all taken off the old place first (so no release there wakes one of them while
    the others move), then admitted at the new place in submission order."""
    moved: list[Job] = []
    seen: list[Job] = []  # every waiting job: its cells follow its tenant's new place
    waiting = jobs.select_related("tenant").filter(status__in=[JobStatus.QUEUED, JobStatus.PARKED])
    for job in waiting.order_by("submitted_at", "id").iterator(chunk_size=MIGRATE_CHUNK):
        tenant = policy.tenants.get(job.tenant.slug)
        if tenant is None:
            continue
        seen.append(job)
        tag, names = job_placement(
            tenant=tenant,
            sub_tenant=job.sub_tenant,
            batch=job.in_batch_lane,
            resources=known_resources(policy, job.resource_names),
            document=job.document,
            quarantined=job.quarantined,
        )
        keys = KEY_SEPARATOR.join(names)
        if (job.engine_tag, job.engine_keys) == (tag, keys):
            continue
        if job.status == JobStatus.QUEUED and job.admitted_at is None:
            # Never reached the engine: it is simply admitted at the new place later.
            Job.objects.filter(id=job.id, generation=job.generation, status=JobStatus.QUEUED).update(
                engine_tag=tag, engine_keys=keys
            )
            continue
        if job.status != JobStatus.PARKED:
            continue  # holds its slots at the old place and finishes there
        result = engine().cancel(tag=job.engine_tag, job_id=job.engine_id)
        if not result.cancelled:
            job.status = JobStatus.QUEUED  # for its cells
            continue  # woken meanwhile: it now holds its slots at the old place
        outcomes_handle(woken=result.woken, reclaimed=result.reclaimed)
        if Job.objects.filter(id=job.id, generation=job.generation, status=JobStatus.PARKED).update(
            generation=job.generation + 1,
            status=JobStatus.QUEUED,
            admitted_at=None,
            engine_tag=tag,
            engine_keys=keys,
            timeline=tl.appended(tl.line(tl.REQUEUED, f"moved to {tag}")),
        ):
            job.generation += 1
            job.status, job.admitted_at, job.engine_tag, job.engine_keys = JobStatus.QUEUED, None, tag, keys
            moved.append(job)
    for label in {_label("t", j.tenant.slug) for j in moved}:
        _publish_now(label)  # what the old place still holds, now that nothing waits there
    # Before the moved jobs' admissions, which park some of them again.
    cells.jobs_replace(seen, policy=policy)
    for start in range(0, len(moved), MIGRATE_CHUNK):
        jobs_admit(moved[start : start + MIGRATE_CHUNK], policy=policy)
    return len(moved)


def moves_track(policy: PolicySnapshot) -> list[str]:
    """The tick's part: publish what each move still holds at its old places, forget the
    places that hold nothing (or that are current again) and the moves that are done.
    Returns the old tags still in use, for the sweep."""
    client = redis_client()
    registry = {str(k): str(v) for k, v in client.hgetall(MOVES_KEY).items()}
    if not registry:
        return []
    current: dict[str, Place] = {}
    for tenant in policy.tenants.values():
        current[_label("t", tenant.slug)] = (shard_tag(tenant.shard), tenant_key(tenant.slug))
    for name in policy.shards:
        current[_label("s", name)] = (shard_tag(name), SHARD_KEY)
    held: dict[str, int] = {}
    done: list[str] = []
    tags: set[str] = set()
    for label, raw in registry.items():
        places = [p for p in (tuple(p) for p in json.loads(raw)) if p != current.get(label)]
        counts = {p: _held([p]) for p in places}  # type: ignore[list-item]
        still = [p for p, n in counts.items() if n > 0]
        if still:
            held[label] = sum(counts.values())
            client.hset(MOVES_KEY, label, json.dumps(still))
            tags.update(tag for tag, _ in still)
        else:
            done.append(label)
    if done:
        client.hdel(MOVES_KEY, *done)
    live.held_elsewhere_publish(held, drop=done)
    return sorted(tags)
