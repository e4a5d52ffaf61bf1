"""OpenTelemetry tracing: one trace per job, across the web process, the engine and workers.

Configured from the standard environment variables, read once per process when the jobs
app is ready (web, worker, management commands alike):

- `OTEL_TRACES_EXPORTER`: `otlp` (OTLP over HTTP/protobuf), `console`, or `none`, the
  default; also `in_memory` (FairQueue's own, for benchmarks: spans are made and kept in
  the process, so a run measures making them, not shipping them). Off, nothing of the
  tracing SDK is imported and every helper here returns at its first line: tracing costs
  nothing unless it is asked for.
- `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), `OTEL_SERVICE_NAME`,
  `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`, `OTEL_BSP_*`: read by the SDK itself.

Django's and Celery's own instrumentations make the request span and carry the context
in the broker message's headers. A job's trace is the trace of the request that submitted
it: its W3C `traceparent` is stored on the row (`Job.traceparent`) and rides with its
admission in the engine (`job_carry`), so whatever process admits, wakes, publishes or runs
the job later parents its spans there, and links to the span that caused it (the release
that woke a parked job belongs to another job's trace).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("fairqueue.tracing")

TRACER_NAME = "fairqueue"
DEFAULT_SERVICE_NAME = "fairqueue"
EXPORTERS = ("otlp", "console", "in_memory", "none")

_tracer: trace.Tracer | None = None
_provider: Any = None  # the SDK's TracerProvider while tracing is on
_instrumentors: list[Any] = []
_global_set = False
# Spans of the jobs running in this process, by engine id: the lease renewer (another
# thread, with no span of its own) records its renewals on them.
_job_spans: dict[str, trace.Span] = {}
_job_spans_lock = threading.Lock()


def tracing_enabled() -> bool:
    return _tracer is not None


def tracing_configure(*, exporter: SpanExporter | None = None, service_name: str | None = None) -> bool:
    """Turn tracing on if the environment asks for it (or `exporter` is given: tests and
    benchmarks pass their own, with spans exported synchronously). Returns whether it is on.
    Idempotent: a second call while tracing is on changes nothing."""
    global _tracer, _provider, _global_set
    if _tracer is not None:
        return True
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower() or "none"
    if exporter is None and kind == "none":
        return False
    if exporter is None and kind not in EXPORTERS:
        log.error("OTEL_TRACES_EXPORTER=%r is not one of %s: tracing stays off", kind, ", ".join(EXPORTERS))
        return False
    # The SDK, its exporters and the instrumentations are optional heavy imports: loaded
    # only when tracing is on, so a process with tracing off never imports them.
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    name = service_name or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))  # sampler: OTEL_TRACES_SAMPLER
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif kind == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif kind == "in_memory":
        # Optional heavy import, as above.
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    else:
        # Optional heavy import, as above: the OTLP/HTTP exporter (protobuf, requests).
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if exporter is None and not _global_set:
        # A process configured from its environment shares its provider with any other
        # instrumentation; one given an exporter (a test) keeps it to itself, so it can be
        # turned off again (the global provider can be set only once).
        trace.set_tracer_provider(provider)
        _global_set = True
    django = DjangoInstrumentor()
    django.instrument(tracer_provider=provider)
    celery = CeleryInstrumentor()
    celery.instrument(tracer_provider=provider)
    _instrumentors[:] = [django, celery]
    _provider = provider
    _tracer = provider.get_tracer(TRACER_NAME)
    log.info("tracing on: service %s, exporter %s", name, "given" if exporter is not None else kind)
    return True


def tracing_shutdown() -> None:
    """Flush and turn tracing off (tests; a process exiting flushes by itself)."""
    global _tracer, _provider
    if _tracer is None:
        return
    for instrumentor in _instrumentors:
        instrumentor.uninstrument()
    _instrumentors.clear()
    _tracer = None
    provider, _provider = _provider, None
    provider.shutdown()


def tracing_flush(timeout_ms: int = 5000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)


# --- spans -----------------------------------------------------------------------------


def _context_of(traceparent: str) -> otel_context.Context | None:
    """The context a W3C traceparent names (`00-<trace id>-<span id>-<flags>`), or None."""
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        ctx = trace.SpanContext(
            trace_id=int(parts[1], 16),
            span_id=int(parts[2], 16),
            is_remote=True,
            trace_flags=trace.TraceFlags(int(parts[3][:2], 16)),
        )
    except ValueError:
        return None
    if not ctx.is_valid:
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(ctx))


def _traceparent_of(ctx: trace.SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def traceparent() -> str:
    """The current span as a W3C traceparent ("" when tracing is off or no span is current)."""
    if _tracer is None:
        return ""
    ctx = trace.get_current_span().get_span_context()
    return _traceparent_of(ctx) if ctx.is_valid else ""


def _attributes(attrs: dict[str, Any]) -> dict[str, Any]:
    """`fairqueue.`-prefixed attributes, None dropped (OpenTelemetry refuses it)."""
    return {f"fairqueue.{k}": v for k, v in attrs.items() if v is not None}


def _links(links: Sequence[str]) -> list[trace.Link]:
    out = []
    for tp in links:
        ctx = _context_of(tp) if tp else None
        if ctx is not None:
            out.append(trace.Link(trace.get_current_span(ctx).get_span_context()))
    return out


@contextlib.contextmanager
def _span(name: str, parent: str, links: Sequence[str], attrs: dict[str, Any]) -> Iterator[trace.Span]:
    assert _tracer is not None
    ctx = _context_of(parent) if parent else None
    current = trace.get_current_span().get_span_context()
    if ctx is not None and current.is_valid:
        own = trace.get_current_span(ctx).get_span_context()
        if own.trace_id == current.trace_id:
            ctx = None  # already inside the job's trace: nest under the current span
        else:
            links = [*links, _traceparent_of(current)]  # what made this happen, elsewhere
    with _tracer.start_as_current_span(name, context=ctx, links=_links(links), attributes=_attributes(attrs)) as s:
        yield s


def span(
    name: str, *, parent: str = "", links: Sequence[str] = (), **attrs: Any
) -> contextlib.AbstractContextManager[Any]:
    """A span named `name` around the block, current inside it. `parent` (a traceparent,
    the job's) puts it in that job's trace unless the current span is already there; the
    current span is then linked instead. Attributes get the `fairqueue.` prefix. A no-op
    (yielding None) when tracing is off."""
    if _tracer is None:
        return contextlib.nullcontext()
    return _span(name, parent, links, attrs)


def event(name: str, **attrs: Any) -> None:
    """A lifecycle event on the current span (nothing when tracing is off)."""
    if _tracer is None:
        return
    trace.get_current_span().add_event(name, _attributes(attrs))


def set_attributes(**attrs: Any) -> None:
    """Attributes on the current span, known only once its work is done."""
    if _tracer is None:
        return
    trace.get_current_span().set_attributes(_attributes(attrs))


def span_record(
    name: str,
    *,
    parent: str,
    start_ns: int,
    end_ns: int | None = None,
    links: Sequence[str] = (),
    events: Sequence[tuple[str, dict[str, Any]]] = (),
    **attrs: Any,
) -> None:
    """A span already over (or ending now), in the trace `parent` names: the admission of
    each job of a batched engine call, the wait from a park to the release that ended it."""
    if _tracer is None:
        return
    ctx = _context_of(parent) if parent else None
    s = _tracer.start_span(name, context=ctx, links=_links(links), attributes=_attributes(attrs), start_time=start_ns)
    for event_name, event_attrs in events:
        s.add_event(event_name, _attributes(event_attrs))
    s.end(end_time=end_ns)


@contextlib.contextmanager
def _attached(ctx: otel_context.Context) -> Iterator[None]:
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def within(traceparent_: str) -> contextlib.AbstractContextManager[Any]:
    """Make the span `traceparent_` names current for the block (a publish for a job
    woken by another job's release goes out in the woken job's trace)."""
    if _tracer is None or not traceparent_:
        return contextlib.nullcontext()
    ctx = _context_of(traceparent_)
    if ctx is None:
        return contextlib.nullcontext()
    if trace.get_current_span(ctx).get_span_context().trace_id == trace.get_current_span().get_span_context().trace_id:
        return contextlib.nullcontext()  # already in that trace: keep the nearer parent
    return _attached(ctx)


# --- a job's context through the engine ------------------------------------------------


def job_carry(traceparent_: str) -> str:
    """What rides with a job's admission in the engine's opaque data: its trace and the
    time it was admitted (or parked), so the release that wakes it can draw the wait in
    its trace without reading its row. "" when tracing is off or the job has no trace."""
    if _tracer is None or not traceparent_:
        return ""
    return f"{traceparent_} {time.time_ns()}"


def carry_read(carry: str) -> tuple[str, int | None]:
    """(traceparent, admitted at in ns) from `job_carry`'s string; ("", None) if none."""
    tp, _, at = carry.partition(" ")
    return tp, int(at) if at.isdigit() else None


# --- events from other threads ------------------------------------------------------------


def job_span_hold(engine_id: str) -> None:
    """Remember the current span as the running job's, for events from other threads."""
    if _tracer is None:
        return
    with _job_spans_lock:
        _job_spans[engine_id] = trace.get_current_span()


def job_span_drop(engine_id: str) -> None:
    if _tracer is None:
        return
    with _job_spans_lock:
        _job_spans.pop(engine_id, None)


def job_event(engine_id: str, name: str, **attrs: Any) -> None:
    """An event on a running job's span (the lease renewer's renewals)."""
    if _tracer is None:
        return
    with _job_spans_lock:
        s = _job_spans.get(engine_id)
    if s is not None:
        s.add_event(name, _attributes(attrs))
