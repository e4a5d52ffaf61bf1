"""The holds of the jobs running in this process, renewed from one thread (the heartbeat
the engine's leases expect). A hold the engine reclaimed is noted, so the job's finish
knows a newer delivery owns it.

A hold is also *fenced* once it has gone FENCE_FRACTION of a lease without a confirmed
renewal (Redis unreachable, a partition, a renewer stuck in a socket call): the engine
may reclaim it when the lease ends, so the task is told to stop (JobContext.hold_lost)
and the worker takes no new job until a renewal succeeds again. Fencing before the lease
ends is what bounds the time a reclaimed job can run twice."""

from __future__ import annotations

import logging
import threading
import time

import redis

from fairqueue import tracing
from fairqueue.conf import fq_settings
from fairqueue.jobs.runtime import engine

log = logging.getLogger("fairqueue.jobs.leases")

MIN_RENEW_SECONDS = 0.2
# A hold not confirmed for this part of a lease is treated as lost: the rest of the lease
# is the margin for the task to notice and stop before the engine may hand the slot on.
FENCE_FRACTION = 2 / 3


class ActiveLeases:
    """Renews the holds of every job running in this process from one thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, str] = {}
        self._batch: set[str] = set()
        self._lost: set[str] = set()
        self._confirmed: dict[str, float] = {}  # engine id -> monotonic time of the last confirmed hold
        self._thread: threading.Thread | None = None

    def add(self, engine_id: str, tag: str, *, batch: bool = False) -> None:
        """Start renewing a hold the caller has just confirmed (claimed or renewed)."""
        with self._lock:
            self._active[engine_id] = tag
            self._confirmed[engine_id] = time.monotonic()
            if batch:
                self._batch.add(engine_id)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fairqueue-lease-renewer", daemon=True)
                self._thread.start()

    def remove(self, engine_id: str) -> bool:
        """Stop renewing; True if the hold was lost to a reclaim while running."""
        with self._lock:
            self._active.pop(engine_id, None)
            self._batch.discard(engine_id)
            confirmed = self._confirmed.pop(engine_id, None)
            lost = engine_id in self._lost or (confirmed is not None and self._expired(confirmed))
            self._lost.discard(engine_id)
            return lost

    def hold_lost(self, engine_id: str) -> bool:
        """True once this process can no longer trust it holds the job: the engine said the
        hold is gone, or no renewal was confirmed for FENCE_FRACTION of a lease."""
        with self._lock:
            if engine_id in self._lost:
                return True
            confirmed = self._confirmed.get(engine_id)
            return confirmed is not None and self._expired(confirmed)

    def fenced(self) -> bool:
        """True while some running job's hold is unconfirmed past the fence: the worker then
        takes no new job (its connection to the engine is evidently not working)."""
        with self._lock:
            return any(self._expired(at) for at in self._confirmed.values())

    @staticmethod
    def _expired(confirmed_at: float) -> bool:
        lease = float(fq_settings().LEASE_SECONDS)
        return time.monotonic() - confirmed_at > lease * FENCE_FRACTION

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self._active)

    def count(self) -> tuple[int, int]:
        """(running jobs, of which batch-lane jobs) in this process."""
        with self._lock:
            return len(self._active), len(self._batch)

    def _run(self) -> None:
        lease = float(fq_settings().LEASE_SECONDS)
        while True:
            time.sleep(max(lease / 3, MIN_RENEW_SECONDS))
            with self._lock:
                items = list(self._active.items())
            for engine_id, tag in items:
                try:
                    asked = time.monotonic()  # the hold is confirmed from when the renewal was sent
                    if engine().renew(tag=tag, job_id=engine_id, lease_seconds=lease):
                        with self._lock:
                            if engine_id in self._confirmed:
                                self._confirmed[engine_id] = asked
                        tracing.job_event(engine_id, "lease renewed")
                    else:
                        with self._lock:
                            self._lost.add(engine_id)
                except redis.RedisError as exc:  # unconfirmed: the fence counts from the last success
                    log.warning("lease renew failed for %s: %s", engine_id, exc)
                except Exception:  # keep renewing the others; nothing may kill this thread
                    log.exception("lease renew failed for %s", engine_id)


active_leases = ActiveLeases()
