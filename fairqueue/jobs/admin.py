"""Jobs in the admin: find any job by tenant, status or failure reason; retry failed ones;
list the quarantine lane and send a job back to the normal lane or fail it."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import F, QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from fairqueue.jobs import timeline as tl
from fairqueue.jobs.dispatch import jobs_admit
from fairqueue.jobs.eta import job_eta
from fairqueue.jobs.explain import seconds_text
from fairqueue.jobs.models import TERMINAL_STATUSES, Job, JobStatus, LedgerEntry
from fairqueue.jobs.quarantine_actions import jobs_quarantine_fail, jobs_quarantine_send_back
from webhooks.admin import WebhookDeliveryInline


class QuarantineFilter(admin.SimpleListFilter):
    """The quarantine lane: unfinished jobs in it (the operators' list), or every job ever
    moved there."""

    title = "quarantine lane"
    parameter_name = "quarantined"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin[Job]) -> list[tuple[str, str]]:
        return [("yes", "In quarantine now"), ("ever", "Ever quarantined")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        if self.value() == "yes":
            return queryset.filter(quarantined_at__isnull=False).exclude(status__in=sorted(TERMINAL_STATUSES))
        if self.value() == "ever":
            return queryset.filter(quarantined_at__isnull=False)
        return queryset


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "tenant",
        "task",
        "status",
        "latency_class",
        "batch",
        "sub_tenant",
        "attempts",
        "worker_losses",
        "quarantined_at",
        "error_reason",
        "submitted_at",
        "started_at",
        "finished_at",
    )
    list_filter = ("status", QuarantineFilter, "error_reason", "latency_class", "batch", "tenant")
    search_fields = ("id", "idempotency_key", "sub_tenant", "task")
    date_hierarchy = "submitted_at"
    list_select_related = ("tenant",)
    readonly_fields = [f.name for f in Job._meta.fields if f.name != "timeline"] + [
        "place_in_line",
        "attempts_table",
        "lifecycle",
    ]
    actions = ["retry_jobs", "quarantine_send_back", "quarantine_fail"]
    inlines = [WebhookDeliveryInline]
    show_full_result_count = False

    @admin.display(description="place in line")
    def place_in_line(self, job: Job) -> str:
        """The job's position and ETA (fairqueue.jobs.eta), as the API gives them."""
        eta = job_eta(job)
        if eta.position is None or eta.eta_seconds is None:
            return "-"
        if eta.key is None:
            return "holds its slots; starts when a worker takes it"
        ahead = "next" if eta.position == 0 else f"{eta.position:,} job{'s' if eta.position != 1 else ''} ahead of it"
        return (
            f"{ahead} on {eta.key} (limit {eta.limit}, {eta.holders} holding it, mean job {eta.mean_seconds:g} s); "
            f"starts in about {seconds_text(eta.eta_seconds)}"
        )

    @admin.display(description="attempts, one by one")
    def attempts_table(self, job: Job) -> SafeString | str:
        """Each attempt's time, duration, worker and error (attempt_history), newest last."""
        history = job.attempt_history or []
        if not history:
            return "-"
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{} s</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    a.get("attempt"),
                    a.get("started_at"),
                    a.get("duration_s"),
                    a.get("worker"),
                    a.get("status"),
                    a.get("error") or "",
                    a.get("retry_at") or "",
                )
                for a in history
            ),
        )
        head = "".join(
            f"<th>{title}</th>" for title in ("#", "started", "took", "worker", "outcome", "error", "retry at")
        )
        return format_html('<table class="attempts"><tr>{}</tr>{}</table>', SafeString(head), rows)

    @admin.display(description="timeline")
    def lifecycle(self, job: Job) -> str:
        """The job's lifecycle from its own row (fairqueue.jobs.timeline): each step, when,
        and how long after the submit; no tracing backend needed."""
        steps = tl.steps(job.timeline)
        if not steps:
            return "-"
        first = steps[0].at
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>+{} s</td><td>{}</td></tr>",
            (
                (
                    s.event,
                    s.at.isoformat(sep=" ", timespec="milliseconds"),
                    f"{(s.at - first).total_seconds():.3f}",
                    s.detail,
                )
                for s in steps
            ),
        )
        return format_html('<table class="fq-timeline"><tbody>{}</tbody></table>', rows)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # jobs enter through the API, where they are validated and admitted

    @admin.action(description="Retry selected failed jobs")
    def retry_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        failed = list(queryset.filter(status=JobStatus.FAILED).values_list("id", flat=True))
        Job.objects.filter(id__in=failed, status=JobStatus.FAILED).update(
            status=JobStatus.QUEUED,
            generation=F("generation") + 1,
            worker_losses=0,
            quarantine_losses=0,  # a quarantined job stays in the lane, with its deaths there forgiven
            attempt_failures=0,  # a fresh attempt budget; attempt_history keeps the past ones
            error="",
            error_reason="",
            admitted_at=None,
            started_at=None,
            finished_at=None,
            timeline=tl.appended(tl.line(tl.REQUEUED, "retried by an operator")),
        )
        jobs_admit(list(Job.objects.filter(id__in=failed).select_related("tenant")), enter_cells=True)
        self.message_user(request, f"Re-queued {len(failed)} failed job(s).", messages.SUCCESS)

    @admin.action(description="Send selected quarantined jobs back to the normal lane")
    def quarantine_send_back(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        moved = jobs_quarantine_send_back(queryset.filter(quarantined_at__isnull=False))
        self.message_user(
            request,
            f"Sent {moved} job(s) back to the normal lane (only quarantined jobs not running are moved).",
            messages.SUCCESS,
        )

    @admin.action(description="Fail selected quarantined jobs")
    def quarantine_fail(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        failed = jobs_quarantine_fail(queryset.filter(quarantined_at__isnull=False))
        self.message_user(
            request, f"Failed {failed} quarantined job(s) (only jobs not running are failed).", messages.SUCCESS
        )


@admin.register(LedgerEntry)
class LedgerEntryAdmin(admin.ModelAdmin):
    list_display = ("job_id", "task", "writes", "written_at")
    list_filter = ("task",)
    readonly_fields = ("job_id", "task", "writes", "written_at")
