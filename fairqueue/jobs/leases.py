"""The holds of the jobs running in this process, renewed from one thread (the heartbeat
the engine's leases expect). A hold the engine reclaimed is noted, so the job's finish
knows a newer delivery owns it."""

from __future__ import annotations

import logging
import threading
import time

from django.conf import settings

from fairqueue.jobs.runtime import engine

log = logging.getLogger("fairqueue.jobs.leases")

MIN_RENEW_SECONDS = 0.2


class ActiveLeases:
    """Renews the holds of every job running in this process from one thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, str] = {}
        self._batch: set[str] = set()
        self._lost: set[str] = set()
        self._thread: threading.Thread | None = None

    def add(self, engine_id: str, tag: str, *, batch: bool = False) -> None:
        with self._lock:
            self._active[engine_id] = tag
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
            lost = engine_id in self._lost
            self._lost.discard(engine_id)
            return lost

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self._active)

    def count(self) -> tuple[int, int]:
        """(running jobs, of which batch-lane jobs) in this process."""
        with self._lock:
            return len(self._active), len(self._batch)

    def _run(self) -> None:
        lease = float(settings.FAIRQUEUE["LEASE_SECONDS"])
        while True:
            time.sleep(max(lease / 3, MIN_RENEW_SECONDS))
            with self._lock:
                items = list(self._active.items())
            for engine_id, tag in items:
                try:
                    if not engine().renew(tag=tag, job_id=engine_id, lease_seconds=lease):
                        with self._lock:
                            self._lost.add(engine_id)
                except Exception:  # keep renewing the others; a Redis blip must not kill this thread
                    log.exception("lease renew failed for %s", engine_id)


active_leases = ActiveLeases()
