"""FairQueue: fair, throttled multi-tenant job scheduling on a shared Celery pool.

The Celery application lives in `fairqueue.celery` (`celery -A fairqueue` finds it there).
It is not imported here, so `import fairqueue.engine`, the standalone throttle library,
pulls in neither Celery nor Django. `Backoff`, which tasks raise, imports nothing.
"""

from fairqueue.backoff import Backoff

__all__ = ["Backoff"]
