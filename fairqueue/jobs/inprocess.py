"""The in-process API: submit a job from code inside the project (a view, a signal handler,
a management command) as `POST /api/v1/jobs` would, without HTTP or an API key.

    import fairqueue
    job = fairqueue.submit("acme", "invoices.render", {"invoice_id": 7}, priority="high")
    job = await fairqueue.asubmit(tenant, "invoices.render", {"invoice_id": 7}, delay_seconds=60)

The options are the REST body's fields (sub_tenant, priority, batch, idempotency_key,
timeout_seconds, callback_url, resources, run_at, delay_seconds, max_attempts), validated by
the same schema and then by the same service, so the same input gives the same job or the
same error: a `JobError` with the REST answer's status, code, message and field.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from pydantic import ValidationError

from fairqueue.jobs.api import JobIn, validation_error
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.models import Job
from fairqueue.jobs.submission import job_submit
from tenants.models import Tenant


def _tenant_active(tenant: Tenant | str) -> Tenant:
    """The tenant (or the one with this slug), refused as the REST API refuses its key."""
    if isinstance(tenant, str):
        found = Tenant.objects.filter(slug=tenant).first()
        if found is None:
            raise JobError(404, "tenant_not_found", f"No tenant with the slug {tenant!r}.", "tenant")
        tenant = found
    if not tenant.active:
        raise JobError(403, "tenant_inactive", "This tenant is deactivated.")
    return tenant


def submit(tenant: Tenant | str, task: str, args: dict[str, Any] | None = None, **options: Any) -> Job:
    """Submit one job for `tenant` (a Tenant or its slug) and return it: a new job, or the
    one already submitted with the same `idempotency_key`. Raises JobError."""
    tenant = _tenant_active(tenant)
    try:
        body = JobIn.model_validate({"task": task, "args": {} if args is None else args, **options})
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    return job_submit(tenant=tenant, req=body.to_request()).job


async def asubmit(tenant: Tenant | str, task: str, args: dict[str, Any] | None = None, **options: Any) -> Job:
    """`submit` for async code (an async view, a consumer): the same, in Django's thread for
    synchronous database work (sync_to_async's thread-sensitive default)."""
    return await sync_to_async(submit)(tenant, task, args, **options)
