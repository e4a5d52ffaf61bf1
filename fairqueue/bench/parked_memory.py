"""`manage.py bench parked-memory`: what one parked job costs the engine's Redis, in bytes,
by structure, at N parked jobs (100,000 by default).

On a private redis-server (nothing else in it, so its memory is ours): one tenant's jobs
are admitted as the submit path admits them (the tenant key and the shard key, their
limits and flows as fairqueue.jobs.admission plans them, the delivery route as data) behind
one running job that holds the tenant's only slot, so all of them park on the tenant key,
as a flood does; each enters its cells as a parked job (fairqueue.jobs.cells: its shard,
tenant and parked cells). Then, per parked job:

- `wait_entry`: the tag's waits sorted set (MEMORY USAGE, every element counted);
- `job_record`: the tag's state hash less what it held before the parks, less the
  flow records below (the job's spec field);
- `flow_records`: the state hash's flow fields ("\\4" finish tags, "\\5" counts): a few
  per (key, priority, flow), whatever the backlog, so near 0 per job at 100k;
- `cells`: every key of the cells (fairqueue.jobs.cells);
- `total`: used_memory after less before (allocator overhead included), the figure the
  issue's 1,137 bytes was measured as.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from fairqueue.bench.redis_server import RedisServer
from fairqueue.engine import AdmitRequest, Engine, KeyLimit
from fairqueue.engine.keys import key_name
from fairqueue.jobs import cells
from fairqueue.jobs.admission import SHARD_KEY, flow_weight, shard_tag, tenant_key
from fairqueue.jobs.broker import delivery_route

PARKED = {"full": 100_000, "quick": 2_000}
CHUNK = 5_000
SHARD = "default"
TENANT = "flood"
SHARD_CAPACITY = 100
LEASE_SECONDS = 3600.0
DEFAULT_LEVEL = 2  # the `default` class's broker level (fairqueue.jobs.admission.class_level)
TARGET_BYTES = 550


def _usage(client: redis.Redis, key: str) -> int:
    return int(client.memory_usage(key, samples=0) or 0)


def _cells_bytes(client: redis.Redis) -> int:
    return sum(_usage(client, k) for k in client.scan_iter(match=cells.PREFIX + "*", count=1000))


def _flow_bytes(client: redis.Redis, state: str) -> tuple[int, int]:
    """(fields, bytes of their names and values) of the flow records in the state hash."""
    fields = size = 0
    for name, value in client.hscan_iter(state, match="[\x04\x05]*", count=1000):
        fields += 1
        size += len(name) + len(value)
    return fields, size


def measure(client: redis.Redis, parked: int, log: Callable[[str], None]) -> dict[str, Any]:
    engine = Engine(client)
    tag = shard_tag(SHARD)
    engine.init_tag(tag=tag)
    state, waits = key_name(engine.prefix, tag, "state"), key_name(engine.prefix, tag, "waits")
    keys = [
        KeyLimit(tenant_key(TENANT), 1, "", 1.0),
        KeyLimit(SHARD_KEY, SHARD_CAPACITY, TENANT, flow_weight(1, 1.0)),
    ]
    data = delivery_route(level=DEFAULT_LEVEL, batch=False)
    running = engine.admit(tag=tag, job_id=str(uuid.uuid4()), keys=keys, lease_seconds=LEASE_SECONDS, data=data)
    if not running.admitted:
        raise RuntimeError("the running job was not admitted")
    sha = client.script_load(cells.SOURCE)
    client.execute_command("MEMORY", "PURGE")
    before = {
        "used": int(client.info("memory")["used_memory"]),
        "state": _usage(client, state),
        "waits": _usage(client, waits),
        "cells": _cells_bytes(client),
    }
    score = f"{time.time():.6f}"
    tenant_cells = [cells.shard_cell(SHARD, "default"), cells.tenant_cell(TENANT, "default")]
    parked_cell = cells.parked_cell(TENANT, "default")
    for start in range(0, parked, CHUNK):
        ids = [str(uuid.uuid4()) for _ in range(min(CHUNK, parked - start))]
        outcomes = engine.admit_many(
            [AdmitRequest(tag=tag, job_id=i, keys=keys, lease_seconds=LEASE_SECONDS, data=data) for i in ids]
        )
        if any(o.admitted for o in outcomes):
            raise RuntimeError("a job was admitted: the running job should hold the tenant's only slot")
        ops: list[Any] = []
        for i in ids:
            ops += ["set", i, score, 3, *tenant_cells, parked_cell]
        for at in range(0, len(ops), 7 * cells.OPS_PER_CALL):
            client.evalsha(sha, 1, cells.PREFIX, *ops[at : at + 7 * cells.OPS_PER_CALL])
    client.execute_command("MEMORY", "PURGE")
    flow_fields, flow_size = _flow_bytes(client, state)
    after = {
        "used": int(client.info("memory")["used_memory"]),
        "state": _usage(client, state),
        "waits": _usage(client, waits),
        "cells": _cells_bytes(client),
    }
    per = {k: (after[k] - before[k]) / parked for k in before}
    flow_per_job = flow_size / parked
    by_structure = {
        "wait_entry": round(per["waits"], 1),
        "job_record": round(per["state"] - flow_per_job, 1),
        "flow_records": round(flow_per_job, 2),
        "cells": round(per["cells"], 1),
    }
    total = round(per["used"], 1)
    log(f"  {parked} parked: {total} B per parked job (used_memory), by structure {by_structure}")
    return {
        "parked": parked,
        "bytes_per_parked_job": total,
        "bytes_by_structure": by_structure,
        "structures_sum": round(sum(by_structure.values()), 1),
        "flow_fields": flow_fields,
        "target_bytes": TARGET_BYTES,
        "meets_target": total <= TARGET_BYTES,
        "redis_version": client.info("server")["redis_version"],
    }


def run_command(options: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    parked = options.get("parked") or PARKED["quick" if options.get("quick") else "full"]
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        return measure(client, parked, log)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
    parser.add_argument("--quick", action="store_true", help=f"{PARKED['quick']} parked jobs (smoke test)")
    parser.add_argument("--parked", type=int, default=None, help=f"parked jobs (default {PARKED['full']})")
