"""The exception a task raises when an outside resource refused it for now (HTTP 429).

Kept free of imports so that `fairqueue.Backoff` costs a task module nothing: the package
root must stay light (fairqueue/__init__.py).
"""

from __future__ import annotations

import math


class Backoff(Exception):
    """Raised by a task whose call to `resource` was refused as over its rate or concurrency.

    The job is not failed: it goes back to wait on the resource's key, whose effective limit
    is cut (AIMD, docs/resources.md). `retry_after` (seconds, as the upstream's Retry-After
    says) pauses every new admission on that key until then.
    """

    def __init__(self, resource: str, retry_after: float | None = None) -> None:
        if not isinstance(resource, str) or not resource:
            raise ValueError("Backoff needs the name of the resource that refused the call")
        if retry_after is not None and (
            isinstance(retry_after, bool)
            or not isinstance(retry_after, int | float)
            or not math.isfinite(retry_after)
            or retry_after < 0
        ):
            raise ValueError(f"retry_after must be a number of seconds >= 0, got {retry_after!r}")
        super().__init__(f"{resource} refused the call" + (f"; retry after {retry_after:g} s" if retry_after else ""))
        self.resource = resource
        self.retry_after = float(retry_after) if retry_after else None
