"""Keeping the engine's state in line with the database, the source of truth.

Rebuild. Redis may restart empty or be flushed; each engine tag then reads as not ready.
Any worker notices on its next tick and, under that tag's lock, re-enters every
unfinished job of the tag, reading rows in chunks:
- `running` jobs are re-admitted as holders where they were admitted, without being
  dispatched again: a live worker keeps renewing its lease and finishes normally; a dead
  one's lease runs out and the job is reclaimed like any other;
- `queued`/`parked` jobs of the tag's tenants are re-admitted in submission order, so
  the waiter queues come back FIFO, and admitted ones are dispatched (duplicate broker
  messages, if any survived, are stopped by the claim guard).
Engine ids are kept (no new generation), so re-admission is idempotent. The tag is marked
ready only once every row is back: a Redis error half-way leaves it not ready, and the
next tick rebuilds it again. Until then ordinary admissions on it do nothing
(`require_ready`): a newcomer cannot take a slot a still-running job holds.

Foreign state. A tag can also look complete and still have lost writes: after a failover
the promoted replica (replication is asynchronous) may lack the last admissions, parks and
releases the old primary acknowledged, and a server restarted from a snapshot lacks
everything since. The engine stamps each tag with the identity of the server that marked
it ready (process and replication history) and reports a stamp that is not the current
server's as FOREIGN; the tick then compares what the tag knows with the database (to count
the writes it lost), deletes the tag's state and rebuilds it like a lost one.

Pending. Jobs accepted while Redis was unreachable (or whose delivery could not be
published) sit `queued` with no admission; each tick admits them once a few seconds old.

Broker restarts. A Redis broker keeps nothing on disk: when the duties see a new server
behind the broker URL, they publish every admitted job that has not started again.

Reconcile. Each tick also checks a bounded number of unfinished rows against the engine
and re-enters those whose engine state is missing (a parked row that is not parked, an
admitted or running one without a hold), when seen missing on two ticks in a row (a
transition in flight is not mistaken for a loss). It frees the slots of finished jobs
whose release could not reach Redis (`release_pending`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import redis
from django.db.models import Q, QuerySet
from django.db.models.functions import Coalesce
from django.utils import timezone

from fairqueue.engine import TagHealth
from fairqueue.jobs import cells, stats
from fairqueue.jobs.admission import shard_tag
from fairqueue.jobs.broker import broker_identity
from fairqueue.jobs.dispatch import jobs_admit, outcomes_handle
from fairqueue.jobs.models import ADMISSION_PENDING, RECONCILED, TERMINAL_STATUSES, Job, JobStatus
from fairqueue.jobs.runtime import engine, redis_client
from tenants.policy import policy_snapshot

log = logging.getLogger("fairqueue.recovery")

REBUILD_LOCK_PREFIX = "fq:state:rebuild_lock:"  # + tag
# Extended after every chunk a rebuild re-enters, so a rebuilder that dies (a worker killed
# mid-rebuild) keeps the tag from being rebuilt by another for this long at most.
REBUILD_LOCK_SECONDS = 10
CHUNK = 500
PENDING_GRACE_SECONDS = 5.0
RECONCILE_ROWS_PER_TICK = 20
RECONCILE_CURSOR_KEY = "fq:reconcile:cursor"  # the last (submitted_at, id) checked
RECONCILE_SUSPECTS_KEY = "fq:reconcile:suspects"  # HASH engine id -> status seen missing
RELEASES_PER_TICK = 200
RECONCILE_SUSPECTS_TTL_SECONDS = 60
BROKER_IDENTITY_KEY = "fq:broker:identity"  # the broker server's identity the duties last saw

# Delete the lock only if it is still ours (it may have expired and been taken since).
_UNLOCK = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# Extend the lock only if it is still ours.
_EXTEND = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('expire', KEYS[1], ARGV[2]) end return 0"


def state_ensure() -> list[str]:
    """Rebuild every shard's engine tag that is not ready (its state was lost) or foreign (it
    may have lost writes: a failover, a restart from a snapshot); returns the tags rebuilt.
    A tag whose server does not answer now is left for the next tick."""
    policy = policy_snapshot()  # also resyncs policy if Redis lost it
    tags = {shard_tag(name): name for name in policy.shards}
    health = engine().tags_health(tags)
    rebuilt = []
    for tag, shard in tags.items():
        state = health.get(tag)
        if state is None or state is TagHealth.READY:
            continue
        if tag_rebuild(tag=tag, shard=shard, foreign=state is TagHealth.FOREIGN):
            rebuilt.append(tag)
    if rebuilt:
        # Whatever lost the engine's state may have lost the cells' updates too.
        cells.cells_rebuild()
    return rebuilt


def tag_rebuild(*, tag: str, shard: str, foreign: bool = False) -> bool:
    """Re-enter every unfinished job of one tag, then mark it ready; all or nothing. With
    `foreign`, the tag's state is first counted against the database and thrown away.
    False if another process holds the tag's rebuild lock or the rebuild failed."""
    client = redis_client()
    lock, token = REBUILD_LOCK_PREFIX + tag, uuid.uuid4().hex
    try:
        if not client.set(lock, token, nx=True, ex=REBUILD_LOCK_SECONDS):
            return False
    except redis.RedisError:
        log.warning("could not take the rebuild lock of %s; retried next tick", tag, exc_info=True)
        return False
    lost: dict[str, int] = {}
    try:
        if foreign:
            # Another process may have rebuilt it while we waited for the lock.
            if engine().tags_health([tag]).get(tag) is not TagHealth.FOREIGN:
                return False
            lost = writes_lost(tag=tag, shard=shard)
            engine().reset_tag(tag=tag)

        def keep_lock() -> None:
            if not client.eval(_EXTEND, 1, lock, token, REBUILD_LOCK_SECONDS):
                raise RuntimeError(f"lost the rebuild lock of {tag}")

        counts = _rebuild(tag=tag, shard=shard, keep_lock=keep_lock)
        engine().init_tag(tag=tag)
    except Exception:
        log.exception("rebuild of %s failed; it stays not ready and is retried next tick", tag)
        return False
    finally:
        try:
            client.eval(_UNLOCK, 1, lock, token)
        except redis.RedisError:
            log.warning("could not release the rebuild lock of %s; it expires", tag, exc_info=True)
    if foreign:
        stats.count("foreign_rebuilds")
        for kind, n in lost.items():
            stats.count(f"writes_lost:{kind}", n)
        log.warning(
            "the engine state of %s came from another Redis server (a failover or a restart from a snapshot): "
            "it lacked %s; rebuilt from the database: %s",
            tag,
            lost,
            counts,
        )
    elif any(counts.values()):
        log.warning("Redis had lost the scheduling state of %s; rebuilt from the database: %s", tag, counts)
    return True


