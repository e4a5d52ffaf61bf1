"""A tenant's recent figures for its sparkline: in flight, waiting and oldest wait per tick.

Recorded by the tick's build for the tenants some page can see (the top N and the watched),
never for every tenant: a capped list per tenant (`fq:dash:thist:<slug>`, newest first),
which expires when nobody has looked at the tenant for HISTORY_TTL_SECONDS. Each point is
`ts,in_flight,waiting,oldest_wait_s` (an empty oldest wait: nothing waits); points carry
their time, so a tenant that left the view and came back shows the gap.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dashboard.snapshot import HISTORY_LEN
from fairqueue.jobs.runtime import redis_client

HISTORY_TTL_SECONDS = 600

Point = list[float | None]  # [ts, in_flight, waiting, oldest_wait_s or None]


def tenant_history_key(slug: str) -> str:
    return f"fq:dash:thist:{slug}"


def tenant_history_record(rows: Iterable[dict[str, Any]], *, ts: float) -> None:
    """Append one point to each of these tenants' history (one round trip)."""
    pipe = redis_client().pipeline(transaction=False)
    count = 0
    for row in rows:
        key = tenant_history_key(row["slug"])
        oldest = row["oldest_wait_s"]
        pipe.lpush(key, f"{ts:.3f},{row['in_flight']},{row['waiting']},{'' if oldest is None else oldest}")
        pipe.ltrim(key, 0, HISTORY_LEN - 1)
        pipe.expire(key, HISTORY_TTL_SECONDS)
        count += 1
    if count:
        pipe.execute()


def tenant_history_read(slug: str) -> list[Point]:
    """The tenant's points, oldest first."""
    points: list[Point] = []
    key = tenant_history_key(slug)
    raws: list[str] = redis_client().lrange(key, 0, HISTORY_LEN - 1)  # type: ignore[assignment]  # a text-mode client
    for raw in reversed(raws):
        ts, in_flight, waiting, oldest = raw.split(",")
        points.append([float(ts), int(in_flight), int(waiting), float(oldest) if oldest else None])
    return points
