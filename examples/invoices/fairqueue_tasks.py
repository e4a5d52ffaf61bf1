"""The tasks of the invoices example (docs/tasks.md walks through this file).

FairQueue imports every installed app's `fairqueue_tasks` module at start-up, in the web
process (which validates submissions against the args schema) and in every worker (which
runs the task), so registering is all there is to it.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from pydantic import BaseModel, ConfigDict, Field

from examples.invoices.models import InvoiceSent
from fairqueue.jobs.registry import JobContext, fairqueue_task


class SendInvoiceArgs(BaseModel):
    """What a submit's `args` must be: anything else is a 400 naming the field."""

    model_config = ConfigDict(extra="forbid")
    invoice_number: str = Field(min_length=1, max_length=64, pattern=r"^[A-Z0-9][A-Z0-9-]*$")
    customer_email: str = Field(min_length=3, max_length=254, pattern=r"^[^@\s]+@[^@\s]+$")
    amount_cents: int = Field(gt=0, le=10**12)


@fairqueue_task("invoices.send", args=SendInvoiceArgs)
def send_invoice(ctx: JobContext, args: SendInvoiceArgs) -> dict[str, Any]:
    """Send an invoice once, however often the job runs.

    A job can run more than once (its worker died, or a retry after an error), so the side
    effect is keyed by the invoice number: the unique row is the proof it was sent, and a
    later run finds it and reports it instead of sending again. `check_hold()` just before
    the write stops a delivery that no longer holds the job (a newer one may be running);
    the row records the fencing generation that wrote it.
    """
    ctx.check_hold()
    try:
        with transaction.atomic():
            sent = InvoiceSent.objects.create(
                invoice_number=args.invoice_number,
                customer_email=args.customer_email,
                amount_cents=args.amount_cents,
                job_id=ctx.job_id,
                generation=ctx.generation,
            )
            # A real task sends the email here, inside the transaction: if sending raises,
            # the row is rolled back and the next attempt sends again.
    except IntegrityError:
        sent = InvoiceSent.objects.get(invoice_number=args.invoice_number)
        return {"invoice": sent.invoice_number, "sent": False, "already_sent_by": str(sent.job_id)}
    return {"invoice": sent.invoice_number, "sent": True, "attempt": ctx.attempt, "generation": ctx.generation}