def writes_lost(*, tag: str, shard: str) -> dict[str, int]:
    """What a tag's state lacks against the database, by kind of write: `admissions` (jobs
    the database says hold their slots, admitted or running, that the tag does not hold:
    unknown, or still parked where a lost handoff had woken them), `parks` (parked jobs the
    tag does not know) and `releases` (finished jobs the tag still knows, but for releases
    that could not be made and wait for the reconciler). A job admitted and
    finished within the lost writes leaves no trace in either and is not counted. A count,
    not a repair: rows that change while it runs can be miscounted by a few."""
    known = engine().known_jobs(tag=tag)
    placed_here = Q(engine_tag=tag) | Q(engine_tag="", tenant__shard__name=shard)
    holding = Q(status=JobStatus.RUNNING) | Q(status=JobStatus.QUEUED, admitted_at__isnull=False)
    unfinished: dict[str, str] = {}
    for job_id, generation, status in (
        Job.objects.filter(placed_here)
        .filter(holding | Q(status=JobStatus.PARKED))
        .values_list("id", "generation", "status")
        .iterator(chunk_size=CHUNK)
    ):
        unfinished[f"{job_id}.{generation}"] = status
    lost = {"admissions": 0, "parks": 0, "releases": 0}
    for engine_id, status in unfinished.items():
        if status == JobStatus.PARKED:
            lost["parks"] += engine_id not in known
        else:
            lost["admissions"] += known.get(engine_id) != "admitted"
    stale = known.keys() - unfinished.keys()
    if stale:
        ids = {e.rpartition(".")[0] for e in stale}
        lost["releases"] = sum(
            1
            # A release still pending was never made, so it was not lost.
            for job_id, generation in Job.objects.filter(
                id__in=ids, status__in=sorted(TERMINAL_STATUSES), release_pending=False
            )
            .values_list("id", "generation")
            .iterator(chunk_size=CHUNK)
            if f"{job_id}.{generation}" in stale
        )
    return lost


