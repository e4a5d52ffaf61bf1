"""The durable job record: the database is the truth, Redis only scheduling state."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import models
from django.db.models.functions import Coalesce
from django.db.models.lookups import IsNull
from django.utils import timezone
from django.utils.deconstruct import deconstructible


class JobStatus(models.TextChoices):
    # Waiting for its time (`due_at`), outside the engine and the broker: a delayed job
    # (`run_at` / `delay_seconds`) or one whose attempt failed and will be retried.
    SCHEDULED = "scheduled", "Scheduled"
    RETRYING = "retrying", "Retrying"
    QUEUED = "queued", "Queued"  # accepted; admitted and waiting for a worker, or not yet admitted
    PARKED = "parked", "Parked"  # waiting for a slot on one of its throttle keys
    RUNNING = "running", "Running"
    # Its own run ended after submitting child jobs (fairqueue.jobs.fanout): it holds no
    # slot and waits for its children's join, whose outcome becomes its own.
    AWAITING = "awaiting", "Awaiting children"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


TERMINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
WAITING_STATUSES = frozenset({JobStatus.QUEUED, JobStatus.PARKED})
UNFINISHED_STATUSES = frozenset({JobStatus.QUEUED, JobStatus.PARKED, JobStatus.RUNNING})
# Not finished, and neither in the engine nor in the broker: promoted when due (fairqueue.jobs.due).
DEFERRED_STATUSES = frozenset({JobStatus.SCHEDULED, JobStatus.RETRYING})
# A parent's child with this index is its continuation (the join, fairqueue.jobs.fanout):
# the unique (parent, child_index) makes the join exactly once, as it makes each child.
JOIN_INDEX = -1
# Key names never contain a space (sub-tenant ids are printable ASCII without spaces).
KEY_SEPARATOR = " "


# Partial-index conditions, each the exact filter of the query it serves (PostgreSQL uses a
# partial index only where the query's WHERE implies its condition).
ADMISSION_PENDING = models.Q(status=JobStatus.QUEUED, admitted_at__isnull=True)  # recovery.jobs_admit_pending
BATCH_DUE = models.Q(batch=True, promoted_at__isnull=True, status=JobStatus.PARKED)  # duties.batch_promote_due
PRUNABLE = models.Q(status__in=sorted(TERMINAL_STATUSES), release_pending=False)  # retention.prunable_jobs
RECONCILED = models.Q(status__in=[JobStatus.PARKED, JobStatus.RUNNING]) | models.Q(
    status=JobStatus.QUEUED, admitted_at__isnull=False
)  # recovery.reconcile's candidates
SUB_TENANT_SET = ~models.Q(sub_tenant="")  # selectors.job_list_rows by sub-tenant
# When a waiting job started to wait: its due time if it was delayed or retried, else its
# submit time (the SLO age; batch promotion; the rebuild's order).
WAITING_SINCE = Coalesce("due_at", "submitted_at")


# A deferred job's due time while the due promotion may admit it, else NULL
# (due.due_rows): its index (job_deferred_due) holds only those rows, in the order the
# promotion reads them, so a backlog of due rows is read LIMIT rows at a time with no sort.
# One expression rather than the conditions beside `due_at`: the planner multiplied the
# conditions' selectivities (a few dozen rows for thousands) and chose a sort of them all.
@deconstructible(path="fairqueue.jobs.models.InLiterals")
class InLiterals(models.Func):
    """`column IN ('a', 'b')` with the values written into the SQL rather than passed as
    parameters: SQLite matches an indexed expression only with one spelled the same way,
    and a parameter is not (the values are this module's constants, never user input)."""

    output_field = models.BooleanField()

    def __init__(self, column: str, values: list[str]) -> None:
        super().__init__(models.F(column))
        self.values = list(values)

    def as_sql(self, compiler: Any, connection: Any, **extra_context: Any) -> tuple[str, list[Any]]:  # type: ignore[override]
        sql, params = compiler.compile(self.source_expressions[0])
        literals = ", ".join("'" + str(v).replace("'", "''") + "'" for v in self.values)
        return f"{sql} IN ({literals})", list(params)


DEFERRED_DUE = models.Case(
    models.When(
        models.Q(InLiterals("status", sorted(DEFERRED_STATUSES)), release_pending=False), then=models.F("due_at")
    ),
    default=None,
    output_field=models.DateTimeField(),
)


ERROR_REASON_INDEX = "jobs_job_error_reason_d4639c6c"


class Job(models.Model):
    """One submitted job. `generation` changes on every re-delivery, so stale messages lose."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # No index of its own (nor on status, below): every UPDATE of a row writes an entry into
    # each of the table's indexes (a new row version), and the composite indexes that start
    # with these columns serve their lookups (Meta.indexes; tests/test_query_plans.py).
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="jobs", db_index=False)
    sub_tenant = models.CharField(max_length=200, blank=True, default="")
    task = models.CharField(max_length=100)
    args = models.JSONField(default=dict, blank=True)
    args_ref = models.CharField(max_length=300, blank=True, default="", help_text="Payload store reference.")
    latency_class = models.CharField(max_length=32)
    priority = models.PositiveSmallIntegerField(default=0)
    batch = models.BooleanField(default=False)
    promoted_at = models.DateTimeField(
        null=True, blank=True, help_text="When a batch job was promoted to normal admission to meet its objective."
    )
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    timeout_seconds = models.FloatField(
        null=True, blank=True, help_text="Wall-clock limit asked at submit; the task's own limit applies if lower."
    )
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED)
    attempts = models.PositiveIntegerField(default=0, help_text="Times a worker started this job.")
    worker_losses = models.PositiveIntegerField(default=0, help_text="Times a worker died under this job.")
    generation = models.PositiveIntegerField(default=0)
    # The quarantine lane (fairqueue.jobs.quarantine): set when worker deaths moved the job
    # there; its deliveries then go only to quarantine workers, under the lane's own key.
    quarantined_at = models.DateTimeField(null=True, blank=True, help_text="When worker deaths moved it to quarantine.")
    quarantine_reason = models.CharField(max_length=200, blank=True, default="")
    quarantine_losses = models.PositiveIntegerField(default=0, help_text="Times a worker died under it in quarantine.")
    worker = models.CharField(max_length=200, blank=True, default="")
    # Not auto_now_add: a submit sets it to the time its jobs entered their cells, which
    # happens before the row is written (fairqueue.jobs.quotas).
    submitted_at = models.DateTimeField(default=timezone.now, editable=False, db_index=True)
    admitted_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    result_ref = models.CharField(max_length=300, blank=True, default="")
    error = models.TextField(blank=True, default="")
    error_reason = models.CharField(max_length=32, blank=True, default="")  # indexed in Meta
    # Where this generation was admitted: every later engine call for it (renew, release,
    # cancel, promote) goes there, whatever has been renamed or moved since.
    engine_tag = models.CharField(max_length=100, blank=True, default="", help_text="Engine hash tag.")
    engine_keys = models.CharField(
        max_length=700, blank=True, default="", help_text="Engine key names, space-separated (canonical order)."
    )
    callback_url = models.CharField(
        max_length=2000, blank=True, default="", help_text="This job's own webhook target (else the tenant's)."
    )
    # Outside resources the job calls (tenants.Resource names, space-separated, sorted): each
    # is one more throttle key of its admission (fairqueue.jobs.admission.resource_key).
    resources = models.CharField(
        max_length=300, blank=True, default="", help_text="Outside resources it calls, space-separated."
    )
    # The submit request's W3C trace context (fairqueue.tracing): the job's later spans, in
    # whatever process, join that trace. Empty when tracing was off.
    traceparent = models.CharField(max_length=55, blank=True, default="")
    # One line per lifecycle step, appended with each status change (fairqueue.jobs.timeline).
    timeline = models.TextField(blank=True, default="")
    release_pending = models.BooleanField(
        default=False, help_text="Finished, but the engine could not be told yet: the reconciler frees its slots."
    )
    # Delays and retries (fairqueue.jobs.delays, fairqueue.jobs.retries, fairqueue.jobs.due).
    run_at = models.DateTimeField(null=True, blank=True, help_text="When the submitter asked it to start, if delayed.")
    due_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When it last became (or, scheduled or retrying, becomes) due to enter admission.",
    )
    max_attempts = models.PositiveSmallIntegerField(
        default=1, help_text="Attempts allowed: the task's retry policy, or lower if the submit asked."
    )
    attempt_failures = models.PositiveSmallIntegerField(
        default=0, help_text="Attempts that ended in an error, counted against max_attempts (worker deaths are not)."
    )
    attempt_history = models.JSONField(
        default=list, blank=True, help_text="Each finished attempt: when, how long, and its error if it failed."
    )
    # Fan-out (fairqueue.jobs.fanout): a child job's parent, its index among the parent's
    # children (JOIN_INDEX: the parent's continuation), and its document key's cap (the
    # parent's fan-out limit, passed with every admission of the child). On a parent,
    # `then_task` is its continuation's task ("" for none).
    parent = models.ForeignKey(
        "self", on_delete=models.CASCADE, null=True, blank=True, related_name="children", db_index=False
    )
    child_index = models.IntegerField(null=True, blank=True)
    fan_out_cap = models.PositiveIntegerField(null=True, blank=True, help_text="Children of one parent run at most.")
    then_task = models.CharField(max_length=100, blank=True, default="", help_text="Continuation run at the join.")
    # On a parent: its children not finished yet, as counted down by their ends (each once,
    # after the compare-and-set that finished it). A hint that spares the join's exact check
    # on every child's end but the last; NULL until the parent first submits children.
    children_open = models.IntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-submitted_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"],
                condition=models.Q(idempotency_key__isnull=False),
                name="unique_idempotency_key_per_tenant",
            ),
            # A re-delivered parent never submits a child (or its continuation) twice.
            models.UniqueConstraint(
                fields=["parent", "child_index"],
                condition=models.Q(parent__isnull=False),
                name="unique_child_index_per_parent",
            ),
        ]
        indexes = [
            models.Index(fields=["tenant", "status", "submitted_at"]),
            models.Index(fields=["engine_tag", "status"], name="job_engine_tag_status"),
            models.Index(fields=["status", "finished_at"], name="job_status_finished"),  # retention
            models.Index(
                fields=["release_pending"], condition=models.Q(release_pending=True), name="job_release_pending"
            ),
            # The due promotion reads only the due rows of the deferred statuses, in due order.
            models.Index(
                DEFERRED_DUE,
                models.F("id"),
                name="job_deferred_due",
                condition=models.Q(IsNull(DEFERRED_DUE, False)),  # due.due_rows states it too
            ),
            # The duty tick's queries (fairqueue.jobs.explain_queries checks their plans).
            models.Index(fields=["submitted_at", "id"], condition=ADMISSION_PENDING, name="job_admission_pending"),
            # Batch promotion reads by the time each job became due (WAITING_SINCE).
            models.Index(WAITING_SINCE, condition=BATCH_DUE, name="job_batch_waiting"),
            models.Index(fields=["submitted_at", "id"], condition=RECONCILED, name="job_reconciled"),
            models.Index(fields=["finished_at", "id"], condition=PRUNABLE, name="job_prunable"),
            # The API's list: a tenant's jobs, newest first (and its time range); by status
            # through the first index above; by task and by sub-tenant through these two, the
            # latter only over rows that name one, so a tenant without sub-tenants pays
            # nothing for it (selectors.job_list_rows; explain_queries checks each).
            models.Index(fields=["tenant", "submitted_at", "id"], name="job_tenant_submitted"),
            models.Index(fields=["tenant", "task", "submitted_at", "id"], name="job_tenant_task"),
            models.Index(
                fields=["tenant", "sub_tenant", "submitted_at", "id"],
                condition=SUB_TENANT_SET,
                name="job_tenant_sub_tenant",
            ),
            # A parent's children (the API's list by parent_id, the join's check), in the
            # list's order; only over child rows, so other jobs pay nothing for it.
            models.Index(
                fields=["parent", "submitted_at", "id"], condition=models.Q(parent__isnull=False), name="job_parent"
            ),
            # The admin's filter by reason. The name is the one the field's own index had
            # (migration 0012 keeps that index and drops only its LIKE twin on PostgreSQL).
            models.Index(fields=["error_reason"], name=ERROR_REASON_INDEX),
        ]

    def __str__(self) -> str:
        return f"{self.task} {self.id}"

    @property
    def in_batch_lane(self) -> bool:
        """Batch jobs wait for idle capacity until promoted."""
        return self.batch and self.promoted_at is None

    @property
    def quarantined(self) -> bool:
        """In the quarantine lane: run only by quarantine workers."""
        return self.quarantined_at is not None

    @property
    def engine_key_names(self) -> list[str]:
        return self.engine_keys.split(KEY_SEPARATOR) if self.engine_keys else []

    @property
    def resource_names(self) -> list[str]:
        return self.resources.split(KEY_SEPARATOR) if self.resources else []

    @property
    def document(self) -> str:
        """A child job's document (its parent's id): the key it holds besides its own; ""
        for any other job, a parent's continuation included."""
        if self.parent_id is None or self.child_index is None or self.child_index < 0:
            return ""
        return str(self.parent_id)

    @property
    def engine_id(self) -> str:
        """The engine's name for this delivery: a re-delivered job is a new holder."""
        return f"{self.id}.{self.generation}"


class LedgerEntry(models.Model):
    """Side effects of the demo tasks, keyed by job: proves each job's effect happened once."""

    job_id = models.UUIDField(primary_key=True)
    task = models.CharField(max_length=100)
    written_at = models.DateTimeField(auto_now_add=True)
    writes = models.PositiveIntegerField(default=1)
