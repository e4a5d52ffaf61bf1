"""The customer REST API, /api/v1/ (django-ninja). Views validate, call a service, shape JSON."""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import redis
from django.core.exceptions import RequestDataTooBig
from django.core.serializers.json import DjangoJSONEncoder
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse
from ninja import Field, Query, Schema, Swagger
from ninja.errors import AuthenticationError, HttpError
from ninja.errors import ValidationError as NinjaValidationError
from ninja.parser import Parser
from ninja.security import HttpBearer
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    TypeAdapter,
    WithJsonSchema,
)

from fairqueue.apiserver import in_api_thread
from fairqueue.jobs import selectors
from fairqueue.jobs.api_schema import TaskAwareNinjaAPI
from fairqueue.jobs.cancellation import job_cancel
from fairqueue.jobs.delays import MAX_DELAY
from fairqueue.jobs.errors import JobError
from fairqueue.jobs.eta import job_eta
from fairqueue.jobs.list_cursor import CURSOR_MAX_LENGTH
from fairqueue.jobs.retry_policy import MAX_ATTEMPTS_LIMIT
from fairqueue.jobs.selectors import LIST_OFFSET_MAX, LIST_TOTAL_MAX
from fairqueue.jobs.submission import IDEMPOTENCY_MAX, MAX_RESOURCES_PER_JOB, JobRequest, job_submit, job_submit_bulk
from fairqueue.jobs.unavailable import DATABASE_RETRY_AFTER_SECONDS, DATABASE_UNAVAILABLE, DATABASE_UNAVAILABLE_MESSAGE
from tenants.authentication import tenant_authenticate_cached, tenant_authenticate_nowait
from tenants.models import Tenant
from webhooks.selectors import job_webhooks

BULK_MAX = 1000


MAX_JSON_DEPTH = 32


