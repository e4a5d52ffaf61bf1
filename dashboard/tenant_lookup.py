"""What a page asks about tenants beyond its picture: a search by slug or name, and the
live rows of the tenants it names.

The search runs over the policy snapshot every process keeps (no query), lower-cased once
per snapshot: exact slug first, then slugs, then names that start with the text, then
those that hold it, each by slug; at most SEARCH_LIMIT matches, with how many there are.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dashboard.picture import picture_row
from dashboard.snapshot import snapshot_build
from tenants.policy import PolicySnapshot, policy_snapshot

SEARCH_LIMIT = 20


@dataclass(frozen=True)
class _Index:
    policy: PolicySnapshot
    entries: list[tuple[str, str]]  # (slug, name lower-cased) by slug


_index: _Index | None = None
_index_lock = threading.Lock()


def _index_for(policy: PolicySnapshot) -> _Index:
    global _index
    with _index_lock:
        index = _index
        if index is None or index.policy is not policy:
            entries = sorted((t.slug, t.name.lower()) for t in policy.tenants.values())
            index = _index = _Index(policy, entries)
    return index


@dataclass(frozen=True)
class SearchResult:
    query: str
    matches: list[dict[str, Any]]  # {"slug", "name", "shard", "active"}, at most SEARCH_LIMIT
    total: int  # every tenant that matches


def tenants_search(query: str, *, limit: int = SEARCH_LIMIT) -> SearchResult:
    """Tenants whose slug or name holds `query` (any case), best matches first."""
    policy = policy_snapshot()
    needle = query.strip().lower()
    if not needle:
        return SearchResult(query, [], 0)
    exact: list[str] = []
    starts: list[str] = []
    name_starts: list[str] = []
    holds: list[str] = []
    for slug, name in _index_for(policy).entries:
        if slug == needle:
            exact.append(slug)
        elif slug.startswith(needle):
            starts.append(slug)
        elif name.startswith(needle):
            name_starts.append(slug)
        elif needle in slug or needle in name:
            holds.append(slug)
    ranked = exact + starts + name_starts + holds
    matches = []
    for slug in ranked[:limit]:
        t = policy.tenants[slug]
        matches.append({"slug": t.slug, "name": t.name, "shard": t.shard, "active": t.active})
    return SearchResult(query, matches, len(ranked))


def tenant_rows_now(slugs: Iterable[str]) -> dict[str, dict[str, Any]]:
    """These tenants' live rows from a fresh snapshot (tenants not in policy are left out)."""
    wanted = set(slugs)
    if not wanted:
        return {}
    rows = snapshot_build(with_history=False)["tenants"]
    return {r["slug"]: picture_row(r) for r in rows if r["slug"] in wanted}
