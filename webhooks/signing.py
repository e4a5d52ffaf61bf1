"""The webhook signature: `FairQueue-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256>` over
`"<t>." + body` under the tenant's webhook secret. The timestamp is signed with the body,
so a receiver that refuses old timestamps refuses replays (README, "Webhooks")."""

from __future__ import annotations

import hashlib
import hmac
import time

SIGNATURE_HEADER = "FairQueue-Signature"
EVENT_ID_HEADER = "FairQueue-Event-Id"
DEFAULT_TOLERANCE_SECONDS = 300


def signature(secret: str, body: bytes, timestamp: int) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def signature_header(secret: str, body: bytes, timestamp: int | None = None) -> str:
    t = int(time.time()) if timestamp is None else timestamp
    return f"t={t},v1={signature(secret, body, t)}"


def signature_verify(
    secret: str, body: bytes, header: str, *, tolerance: int = DEFAULT_TOLERANCE_SECONDS, now: float | None = None
) -> bool:
    """What a receiver does (the README shows the same in a few lines)."""
    try:
        parts = dict(item.split("=", 1) for item in header.split(","))
        t = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - t) > tolerance:
        return False
    return hmac.compare_digest(signature(secret, body, t), parts.get("v1", ""))
