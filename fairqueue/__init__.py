"""FairQueue: fair, throttled multi-tenant job scheduling on a shared Celery pool."""

from fairqueue.celery import app as celery_app

__all__ = ["celery_app"]