def _whole_number(value: Any) -> Any:
    """JSON Schema's integer is any whole number: 3.0 is one, as 3 is (true and "3" are not)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class StrictJSONParser(Parser):
    """JSON only, no NaN/Infinity/1e999 (PostgreSQL's jsonb refuses them), bounded depth, storable strings."""

    def parse_body(self, request: HttpRequest) -> Any:
        content_type = request.headers.get("Content-Type", "")
        if request.body and content_type.split(";")[0].strip().lower() not in ("application/json", ""):
            raise JobError(415, "unsupported_media_type", "Send the body as application/json.")
        value = json.loads(request.body, parse_constant=_reject_constant, parse_float=_finite_float)
        _check_value(value)
        return value


def _reject_constant(name: str) -> Any:
    raise JobError(400, "invalid_json", f"{name} is not valid JSON.")


def _finite_float(text: str) -> float:
    # 1e999 is valid JSON syntax but parses to infinity, which no database JSON column stores.
    number = float(text)
    if not math.isfinite(number):
        raise JobError(400, "invalid_json", f"{text[:20]} is out of range for a JSON number.")
    return number


# NUL and unpaired surrogates: Python accepts them from \u escapes, PostgreSQL text and jsonb do not.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def _check_value(value: Any) -> None:
    """Bounded depth, and only strings a database can store (keys included)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise JobError(400, "invalid_json", f"JSON nested deeper than {MAX_JSON_DEPTH} levels.")
        if isinstance(item, dict):
            for key, v in item.items():
                _check_string(key)
                stack.append((v, depth + 1))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str):
            _check_string(item)


def _check_string(text: str) -> None:
    if _UNSTORABLE.search(text):
        raise JobError(400, "invalid_json", "Strings may not contain NUL (\\u0000) or unpaired surrogates.")


def _active(tenant: Tenant | None) -> Tenant | None:
    if tenant is not None and not tenant.active:
        raise JobError(403, "tenant_inactive", "This tenant is deactivated.")
    return tenant


def _tenant_of_key(token: str) -> Tenant | None:
    return _active(tenant_authenticate_cached(raw_key=token))


class TenantKeyAuth(HttpBearer):
    """Bearer API key -> the Tenant (cached per process: a rotated key or a deactivated tenant
    stops working within a second); an inactive tenant is refused with 403.

    Async, like every view of this API: answered on the event loop when the cache alone
    answers, else the lookup (a Redis read now and then, the database on a cache miss) runs
    off the loop (fairqueue/apiserver.py)."""

    async def authenticate(self, request: HttpRequest, token: str) -> Tenant | None:  # type: ignore[override]
        known, tenant = tenant_authenticate_nowait(raw_key=token)
        if known:
            return _active(tenant)
        return await in_api_thread(_tenant_of_key, token)


api = TaskAwareNinjaAPI(
    submit_model="JobIn",  # the generic body below, described per registered task in the document
    title="FairQueue API",
    version="1",
    urls_namespace="api-v1",
    openapi_url="/openapi.json",
    docs_url="/docs",
    # Swagger UI from ninja's bundled static files ("ninja" in INSTALLED_APPS), and no call
    # to swagger.io's online validator: the docs page makes no request outside this server.
    docs=Swagger(settings={"validatorUrl": None}),
    auth=TenantKeyAuth(),
    parser=StrictJSONParser(),
)


# --- error shape: {"error": {"code", "message", "field"}} ----------------------------------


class ErrorBody(Schema):
    code: str
    message: str
    field: str | None = None


class ErrorOut(Schema):
    error: ErrorBody


def error_response(
    request: HttpRequest, status: int, code: str, message: str, field: str | None = None
) -> HttpResponse:
    return api.create_response(request, {"error": {"code": code, "message": message, "field": field}}, status=status)


@api.exception_handler(JobError)
def _job_error(request: HttpRequest, exc: JobError) -> HttpResponse:
    response = error_response(request, exc.status, exc.code, exc.message, exc.field)
    if exc.retry_after is not None:
        response["Retry-After"] = str(exc.retry_after)
    return response


@api.exception_handler(AuthenticationError)
def _auth_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    response = error_response(request, 401, "unauthorized", "Missing or invalid API key (Authorization: Bearer <key>).")
    response["WWW-Authenticate"] = "Bearer"
    return response


def validation_error(errors: Sequence[Any]) -> JobError:
    """The 400 of a request's first validation error (pydantic's or ninja's), naming its field:
    the REST API's answer, and the in-process API's exception (fairqueue.jobs.inprocess)."""
    first: dict[str, Any] = dict(errors[0]) if errors else {}
    loc = list(first.get("loc", []))
    if loc and loc[0] in ("body", "query", "path", "header", "cookie", "form", "file"):
        loc = loc[1:]
        if loc and loc[0] == "payload":
            loc = loc[1:]
    field = ""
    for part in loc:
        field += f"[{part}]" if isinstance(part, int) else (f".{part}" if field else str(part))
    code = "invalid_args" if loc and loc[0] == "args" else "invalid_request"
    return JobError(400, code, f"{field or 'body'}: {first.get('msg', 'invalid')}.", field or None)


@api.exception_handler(NinjaValidationError)
def _validation_error(request: HttpRequest, exc: NinjaValidationError) -> HttpResponse:
    error = validation_error(exc.errors)
    return error_response(request, error.status, error.code, error.message, error.field)


@api.exception_handler(RequestDataTooBig)
def _too_big(request: HttpRequest, exc: RequestDataTooBig) -> HttpResponse:
    return error_response(request, 413, "payload_too_large", "The request body is larger than the size cap.")


@api.exception_handler(redis.RedisError)
def _redis_down(request: HttpRequest, exc: redis.RedisError) -> HttpResponse:
    # Only reached before anything was written: a process that has never seen the policy
    # cannot validate a job. Once it has, submissions are accepted during an outage.
    response = error_response(request, 503, "unavailable", "The scheduler is briefly unavailable; retry shortly.")
    response["Retry-After"] = "5"
    return response


@api.exception_handler(OperationalError)
@api.exception_handler(InterfaceError)
def _database_down(request: HttpRequest, exc: Exception) -> HttpResponse:
    # The database is the record of every job: without it nothing was accepted (the
    # request's transaction rolled back), and the client retries.
    response = error_response(request, 503, DATABASE_UNAVAILABLE, DATABASE_UNAVAILABLE_MESSAGE)
    response["Retry-After"] = str(DATABASE_RETRY_AFTER_SECONDS)
    return response


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if isinstance(exc.__cause__, JobError):  # raised by StrictJSONParser, wrapped by ninja
        return _job_error(request, exc.__cause__)
    if exc.status_code == 400 and str(exc).startswith("Cannot parse request body"):
        return error_response(request, 400, "invalid_json", "The request body is not valid JSON.")
    return error_response(request, exc.status_code, "http_error", str(exc))


# --- schemas -----------------------------------------------------------------------------------


_DJANGO_JSON = DjangoJSONEncoder()


def _as_rendered(value: datetime) -> Any:
    return _DJANGO_JSON.default(value)


# A time in an answer. In pydantic's JSON mode (the bulk answer, `_jobs_json`) it is written
# as the API's renderer (ninja's, on Django's JSON encoder) writes it everywhere else.
AnswerTime = Annotated[
    datetime,
    PlainSerializer(_as_rendered, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time"}),  # what OpenAPI says of any datetime
]


# The request bodies are plain pydantic models: ninja's Schema reads its input through a
# getter made for ORM objects, and with extra="forbid" validates it twice, which cost a bulk
# of 500 jobs several times the rest of its validation.
class JobIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field(..., min_length=1, max_length=100)
    args: dict[str, Any] = Field(default_factory=dict)
    sub_tenant: str | None = Field(
        None,
        max_length=200,
        description="Your own end-customer's id (printable ASCII, no spaces): throttled on its own.",
        json_schema_extra={"pattern": "^[!-~]*$"},  # submission.SUB_TENANT_RE; "" is none
    )
    priority: str | None = Field(
        None, max_length=32, description='Latency class name; none (or "") for the tenant\'s default class.'
    )
    batch: bool = Field(
        False, description="Run in the batch lane (idle capacity only); only for a tenant opted into it."
    )
    idempotency_key: str | None = Field(None, min_length=1, max_length=IDEMPOTENCY_MAX)
    timeout_seconds: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        strict=True,  # a number, not `true` or "10"
        description="Wall-clock limit for each attempt, in seconds. It may only lower the task's own limit "
        "(a larger value is refused with 400). Past it an isolated task's process is killed; any other task "
        "is asked to stop (JobContext.check_deadline). The attempt then fails with error_reason `timeout`.",
    )
    callback_url: str | None = Field(
        None,
        min_length=1,
        max_length=2000,
        description="Where to POST this job's signed completion event (else the tenant's webhook URL, if any). "
        "A public http(s) URL whose host resolves (checked at submit); private, loopback and link-local addresses "
        "are refused, and the tenant needs a webhook signing secret.",
        json_schema_extra={"format": "uri"},
    )
    resources: list[str] = Field(
        default_factory=list,
        max_length=MAX_RESOURCES_PER_JOB,
        description="Outside resources the job calls (names configured by the operator): each throttles it.",
    )
    run_at: str | None = Field(
        None,
        max_length=64,
        description="Start no earlier than this ISO-8601 time with a UTC offset (e.g. 2030-01-31T09:00:00Z); "
        f"a time past means now; at most {MAX_DELAY.days} days ahead. The job waits `scheduled`, holding "
        "no slot, until then. Not with delay_seconds.",
        json_schema_extra={"format": "date-time"},
    )
    delay_seconds: float | None = Field(
        None,
        strict=True,
        ge=0,
        le=MAX_DELAY.total_seconds(),
        description="Start no earlier than this many seconds from now (see run_at). Not with run_at.",
    )
    # A whole number (_whole_number), its bounds ahead of the validator: set after it (on the
    # field), pydantic writes them into the document as `ge`/`le`, which JSON Schema does not
    # know (a client, or schemathesis, then takes 0 for a valid value).
    max_attempts: (
        Annotated[int, Field(strict=True, ge=1, le=MAX_ATTEMPTS_LIMIT), BeforeValidator(_whole_number)] | None
    ) = Field(
        None,
        description="Lower the task's retry policy to this many attempts in all (1: no retry); "
        "above the task's own max_attempts is refused.",
        # Strict constraints on an annotated int reach the schema as pydantic's own "ge"/"le"
        # keywords, which JSON Schema ignores: said again in its words (numbers only).
        json_schema_extra={"minimum": 1, "maximum": MAX_ATTEMPTS_LIMIT},
    )

    def to_request(self) -> JobRequest:
        return JobRequest(
            task=self.task,
            args=self.args,
            sub_tenant=self.sub_tenant,
            priority=self.priority,
            batch=self.batch,
            idempotency_key=self.idempotency_key,
            timeout_seconds=self.timeout_seconds,
            callback_url=self.callback_url,
            resources=tuple(self.resources),
            run_at=self.run_at,
            delay_seconds=self.delay_seconds,
            max_attempts=self.max_attempts,
        )


class BulkIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jobs: list[JobIn] = Field(..., min_length=1, max_length=BULK_MAX)


class WaitingOn(BaseModel):
    key: str
    lane: Literal["quarantine"] | None = Field(
        None, description="`quarantine`: the job waits for a slot of the quarantine lane (the lane's own cap)."
    )
    limit: int | None
    holders: int
    position: int | None
    document: uuid.UUID | None = Field(
        None,
        description="Set when the key is a document's: the parent job whose fan-out cap this child waits for.",
    )


class ChildrenOut(BaseModel):
    total: int = Field(..., description="Child jobs the job submitted (its continuation not counted).")
    waiting: int = Field(..., description="Not started yet (queued, parked, scheduled or waiting for a retry).")
    running: int
    succeeded: int
    failed: int = Field(..., description="Failed or cancelled.")


class AttemptOut(BaseModel):
    attempt: int = Field(..., description="The job's attempts count when this attempt started (1 for the first).")
    worker: str
    started_at: AnswerTime
    finished_at: AnswerTime
    duration_s: float
    status: Literal["succeeded", "failed"]
    error: str | None = Field(None, description="`Type: message` of the error the attempt raised.")
    error_reason: str | None = None
    retry_at: AnswerTime | None = Field(None, description="When the next attempt was scheduled, if it was retried.")


# A job's answer is a plain pydantic model too (for the same reason as JobIn): the views hand
# it dicts (selectors.job_to_dict), never ORM objects, and a bulk answers 500 of them.
class JobOut(BaseModel):
    id: uuid.UUID
    status: str = Field(
        ...,
        description="scheduled (delayed until run_at), queued, parked, running, retrying (an attempt failed; "
        "the next enters admission at next_attempt_at), awaiting (its run submitted child jobs and ended; "
        "their join decides its outcome), succeeded, failed, cancelled.",
    )
    task: str
    priority: str
    batch: bool
    sub_tenant: str | None
    idempotency_key: str | None
    callback_url: str | None = None
    attempts: int = Field(..., description="Times a worker started this job (worker deaths included).")
    max_attempts: int = Field(..., description="Attempts its retry policy allows (worker deaths do not count).")
    attempt_history: list[AttemptOut] = Field(
        default_factory=list, description="Each attempt that ran to an end: when, how long, and its error."
    )
    run_at: AnswerTime | None = Field(None, description="The start time the submit asked for, if delayed.")
    next_attempt_at: AnswerTime | None = Field(
        None, description="While scheduled or retrying: when it enters admission (waits its turn from then)."
    )
    submitted_at: AnswerTime
    admitted_at: AnswerTime | None
    started_at: AnswerTime | None
    finished_at: AnswerTime | None
    result: Any = None
    error: str | None
    error_reason: str | None = Field(
        None,
        description="Why the job failed: `exception` (the task raised), `timeout` (past its timeout_seconds), "
        "`memory_limit` (an isolated task past its memory limit), `crashed` (an isolated task's process died), "
        "`worker_lost` (workers kept dying under it), `quarantine_failed` (failed from the quarantine lane by an "
        "operator), `unknown_task`.",
    )
    timeout_seconds: float | None = Field(
        None, description="The wall-clock limit each attempt runs under: the task's, or the lower one asked at submit."
    )
    resources: list[str] = Field(default_factory=list, description="Outside resources the job calls.")
    parent_id: uuid.UUID | None = Field(
        None, description="The job that submitted this one as a child (fan-out), or whose continuation it is."
    )
    children: ChildrenOut | None = Field(
        None, description="Set on GET /jobs/{id} of a job that submitted child jobs: their states."
    )
    waiting_on: WaitingOn | None = None
    quarantined: bool = Field(
        False,
        description="In the quarantine lane: workers died under it (quarantine_reason says how often), so it runs "
        "only on quarantine workers, under the lane's own concurrency cap.",
    )
    quarantined_at: AnswerTime | None = Field(None, description="When worker deaths moved it to quarantine.")
    quarantine_reason: str | None = Field(None, description="Why it was moved to quarantine.")
    position: int | None = Field(
        None,
        description="Jobs ahead of this one on the key it waits on, in the scheduler's order (0: next); "
        "0 for a job that holds its slots and waits for a worker. Set on GET /jobs/{id} of a waiting job.",
    )
    eta_seconds: float | None = Field(
        None,
        description="Estimated seconds until it starts: (position + 1) x the tenant's mean job duration / "
        "the slots that key runs at once. Set with position.",
    )


class WebhookDeliveryOut(Schema):
    attempt: int
    started_at: datetime
    finished_at: datetime | None
    duration_ms: int | None
    outcome: Literal["sending", "delivered", "http_error", "timeout", "connection_error", "refused_target", "lost"]
    status_code: int | None
    error: str | None


class WebhookEventOut(Schema):
    id: uuid.UUID = Field(..., description="The event id, the same in every attempt (deduplicate on it).")
    type: str = Field(..., description="job.succeeded, job.failed or job.cancelled.")
    url: str
    state: Literal["pending", "sending", "delivered", "failed"]
    attempts: int
    created_at: datetime
    next_attempt_at: datetime | None = Field(None, description="When a pending event is tried next.")
    delivered_at: datetime | None
    deliveries: list[WebhookDeliveryOut]


class ListTotal(Schema):
    value: int = Field(..., description=f"Jobs that pass the filters, counted up to {LIST_TOTAL_MAX:,}.")
    relation: Literal["eq", "gte"] = Field(
        ..., description="`eq`: exactly `value`; `gte`: at least `value` (the count stopped there)."
    )


class JobListOut(Schema):
    items: list[JobOut]
    limit: int
    has_more: bool = Field(..., description="Whether jobs follow this page (`next` lists them).")
    next: str | None = Field(
        ...,
        description="The `cursor` of the next page (null on the last one). Opaque: pass it back as is, with the "
        "same filters. Paging by cursor neither skips nor repeats a job while jobs are submitted or change status.",
    )
    total: ListTotal | None = Field(None, description="Only with `total=true`.")
    offset: int = Field(..., description="Deprecated: the `offset` asked for.")
    next_offset: int | None = Field(
        ..., description=f"Deprecated: the next page by offset, while it is at most {LIST_OFFSET_MAX:,}; use `next`."
    )


class PoolOut(Schema):
    slots: int
    target: float
    in_flight: int
    batch_in_flight: int
    room: int | None = Field(
        None,
        description="The most jobs the tenant's shard may hold at once: the pool's live slots less what the "
        "other shards hold, so the broker never holds an admitted backlog (null: no worker registered).",
    )
    floor_headroom: int = Field(0, description="Slots kept for tenants below their floor (a pool setting).")
    quarantine_slots: int = Field(
        1, description="Jobs of the quarantine lane that may run at once, across the shards (a pool setting)."
    )
    flood_utilisation: float = Field(
        1.0, description="The headroom's cost: the share of the pool a tenant above its floor can fill."
    )


class ResourceLimitOut(Schema):
    name: str
    limit: int = Field(..., description="The configured limit.")
    effective: int = Field(..., description="Slots it runs at now: backs off on refusals (AIMD), 0 while paused.")
    effective_exact: float = Field(..., description="The AIMD number behind `effective` (increases are fractions).")
    paused_until: datetime | None = Field(None, description="Set while a retry-after pauses new admissions.")
    refusals: int


class QuotasOut(Schema):
    backlog_quota: int = Field(..., description="Most jobs that may wait at once (not batch); past it a submit is 429.")
    waiting: int = Field(..., description="Jobs waiting now (queued or parked), not batch.")
    batch_backlog_quota: int = Field(..., description="Most batch-lane jobs that may wait at once.")
    batch_waiting: int = Field(..., description="Batch-lane jobs waiting now.")
    submit_rate: float = Field(..., description="Jobs per second the tenant may submit (0: no limit).")
    submit_burst: int = Field(..., description="Jobs it may submit at once after a pause (the token bucket's size).")


class LimitsOut(Schema):
    tenant: str
    shard: str
    floor: int
    base: int
    ceiling: float
    pressure_factor: float
    hard_max: int | None
    dedicated: int
    max_fan_out: int = Field(description="Max fan-out per job: children of one parent job running at once.")
    idle_share: int
    fair_share: float | None = Field(
        None, description="Max-min fair share of the pool target; pressure never squeezes the limit below it."
    )
    shard_cap: int | None = Field(
        None,
        description="Where the tenant's shard is full and it wants more than its fair share of the shard: "
        "that share plus its part of the shard's free room (never below the floor).",
    )
    limit: int
    in_flight: int
    parked: int
    parked_by_priority: dict[str, int]
    rate_per_min: float
    mean_job_seconds: float
    pool: PoolOut
    resources: list[ResourceLimitOut] = Field(default_factory=list, description="Every outside resource's limits.")
    quotas: QuotasOut | None = Field(None, description="Backlog quotas and the submission rate (429 past them).")


# --- endpoints ----------------------------------------------------------------------------------


def _errors(*statuses: int) -> dict[int, type[ErrorOut]]:
    """The error statuses an operation can answer, all in the one error shape (documented in OpenAPI).

    415 and 413 come from the body parser, 429 from the quotas (fairqueue.jobs.quotas), 503 from a
    Redis outage (see `_redis_down`).
    """
    return dict.fromkeys(statuses, ErrorOut)


# A submit past the tenant's backlog quota, its submission rate or the memory guard's cap
# (fairqueue.jobs.quotas): nothing was written; retry after the header's seconds.
_TOO_MANY: dict[str, Any] = {
    "description": "Too many jobs: the tenant's backlog quota (`backlog_quota_exceeded`), its submission rate "
    "(`submit_rate_exceeded`) or the scheduler's memory guard (`memory_guard`) refused the request whole; "
    "nothing was written. Retry after `Retry-After` seconds, with backoff and jitter.",
    "headers": {
        "Retry-After": {
            "description": "Seconds until the request may succeed (from the tenant's drain rate or its rate bucket).",
            "schema": {"type": "integer", "minimum": 1},
        }
    },
}

# Operation ids: the names a generated client gives its functions, and what links point at.
SUBMIT_JOB, SUBMIT_JOBS_BULK, LIST_JOBS = "submit_job", "submit_jobs_bulk", "list_jobs"
GET_JOB, CANCEL_JOB, GET_JOB_WEBHOOKS, GET_LIMITS = "get_job", "cancel_job", "get_job_webhooks", "get_limits"


def _links(pointer: str, *operations: str) -> dict[str, Any]:
    """OpenAPI links from the job id at `pointer` in an answer to the operations that take
    it (a client, or a stateful test, follows them)."""
    names = {
        GET_JOB: ("GetJob", "job_id", "This job: its status, place in line and result."),
        CANCEL_JOB: ("CancelJob", "job_id", "Cancel this job."),
        GET_JOB_WEBHOOKS: ("GetJobWebhooks", "job_id", "This job's completion events and their deliveries."),
        LIST_JOBS: ("ListChildren", "parent_id", "The child jobs this job submitted (fan-out)."),
    }
    return {
        names[op][0]: {"operationId": op, "parameters": {names[op][1]: pointer}, "description": names[op][2]}
        for op in operations
    }


_ID = "$response.body#/id"
_JOB_LINKS = _links(_ID, GET_JOB, CANCEL_JOB, GET_JOB_WEBHOOKS, LIST_JOBS)


def _tenant(request: HttpRequest) -> Tenant:
    return request.auth  # type: ignore[attr-defined,no-any-return]


# The views are async: each runs its synchronous part (the service or selector, with its
# database and Redis calls) in one `in_api_thread` call, on the web process's API threads
# rather than a new thread per request (fairqueue/apiserver.py).


def _submit_one(tenant: Tenant, req: JobRequest) -> tuple[int, dict[str, Any]]:
    result = job_submit(tenant=tenant, req=req)
    return (202 if result.created else 200), selectors.job_to_dict(result.job)


_JOBS_OUT = TypeAdapter(list[JobOut])


def _jobs_json(jobs: list[dict[str, Any]]) -> bytes:
    """Jobs answered as ninja answers `list[JobOut]` (validated, then rendered), in one pass
    of pydantic's own JSON writer: ninja's response validation and Django's JSON encoder,
    value by value in Python, were a large part of a bulk's time on the server
    (tests/test_bulk_write.py checks that the two answers agree)."""
    return _JOBS_OUT.dump_json(_JOBS_OUT.validate_python(jobs))


def _submit_many(tenant: Tenant, reqs: list[JobRequest]) -> HttpResponse:
    results = job_submit_bulk(tenant=tenant, reqs=reqs)
    body = _jobs_json([selectors.job_to_dict(r.job) for r in results])
    return HttpResponse(body, status=202, content_type=api.get_content_type())


def _job_with_eta(tenant: Tenant, job_id: str) -> dict[str, Any]:
    job = selectors.job_get(tenant=tenant, job_id=job_id)
    eta = job_eta(job)
    return {**selectors.job_to_dict(job, explain=True), "position": eta.position, "eta_seconds": eta.eta_seconds}


def _job_webhooks(tenant: Tenant, job_id: str) -> list[dict[str, Any]]:
    return job_webhooks(selectors.job_get(tenant=tenant, job_id=job_id))


def _job_cancel(tenant: Tenant, job_id: str) -> dict[str, Any]:
    job = selectors.job_get(tenant=tenant, job_id=job_id)
    return selectors.job_to_dict(job_cancel(job=job))


@api.post(
    "/jobs",
    response={200: JobOut, 202: JobOut, **_errors(400, 401, 403, 413, 415, 429, 503)},
    operation_id=SUBMIT_JOB,
    openapi_extra={"responses": {200: {"links": _JOB_LINKS}, 202: {"links": _JOB_LINKS}, 429: _TOO_MANY}},
)
async def submit_job(request: HttpRequest, payload: JobIn) -> tuple[int, dict[str, Any]]:
    """Submit one job. 202 when accepted; 200 with the original job for a repeated idempotency key."""
    return await in_api_thread(_submit_one, _tenant(request), payload.to_request())


@api.post(
    "/jobs/bulk",
    response={202: list[JobOut], **_errors(400, 401, 403, 413, 415, 429, 503)},
    operation_id=SUBMIT_JOBS_BULK,
    # The first job's id (a bulk answers its jobs in the order submitted).
    openapi_extra={
        "responses": {
            202: {"links": _links("$response.body#/0/id", GET_JOB, CANCEL_JOB, GET_JOB_WEBHOOKS, LIST_JOBS)},
            429: _TOO_MANY,
        }
    },
)
async def submit_jobs_bulk(request: HttpRequest, payload: BulkIn) -> HttpResponse:
    """Submit up to 1,000 jobs at once; all are validated before any is written."""
    return await in_api_thread(_submit_many, _tenant(request), [j.to_request() for j in payload.jobs])


# An RFC 3339 time, as OpenAPI's `date-time` says: pydantic alone would also take a number
# (seconds since the epoch) or a space for the T.
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")


def _rfc3339(value: Any) -> Any:
    if isinstance(value, str) and not _RFC3339.match(value):
        raise ValueError("expected an RFC 3339 time with a UTC offset, such as 2030-01-31T09:00:00Z")
    return value


def _in_utc(value: datetime) -> datetime:
    try:
        # PostgreSQL refuses an offset past 15:59, which RFC 3339 allows.
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("the time is out of range") from None


Rfc3339Time = Annotated[AwareDatetime, BeforeValidator(_rfc3339), AfterValidator(_in_utc)]
# Module-level (ruff B008): the time bounds' query parameters, with their documentation.
SUBMITTED_SINCE = Query(None, description="Only jobs submitted at or after this time (RFC 3339, with a UTC offset).")
SUBMITTED_BEFORE = Query(None, description="Only jobs submitted before this time (RFC 3339, with a UTC offset).")
PARENT_ID = Query(None, description="Only the child jobs of this job (fan-out), its continuation included.")
JobStatusName = Literal[
    "scheduled", "queued", "parked", "running", "retrying", "awaiting", "succeeded", "failed", "cancelled"
]


@api.get(
    "/jobs",
    response={200: JobListOut, **_errors(400, 401, 403)},
    operation_id=LIST_JOBS,
)
async def list_jobs(
    request: HttpRequest,
    status: JobStatusName | None = None,
    task: str | None = Query(None, min_length=1, max_length=100, description="Only jobs of this task."),
    sub_tenant: str | None = Query(None, min_length=1, max_length=200, description="Only jobs of this sub-tenant."),
    parent_id: uuid.UUID | None = PARENT_ID,
    submitted_since: Rfc3339Time | None = SUBMITTED_SINCE,
    submitted_before: Rfc3339Time | None = SUBMITTED_BEFORE,
    limit: int = Query(50, ge=1, le=500),
    cursor: str | None = Query(
        None, max_length=CURSOR_MAX_LENGTH, description="Where to start: the `next` of a previous page."
    ),
    total: bool = Query(
        False, description=f"Also count the jobs that pass the filters, exactly up to {LIST_TOTAL_MAX:,}."
    ),
    offset: int = Query(
        0,
        ge=0,
        le=LIST_OFFSET_MAX,
        deprecated=True,
        description=f"Deprecated: skip this many jobs (at most {LIST_OFFSET_MAX:,}; after `cursor` if given). "
        "Page with `cursor` instead.",
    ),
) -> dict[str, Any]:
    """The calling tenant's jobs, newest first, a page at a time: follow `next` while `has_more`."""
    filters = selectors.JobListFilters(
        status=status,
        task=task,
        sub_tenant=sub_tenant,
        parent_id=parent_id,
        submitted_since=submitted_since,
        submitted_before=submitted_before,
    )
    return await in_api_thread(
        selectors.job_list,
        tenant=_tenant(request),
        filters=filters,
        limit=limit,
        cursor=cursor,
        offset=offset,
        with_total=total,
    )


@api.get("/limits", response={200: LimitsOut, **_errors(401, 403, 503)}, operation_id=GET_LIMITS)
async def get_limits(request: HttpRequest) -> dict[str, Any]:
    """The calling tenant's limit, term by term (floor, base, ceiling, pressure), and its load."""
    return await in_api_thread(selectors.tenant_limits_explain, tenant=_tenant(request))


@api.get(
    "/jobs/{job_id}",
    response={200: JobOut, **_errors(401, 403, 404, 503)},
    operation_id=GET_JOB,
    openapi_extra={"responses": {200: {"links": _links(_ID, CANCEL_JOB, GET_JOB_WEBHOOKS, LIST_JOBS)}}},
)
async def get_job(request: HttpRequest, job_id: str) -> dict[str, Any]:
    return await in_api_thread(_job_with_eta, _tenant(request), job_id)


@api.get(
    "/jobs/{job_id}/webhooks",
    response={200: list[WebhookEventOut], **_errors(401, 403, 404)},
    operation_id=GET_JOB_WEBHOOKS,
)
async def get_job_webhooks(request: HttpRequest, job_id: str) -> list[dict[str, Any]]:
    """The job's completion events and every attempt to deliver them (README, "Webhooks")."""
    return await in_api_thread(_job_webhooks, _tenant(request), job_id)


@api.post(
    "/jobs/{job_id}/cancel",
    response={200: JobOut, **_errors(401, 403, 404, 409, 503)},
    operation_id=CANCEL_JOB,
    openapi_extra={"responses": {200: {"links": _links(_ID, GET_JOB, GET_JOB_WEBHOOKS, LIST_JOBS)}}},
)
async def cancel_job(request: HttpRequest, job_id: str) -> dict[str, Any]:
    return await in_api_thread(_job_cancel, _tenant(request), job_id)


__all__ = ["api"]
