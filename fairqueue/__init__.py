"""FairQueue: fair, throttled multi-tenant job scheduling on a shared Celery pool.

The in-process API is `fairqueue.submit(tenant, task, args, **options)` and its async twin
`fairqueue.asubmit` (fairqueue.jobs.inprocess). They are looked up on first use, not
imported here, so `import fairqueue.engine`, the standalone throttle library, pulls in
neither Celery nor Django. `Backoff`, which tasks raise, imports nothing.
"""

import importlib
from typing import Any

from fairqueue.backoff import Backoff

__all__ = ["Backoff", "asubmit", "submit"]
_IN_PROCESS = frozenset({"submit", "asubmit"})


def __getattr__(name: str) -> Any:
    if name in _IN_PROCESS:
        # Looked up on first use (PEP 562) to keep the engine's import free of Django.
        return getattr(importlib.import_module("fairqueue.jobs.inprocess"), name)
    raise AttributeError(f"module 'fairqueue' has no attribute {name!r}")
