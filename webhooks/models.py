"""The webhook outbox: one event per job that reached a final status (written in the same
transaction as that status), and one delivery row per attempt to send it."""

from __future__ import annotations

import uuid

from django.db import models


class EventState(models.TextChoices):
    PENDING = "pending", "Pending"  # waiting for its next attempt (next_attempt_at)
    SENDING = "sending", "Sending"  # claimed by a sender until claimed_until
    DELIVERED = "delivered", "Delivered"
    FAILED = "failed", "Failed"  # gave up: refused target, or no 2xx within the retry window


class DeliveryOutcome(models.TextChoices):
    SENDING = "sending", "Sending"
    DELIVERED = "delivered", "Delivered (2xx)"
    HTTP_ERROR = "http_error", "Non-2xx answer"
    TIMEOUT = "timeout", "Timed out"
    CONNECTION_ERROR = "connection_error", "Connection failed"
    REFUSED_TARGET = "refused_target", "Target refused (private address or bad URL)"
    LOST = "lost", "Sender lost (its worker stopped mid-send)"


class WebhookEvent(models.Model):
    """What is sent: `id` is the event id the receiver deduplicates on (the same for every
    attempt), `body` the exact JSON bytes signed and sent each time."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="webhook_events")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    type = models.CharField(max_length=32)
    url = models.CharField(max_length=2000)
    body = models.TextField()
    state = models.CharField(max_length=16, choices=EventState.choices, default=EventState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    claimed_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]
        indexes = [models.Index(fields=["state", "next_attempt_at"], name="webhook_event_due")]

    def __str__(self) -> str:
        return f"{self.type} {self.id}"


class WebhookDelivery(models.Model):
    """One attempt to send one event."""

    event = models.ForeignKey(WebhookEvent, on_delete=models.CASCADE, related_name="deliveries")
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="webhook_deliveries")
    attempt = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=20, choices=DeliveryOutcome.choices, default=DeliveryOutcome.SENDING)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True, default="")

    class Meta:
        ordering = ["started_at", "attempt"]
        constraints = [models.UniqueConstraint(fields=["event", "attempt"], name="unique_webhook_attempt")]
        verbose_name_plural = "webhook deliveries"

    def __str__(self) -> str:
        return f"{self.event_id} attempt {self.attempt}"

    @property
    def duration_ms(self) -> int | None:
        if self.finished_at is None:
            return None
        return round((self.finished_at - self.started_at).total_seconds() * 1000)