def _chunks(qs: QuerySet[Job]) -> Iterator[list[Job]]:
    """Rows in the order they entered admission (submission, or the due time of a delayed or
    retried job), read from the database a chunk at a time."""
    chunk: list[Job] = []
    entered = Coalesce("due_at", "submitted_at")
    for job in qs.select_related("tenant__shard").order_by(entered, "id").iterator(chunk_size=CHUNK):
        chunk.append(job)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _rebuild(*, tag: str, shard: str, keep_lock: Callable[[], None]) -> dict[str, int]:
    policy = policy_snapshot()
    placed_here = Q(engine_tag=tag) | Q(engine_tag="", tenant__shard__name=shard)
    running = 0
    for chunk in _chunks(Job.objects.filter(placed_here, status=JobStatus.RUNNING)):
        jobs_admit(chunk, policy=policy, dispatch=False, running=True, rebuilding=True, strict=True)
        running += len(chunk)
        keep_lock()
    # Waiting jobs of this shard's tenants still placed where the engine lost its state too
    # (a place they were moved away from) come back here, where their tenant is now.
    waiting_on_shard = Job.objects.filter(tenant__shard__name=shard, status__in=[JobStatus.QUEUED, JobStatus.PARKED])
    elsewhere = set(waiting_on_shard.exclude(engine_tag__in=[tag, ""]).values_list("engine_tag", flat=True).distinct())
    lost = elsewhere - engine().ready_tags(elsewhere)
    waiting = 0
    for chunk in _chunks(waiting_on_shard.filter(placed_here | Q(engine_tag__in=lost))):
        for job in chunk:
            if job.engine_tag in lost:
                job.engine_tag, job.engine_keys = "", ""  # jobs_admit stores the current place
        jobs_admit(chunk, policy=policy, rebuilding=True, strict=True)
        waiting += len(chunk)
        keep_lock()
    return {"running": running, "waiting": waiting}


def jobs_admit_pending(*, older_than: float = PENDING_GRACE_SECONDS, limit: int = 1000) -> int:
    """Admit jobs that were accepted but never reached the engine (Redis was unreachable,
    or their delivery could not be published)."""
    cutoff = timezone.now() - timedelta(seconds=older_than)
    pending = list(
        Job.objects.select_related("tenant__shard")
        .filter(ADMISSION_PENDING, submitted_at__lte=cutoff)
        .order_by("submitted_at", "id")[:limit]
    )
    if pending:
        # Their entry into the cells may have been lost with the admission (a Redis error
        # at submit); entering again is idempotent.
        jobs_admit(pending, enter_cells=True)
    return len(pending)


def broker_watch() -> int:
    """Publish again every admitted job not yet started when the broker is a new server
    (a Redis broker restarted: it keeps nothing on disk, and the deliveries it held are
    gone; those jobs still hold their slots, which would otherwise wait out their dispatch
    lease). Returns how many were published again. A delivery that survived is skipped by
    the claim's generation guard. RabbitMQ's durable queues keep theirs: nothing to do."""
    identity = broker_identity()
    if identity is None:
        return 0
    client = redis_client()
    seen = client.getset(BROKER_IDENTITY_KEY, identity)
    if seen is None or seen == identity:
        return 0
    log.warning("the broker is a new server (it restarted): publishing its admitted jobs again")
    again = 0
    admitted = Job.objects.filter(status=JobStatus.QUEUED, admitted_at__isnull=False)
    for chunk in _chunks(admitted):
        jobs_admit(chunk)
        again += len(chunk)
    stats.count("broker_restarts")
    log.warning("published %d admitted job(s) again after the broker restart", again)
    return again


