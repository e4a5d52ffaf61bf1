"""Fleet-wide counters and latency histograms, aggregated in Redis.

Every process (web, each worker) counts locally and folds its counts into one Redis hash
at most once a second, so the hot path pays no extra round trip and `/metrics` (one
process) can report the whole fleet by reading a single hash at scrape time.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, defaultdict

from fairqueue.jobs.runtime import redis_client

STATS_KEY = "fq:stats"
FLUSH_SECONDS = 1.0
# Upper bounds (seconds) of the engine-call latency histograms.
LATENCY_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

_lock = threading.Lock()
_pending: Counter[str] = Counter()
_pending_float: defaultdict[str, float] = defaultdict(float)
_last_flush = time.monotonic()


def count(name: str, n: int = 1) -> None:
    """Add to a fleet-wide counter, e.g. `submitted` or `finished:succeeded`."""
    with _lock:
        _pending[name] += n
    _maybe_flush()


def observe(kind: str, seconds: float) -> None:
    """Record one latency of `kind` (`admit`, `release`) in its histogram."""
    index = bisect.bisect_left(LATENCY_BUCKETS, seconds)
    bucket = "+Inf" if index == len(LATENCY_BUCKETS) else repr(LATENCY_BUCKETS[index])
    with _lock:
        _pending[f"{kind}:bucket:{bucket}"] += 1
        _pending[f"{kind}:count"] += 1
        _pending_float[f"{kind}:sum"] += seconds
    _maybe_flush()


def _maybe_flush() -> None:
    if time.monotonic() - _last_flush >= FLUSH_SECONDS:
        flush()


def flush() -> None:
    """Fold local counts into Redis now (also called by the worker heartbeat)."""
    global _last_flush
    with _lock:
        counts, floats = dict(_pending), dict(_pending_float)
        _pending.clear()
        _pending_float.clear()
        _last_flush = time.monotonic()
    if not counts and not floats:
        return
    try:
        pipe = redis_client().pipeline(transaction=False)
        for name, n in counts.items():
            pipe.hincrby(STATS_KEY, name, n)
        for name, value in floats.items():
            pipe.hincrbyfloat(STATS_KEY, name, value)
        pipe.execute()
    except Exception:
        with _lock:  # keep them for the next flush rather than lose them
            _pending.update(counts)
            for name, value in floats.items():
                _pending_float[name] += value


def stats_read() -> dict[str, float]:
    """The fleet-wide counters and histogram cells (one HGETALL)."""
    return {str(k): float(v) for k, v in redis_client().hgetall(STATS_KEY).items()}
