"""The side effect of the example task: one row per invoice sent (the "email" it stands for)."""

from __future__ import annotations

from django.db import models


class InvoiceSent(models.Model):
    """The invoice number is the business key: unique, so a second send of the same invoice
    (a re-delivered job, or a customer submitting it twice) cannot write a second row."""

    invoice_number = models.CharField(max_length=64, unique=True)
    customer_email = models.CharField(max_length=254)
    amount_cents = models.PositiveBigIntegerField()
    job_id = models.UUIDField(help_text="The job that sent it.")
    generation = models.PositiveIntegerField(help_text="The job's fencing generation when it sent it.")
    sent_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.invoice_number