def releases_pending(*, limit: int = RELEASES_PER_TICK) -> int:
    """Free the slots of finished jobs whose release could not reach Redis at the time."""
    done = 0
    for job in Job.objects.filter(release_pending=True).order_by("finished_at")[:limit]:
        result = engine().release(tag=job.engine_tag, job_id=job.engine_id, keys=job.engine_key_names or None)
        outcomes_handle(woken=result.woken, reclaimed=result.reclaimed)
        Job.objects.filter(id=job.id, generation=job.generation).update(release_pending=False)
        done += 1
    return done


def reconcile_after(qs: QuerySet[Job], after_time: str, after_id: str) -> QuerySet[Job]:
    """The rows after the cursor (submitted_at, id) in that order. A range the index walks
    from the cursor on (`submitted_at >= t`), less the few rows of that instant already
    seen: written as `> t OR (= t AND id > i)`, PostgreSQL read every candidate row (half a
    second at 110,000 waiting)."""
    return qs.filter(submitted_at__gte=after_time).exclude(submitted_at=after_time, id__lte=after_id)


def reconcile(*, rows: int = RECONCILE_ROWS_PER_TICK) -> int:
    """Check the next `rows` unfinished rows against the engine (a cursor walks the table
    tick by tick); re-enter those missing from it on two ticks in a row. Returns how many
    were re-entered."""
    client = redis_client()
    cursor = str(client.get(RECONCILE_CURSOR_KEY) or "")
    after_time, after_id = cursor.split("|", 1) if cursor else ("", "")
    candidates = Job.objects.select_related("tenant__shard").filter(RECONCILED)
    qs = candidates.order_by("submitted_at", "id")
    if after_time:
        qs = reconcile_after(qs, after_time, after_id)
    batch = list(qs[:rows])
    if len(batch) < rows:
        client.delete(RECONCILE_CURSOR_KEY)  # the end: start over next tick
    else:
        client.set(RECONCILE_CURSOR_KEY, f"{batch[-1].submitted_at.isoformat()}|{batch[-1].id}")
    ready = engine().ready_tags({j.engine_tag for j in batch if j.engine_tag})
    missing: list[Job] = []
    for job in batch:
        if job.engine_tag not in ready:
            continue  # a tag being rebuilt (or a row from before placements): the rebuild's
        if engine().inspect_job(tag=job.engine_tag, job_id=job.engine_id).status != "unknown":
            continue  # parked or holding: either is a state the row can be in (a handoff in flight)
        seen = f"{job.status}|{job.generation}"
        if client.hget(RECONCILE_SUSPECTS_KEY, job.engine_id) == seen:
            client.hdel(RECONCILE_SUSPECTS_KEY, job.engine_id)
            missing.append(job)
        else:
            client.hset(RECONCILE_SUSPECTS_KEY, job.engine_id, seen)
    client.expire(RECONCILE_SUSPECTS_KEY, RECONCILE_SUSPECTS_TTL_SECONDS)
    return _reenter(missing)


def _reenter(jobs: list[Job]) -> int:
    """Re-admit rows the engine lost, if each is still what it was when found missing."""
    entered = 0
    for job in jobs:
        fresh = Job.objects.filter(id=job.id, generation=job.generation, status=job.status).exists()
        if not fresh:
            continue
        log.warning("job %s (%s) was missing from the engine; re-entering it", job.engine_id, job.status)
        if job.status == JobStatus.RUNNING:
            jobs_admit([job], dispatch=False, running=True, rebuilding=True)
        else:
            jobs_admit([job], rebuilding=True)
        entered += 1
    return entered
