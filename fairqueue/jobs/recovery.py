"""Rebuilding scheduling state from the database, the source of truth.

Redis may restart empty or be flushed. Any worker notices on its next tick (the state
marker is gone) and, under a lock, re-enters every unfinished job:
- `running` jobs are re-admitted as holders without being dispatched again: a live
  worker keeps renewing its lease and finishes normally; a dead one's lease runs out and
  the job is reclaimed like any other;
- `queued`/`parked` jobs are re-admitted in their original submission order, so the
  waiter queues come back FIFO, and admitted ones are dispatched (duplicate broker
  messages, if any survived, are stopped by the claim guard).
Engine ids are kept (no new generation), so re-admission is idempotent. Until the rebuild
marks each shard's engine tag ready (`Engine.init_tag`), ordinary admissions on it do
nothing (`require_ready`): a newcomer cannot take a slot a still-running job holds.

Jobs accepted while Redis was unreachable sit `queued` with no admission; the same tick
admits them once they are a few seconds old.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import timedelta

from django.db.models import QuerySet
from django.utils import timezone

from fairqueue.engine.keys import LAYOUT
from fairqueue.jobs.admission import shard_tag
from fairqueue.jobs.dispatch import jobs_admit
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.runtime import engine, redis_client
from tenants.policy import policy_snapshot

log = logging.getLogger("fairqueue.recovery")

# Named after the engine's data layout: code with a new layout finds no marker and
# rebuilds its (new, empty) state from the database, as after a loss of Redis data.
STATE_KEY = f"fq:state:built:v{LAYOUT}"
REBUILD_LOCK_KEY = "fq:state:rebuild_lock"
REBUILD_LOCK_SECONDS = 120
CHUNK = 500
PENDING_GRACE_SECONDS = 5.0


def state_ensure() -> bool:
    """Rebuild Redis scheduling state if it was lost; True if this call rebuilt it."""
    client = redis_client()
    if client.exists(STATE_KEY):
        return False
    token = uuid.uuid4().hex
    if not client.set(REBUILD_LOCK_KEY, token, nx=True, ex=REBUILD_LOCK_SECONDS):
        return False  # another process is rebuilding
    try:
        counts = state_rebuild()
        client.set(STATE_KEY, f"{time.time():.3f}")
        if any(counts.values()):
            log.warning("Redis had lost scheduling state; rebuilt from the database: %s", counts)
    finally:
        if client.get(REBUILD_LOCK_KEY) == token:
            client.delete(REBUILD_LOCK_KEY)
    return True


def _chunks(qs: QuerySet[Job]) -> list[list[Job]]:
    jobs = list(qs.select_related("tenant__shard").order_by("submitted_at", "id"))
    return [jobs[i : i + CHUNK] for i in range(0, len(jobs), CHUNK)]


def state_rebuild() -> dict[str, int]:
    """Re-enter every unfinished job into the engine, oldest first."""
    policy = policy_snapshot()  # also resyncs policy if Redis lost it
    running = 0
    for chunk in _chunks(Job.objects.filter(status=JobStatus.RUNNING)):
        jobs_admit(chunk, policy=policy, dispatch=False, running=True, rebuilding=True)
        running += len(chunk)
    waiting = 0
    for chunk in _chunks(Job.objects.filter(status__in=[JobStatus.QUEUED, JobStatus.PARKED])):
        jobs_admit(chunk, policy=policy, rebuilding=True)
        waiting += len(chunk)
    # The engine state now holds every unfinished job: guarded admissions may go ahead.
    for shard_name in policy.shards:
        engine().init_tag(tag=shard_tag(shard_name))
    return {"running": running, "waiting": waiting}


def jobs_admit_pending(*, older_than: float = PENDING_GRACE_SECONDS, limit: int = 1000) -> int:
    """Admit jobs that were accepted but never reached the engine (Redis was unreachable)."""
    cutoff = timezone.now() - timedelta(seconds=older_than)
    pending = list(
        Job.objects.select_related("tenant__shard")
        .filter(status=JobStatus.QUEUED, admitted_at__isnull=True, submitted_at__lte=cutoff)
        .order_by("submitted_at", "id")[:limit]
    )
    if pending:
        jobs_admit(pending)
    return len(pending)
