"""Reads for the API and the admin: a job's webhook events and their attempts."""

from __future__ import annotations

from typing import Any

from fairqueue.jobs.models import Job
from webhooks.models import WebhookDelivery, WebhookEvent


def job_webhooks(job: Job) -> list[dict[str, Any]]:
    """Every event of `job` (the caller scoped it to a tenant), oldest first, each with its
    attempts: two queries whatever the count."""
    events = list(WebhookEvent.objects.filter(job=job).order_by("created_at"))
    attempts: dict[Any, list[dict[str, Any]]] = {e.id: [] for e in events}
    for d in WebhookDelivery.objects.filter(job=job).order_by("attempt"):
        attempts.setdefault(d.event_id, []).append(
            {
                "attempt": d.attempt,
                "started_at": d.started_at,
                "finished_at": d.finished_at,
                "duration_ms": d.duration_ms,
                "outcome": d.outcome,
                "status_code": d.status_code,
                "error": d.error or None,
            }
        )
    return [
        {
            "id": e.id,
            "type": e.type,
            "url": e.url,
            "state": e.state,
            "attempts": e.attempts,
            "created_at": e.created_at,
            "next_attempt_at": e.next_attempt_at if e.state == "pending" else None,
            "delivered_at": e.delivered_at,
            "deliveries": attempts[e.id],
        }
        for e in events
    ]
