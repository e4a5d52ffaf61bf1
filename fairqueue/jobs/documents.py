"""The documents in flight (fan-out parents, fairqueue.jobs.fanout), as the dashboard and
`/metrics` read them: one Redis hash, written when a parent submits its children and
emptied of it when the parent finishes, so a build reads it in one round trip and never
queries the database.

The hash is a picture, not the truth: the database is. A write lost to a Redis outage
leaves a document out of the picture; an entry left behind by a crash is dropped by the
duty's check (fairqueue.jobs.fanout.documents_prune).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from fairqueue.jobs.runtime import redis_client

log = logging.getLogger("fairqueue.jobs.documents")

# HASH parent job id -> "<tenant> <shard> <children> <cap>"
DOCUMENTS_KEY = "fq:{fanout}:documents"


@dataclass(frozen=True)
class Document:
    parent_id: str
    tenant: str
    shard: str
    children: int
    cap: int


def document_record(*, parent_id: str, tenant: str, shard: str, children: int, cap: int) -> None:
    """Best-effort: a document the picture would miss is no error of the submit."""
    try:
        redis_client().hset(DOCUMENTS_KEY, parent_id, f"{tenant} {shard} {children} {cap}")
    except redis.RedisError:
        log.warning("could not record document %s in flight", parent_id)


def documents_forget(parent_ids: Iterable[str]) -> None:
    ids = list(parent_ids)
    if not ids:
        return
    try:
        redis_client().hdel(DOCUMENTS_KEY, *ids)
    except redis.RedisError:
        log.warning("could not forget %d finished document(s); the duty's check drops them", len(ids))


def documents_parse(raw: Mapping[Any, Any]) -> list[Document]:
    out = []
    for parent_id, value in raw.items():
        parts = str(value).split(" ")
        if len(parts) != 4:
            continue
        tenant, shard, children, cap = parts
        out.append(Document(str(parent_id), tenant, shard, int(children), int(cap)))
    return out


def documents_read() -> list[Document]:
    return documents_parse(redis_client().hgetall(DOCUMENTS_KEY) or {})
