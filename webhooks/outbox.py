"""Recording a finished job's webhook event in the same transaction as the conditional
status change that finished it (the outbox): the event exists exactly when the change
committed, however the process fares afterwards; the sender (webhooks.sender) delivers it.

Every place a job becomes final goes through `job_finish` (or calls `event_record` inside
its own transaction): execution (succeeded, failed), cancellation, the poison-pill limit
and the hand-back limit (failed).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from django.db import transaction
from django.utils import timezone

from fairqueue.jobs import payloads
from fairqueue.jobs.models import TERMINAL_STATUSES, Job
from fairqueue.mount import job_path
from webhooks.models import WebhookEvent

# A result up to this size travels in the event; a larger one is fetched from the API.
RESULT_INLINE_MAX = 16 * 1024
ERROR_INLINE_MAX = 2000


def webhook_target(job: Job) -> str:
    """Where the job's event goes: its own callback URL, else its tenant's ('' for none)."""
    return job.callback_url or job.tenant.webhook_url


def job_finish(job: Job, *, where: dict[str, Any], fields: dict[str, Any]) -> bool:
    """`Job.objects.filter(**where).update(**fields)`, the compare-and-set that makes `job`
    final; when it wins and the job has a webhook target, its event is written in the same
    transaction. True if it won."""
    if not webhook_target(job):
        return bool(Job.objects.filter(**where).update(**fields))
    with transaction.atomic():
        if not Job.objects.filter(**where).update(**fields):
            return False
        finished = copy.copy(job)
        for name, value in fields.items():
            setattr(finished, name, value)
        event_record(finished)
    return True


def event_record(job: Job) -> WebhookEvent | None:
    """Write the event for `job`, as it is now final; call inside the transaction of the
    change. None when the job has no webhook target."""
    url = webhook_target(job)
    if not url or job.status not in TERMINAL_STATUSES:
        return None
    now = timezone.now()
    event = WebhookEvent(job_id=job.id, tenant_id=job.tenant_id, type=f"job.{job.status}", url=url, created_at=now)
    event.body = json.dumps(event_payload(event, job), separators=(",", ":"), default=str)
    event.next_attempt_at = now
    event.save(force_insert=True)
    return event


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def event_payload(event: WebhookEvent, job: Job) -> dict[str, Any]:
    """The JSON the receiver gets: the event's id and type, and the job as it finished."""
    data: dict[str, Any] = {
        "id": str(job.id),
        "tenant": job.tenant.slug,
        "sub_tenant": job.sub_tenant or None,
        "task": job.task,
        "status": job.status,
        "attempts": job.attempts,
        "submitted_at": _iso(job.submitted_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "error_reason": job.error_reason or None,
        "error": (job.error or "")[:ERROR_INLINE_MAX] or None,
        "url": job_path(job.id),
        "result": None,
        "result_truncated": False,
    }
    if job.result_ref:
        data["result_truncated"] = True  # offloaded: GET the job's url for it
    elif job.result is not None:
        if len(payloads.payload_encode(job.result)) <= RESULT_INLINE_MAX:
            data["result"] = job.result
        else:
            data["result_truncated"] = True
    return {"id": str(event.id), "type": event.type, "created_at": _iso(event.created_at), "job": data}
