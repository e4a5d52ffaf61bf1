"""Demo tasks: a sleep and a simulated document parse, which write a ledger entry once and
stop when their worker can no longer trust it holds the job (JobContext.check_hold) or
their time is up (JobContext.check_deadline), a no-op, which does nothing at all (what
FairQueue itself costs per job: `bench throughput`), and a call to an upstream on this
machine that backs off when it answers 429 (docs/resources.md, `bench backoff`).

The parse is CPU work, so it runs isolated: in a child process of the worker, killed past
its timeout or its memory limit without harming the worker (fairqueue.jobs.isolation).

The hungry task is the opposite: it grows its worker's own memory, and past the worker's
memory limit (FAIRQUEUE_DEMO_WORKER_MEMORY_MB, standing in for a container's) the whole
worker is SIGKILLed, as the kernel's OOM killer would do. On a lean normal worker it dies
that way; the job then moves to the quarantine lane (fairqueue.jobs.quarantine), whose
workers have the memory, and succeeds there."""

from __future__ import annotations

import hashlib
import os
import signal
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import psutil
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fairqueue.backoff import Backoff
from fairqueue.jobs.models import LedgerEntry
from fairqueue.jobs.registry import JobContext, JoinArgs, fairqueue_task


class SleepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float = Field(ge=0, le=3600)
    echo: Any = None


class NoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HungryArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mb: int = Field(default=300, ge=1, le=2048, description="Memory the task holds at its peak, in MB.")
    hold_seconds: float = Field(default=1.0, ge=0, le=60, description="How long it holds it.")


class ParseArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pages: int = Field(ge=1, le=10_000)
    io_ms_per_page: float = Field(default=20.0, ge=0, le=10_000)


class DocumentArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pages: int = Field(ge=1, le=10_000)
    seconds_per_page: float = Field(default=0.1, ge=0, le=600)
    max_fan_out: int | None = Field(default=None, ge=1, description="Lower than the tenant's max fan-out, if set.")
    fail_pages: list[int] = Field(default_factory=list, max_length=100, description="Pages whose job fails.")


class PageArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    page: int = Field(ge=0)
    seconds: float = Field(default=0.1, ge=0, le=600)
    fail: bool = False


# The demo call reaches only this machine: a task that fetched any URL a tenant names would
# let tenants reach the workers' network.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


class CallArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(
        max_length=500,
        # What _loopback_only accepts, as the OpenAPI document says it (the scheme and host in any case).
        json_schema_extra={
            "pattern": r"^[Hh][Tt][Tt][Pp]://(127\.0\.0\.1|[Ll][Oo][Cc][Aa][Ll][Hh][Oo][Ss][Tt]|\[::1\])(:[0-9]{1,5})?([/?#].*)?$"
        },
    )
    resource: str = Field(min_length=1, max_length=63, description="The resource to back off from on a 429.")
    timeout: float = Field(default=30.0, gt=0, le=300)

    @field_validator("url")
    @classmethod
    def _loopback_only(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname not in LOOPBACK_HOSTS:
            raise ValueError("the demo call reaches only http:// URLs on this machine (127.0.0.1, localhost)")
        return url


def retry_after_seconds(header: str | None) -> float | None:
    """A Retry-After header in seconds (its HTTP-date form is not used by the demo)."""
    try:
        value = float(header) if header else None
    except ValueError:
        return None
    return value if value is not None and 0 <= value <= 3600 else None


# How often a sleeping demo task checks that its worker still holds the job.
HOLD_CHECK_SECONDS = 0.1
# The parse's limits: 10,000 pages at the largest I/O delay would take longer; a job that
# needs that long asks for it by splitting its document.
PARSE_TIMEOUT_SECONDS = 600.0
PARSE_MEMORY_LIMIT_MB = 256.0
HUNGRY_STEP_MB = 16  # the hungry task grows by this much at a time, checking its worker's size between
MIB = 1024 * 1024
PAGE_BYTES = 4096


def ledger_write(ctx: JobContext, task: str) -> None:
    """Record the job's side effect; a re-run (after a worker died) does not write twice,
    and a fenced delivery (its hold lost) does not write at all."""
    ctx.check_hold()
    try:
        with transaction.atomic():
            LedgerEntry.objects.create(job_id=ctx.job_id, task=task)
    except IntegrityError:
        # Already written by an earlier attempt: count it so duplicates are visible, never hidden.
        LedgerEntry.objects.filter(job_id=ctx.job_id).update(writes=F("writes") + 1)


def _now() -> str:
    return datetime.now(UTC).isoformat()


def task_sleep(ctx: JobContext, seconds: float) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        ctx.check_hold()
        ctx.check_deadline()
        time.sleep(min(left, HOLD_CHECK_SECONDS))


@fairqueue_task("demo.sleep", args=SleepArgs)
def demo_sleep(ctx: JobContext, args: SleepArgs) -> dict[str, Any]:
    started = _now()
    task_sleep(ctx, args.seconds)
    ledger_write(ctx, "demo.sleep")
    result: dict[str, Any] = {"started": started, "finished": _now(), "worker": ctx.worker}
    if args.echo is not None:
        result["echo"] = args.echo
    return result


@fairqueue_task("demo.noop", args=NoArgs)
def demo_noop(ctx: JobContext, args: NoArgs) -> None:
    """Nothing: no ledger write, no result."""


@fairqueue_task(
    "demo.parse",
    args=ParseArgs,
    isolated=True,
    timeout_seconds=PARSE_TIMEOUT_SECONDS,
    memory_limit_mb=PARSE_MEMORY_LIMIT_MB,
)
def demo_parse(ctx: JobContext, args: ParseArgs) -> dict[str, Any]:
    started = _now()
    digest = hashlib.sha256()
    words = 0
    for page in range(args.pages):
        ctx.check_hold()
        ctx.check_deadline()
        time.sleep(args.io_ms_per_page / 1000)  # fetching the page
        text = (f"page {page} of job {ctx.job_id} " * 200).encode()
        for _ in range(20):  # tokenising and hashing: real CPU work
            digest.update(text)
        words += len(text.split())
    ledger_write(ctx, "demo.parse")
    return {"started": started, "finished": _now(), "worker": ctx.worker, "words": words, "digest": digest.hexdigest()}


@fairqueue_task("demo.document", args=DocumentArgs)
def demo_document(ctx: JobContext, args: DocumentArgs) -> None:
    """Fan out one demo.page per page and join them (fairqueue.jobs.fanout): this run ends
    as soon as the pages are submitted; demo.document_join's result becomes its own."""
    failing = set(args.fail_pages)
    pages = [{"page": i, "seconds": args.seconds_per_page, "fail": i in failing} for i in range(args.pages)]
    ctx.submit_children("demo.page", pages, then="demo.document_join", max_fan_out=args.max_fan_out)


@fairqueue_task("demo.page", args=PageArgs)
def demo_page(ctx: JobContext, args: PageArgs) -> dict[str, Any]:
    started = _now()
    task_sleep(ctx, args.seconds)
    if args.fail:
        raise RuntimeError(f"page {args.page} failed (asked by the demo)")
    ledger_write(ctx, "demo.page")
    return {"page": args.page, "started": started, "finished": _now()}


@fairqueue_task("demo.document_join", args=JoinArgs)
def demo_document_join(ctx: JobContext, args: JoinArgs) -> dict[str, Any]:
    """The document's continuation: fails if a page did, else counts the pages."""
    if args.failed:
        raise RuntimeError(f"{len(args.failed)} of {len(args.children)} pages failed: {args.failed[:20]}")
    ledger_write(ctx, "demo.document_join")
    return {"pages": len(args.children)}


@fairqueue_task("demo.hungry", args=HungryArgs)
def demo_hungry(ctx: JobContext, args: HungryArgs) -> dict[str, Any]:
    """Hold `mb` MB in the worker itself (not isolated: its memory is the worker's)."""
    started = _now()
    limit_mb = settings.FAIRQUEUE_DEMO_WORKER_MEMORY_MB
    me = psutil.Process()
    held: list[bytearray] = []
    while len(held) * HUNGRY_STEP_MB < args.mb:
        ctx.check_hold()
        chunk = bytearray(HUNGRY_STEP_MB * MIB)
        chunk[::PAGE_BYTES] = b"x" * len(range(0, len(chunk), PAGE_BYTES))  # a byte per page: resident
        held.append(chunk)
        if limit_mb and me.memory_info().rss > limit_mb * MIB:
            # The container's memory limit: the kernel kills the whole worker, at once.
            os.kill(os.getpid(), signal.SIGKILL)
    task_sleep(ctx, args.hold_seconds)
    peak_mb = round(me.memory_info().rss / MIB)
    held.clear()
    ledger_write(ctx, "demo.hungry")
    return {"started": started, "finished": _now(), "worker": ctx.worker, "peak_rss_mb": peak_mb}


def demo_call(ctx: JobContext, args: CallArgs) -> dict[str, Any]:
    """GET the URL; a 429 raises Backoff for the resource (the job waits again, not fails)."""
    ctx.check_hold()
    try:
        with urllib.request.urlopen(args.url, timeout=args.timeout) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        if exc.code == 429:
            raise Backoff(args.resource, retry_after=retry_after_seconds(exc.headers.get("Retry-After"))) from None
        raise
    return {"status": status, "worker": ctx.worker}


if settings.DEMO_MODE:
    fairqueue_task("demo.call", args=CallArgs)(demo_call)
