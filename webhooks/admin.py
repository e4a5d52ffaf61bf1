"""Webhooks in the admin: each job's delivery attempts on its page (JobAdmin's inline), and
every event, filterable by state, to find what a receiver did not take."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from webhooks.models import WebhookDelivery, WebhookEvent


class WebhookDeliveryInline(admin.TabularInline):
    """On the job's page: every attempt to deliver its completion event."""

    model = WebhookDelivery
    fk_name = "job"
    fields = ("event", "attempt", "outcome", "status_code", "error", "started_at", "duration")
    readonly_fields = fields
    extra = 0
    can_delete = False
    verbose_name = "webhook delivery"
    verbose_name_plural = "webhook deliveries"

    @admin.display(description="duration")
    def duration(self, obj: WebhookDelivery) -> str:
        ms = obj.duration_ms
        return "-" if ms is None else f"{ms} ms"

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(WebhookEvent)
class WebhookEventAdmin(admin.ModelAdmin):
    list_display = ["id", "type", "tenant", "job", "state", "attempts", "next_attempt_at", "delivered_at"]
    list_filter = ["state", "type", "tenant"]
    search_fields = ["id", "job__id", "url"]
    list_select_related = ["tenant", "job"]
    readonly_fields = [f.name for f in WebhookEvent._meta.fields]
    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # events are written when jobs finish
