"""What a dashboard page may send over its websocket, checked.

    {"type": "pins", "slugs": [slug, ...]}     the tenants pinned in this browser (at most PINNED_MAX)
    {"type": "search", "query": "text"}        tenants whose slug or name holds the text ("" ends the search)
    {"type": "open", "slug": slug | null}      one tenant's live row and sparkline (null closes it)

Anything else raises MessageError with a sentence saying what is wrong, which the consumer
sends back as an error frame (the socket stays open).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PINNED_MAX = 50
QUERY_MAX = 100
SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")  # tenants.models.SLUG_VALIDATOR's


class MessageError(ValueError):
    """A page's message that is not one of the documented ones; the text says why."""


@dataclass(frozen=True)
class Pins:
    slugs: tuple[str, ...]


@dataclass(frozen=True)
class Search:
    query: str


@dataclass(frozen=True)
class Open:
    slug: str | None


PageMessage = Pins | Search | Open


def _slug(value: Any, what: str) -> str:
    if not isinstance(value, str) or not SLUG_RE.match(value):
        raise MessageError(
            f"{what} must be a tenant slug (1-63 lowercase letters, digits, '-' or '_'), not {value!r:.80}"
        )
    return value


def message_parse(content: Any) -> PageMessage:
    """The page's message, or MessageError."""
    if not isinstance(content, dict):
        raise MessageError("a message must be a JSON object with a 'type'")
    kind = content.get("type")
    if kind == "pins":
        slugs = content.get("slugs")
        if not isinstance(slugs, list):
            raise MessageError("'pins' needs 'slugs': a list of tenant slugs")
        if len(slugs) > PINNED_MAX:
            raise MessageError(f"at most {PINNED_MAX} tenants can be pinned, not {len(slugs)}")
        return Pins(tuple(dict.fromkeys(_slug(s, "each pinned tenant") for s in slugs)))
    if kind == "search":
        query = content.get("query")
        if not isinstance(query, str):
            raise MessageError("'search' needs 'query': a string")
        if len(query) > QUERY_MAX:
            raise MessageError(f"a search is at most {QUERY_MAX} characters, not {len(query)}")
        return Search(query.strip())
    if kind == "open":
        slug = content.get("slug")
        return Open(None if slug is None else _slug(slug, "'open' needs 'slug', which"))
    raise MessageError(f"unknown message type {kind!r:.40}: expected 'pins', 'search' or 'open'")
