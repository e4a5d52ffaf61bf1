"""FairQueue's own Prometheus collector: reads Redis (and one DB aggregate) at scrape time.

Workers increment nothing for these gauges: each scrape reads the same snapshot the
dashboard shows (`dashboard.snapshot.snapshot_build`, without history) plus the fleet-wide
counters and histograms the processes fold into `fq:stats`, cached for CACHE_SECONDS so a
burst of scrapes costs one read. Labels are bounded: tenants come from the current
policy (a deleted tenant's series disappear on the next scrape), cells from the shards
and latency classes in policy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import (
    REGISTRY,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from dashboard.gc_pause import gc_paused
from dashboard.snapshot import snapshot_build
from fairqueue.jobs import stats
from fairqueue.jobs.dependencies import DEPENDENCIES, dependencies_up
from fairqueue.jobs.failure_log import FailureLog
from fairqueue.jobs.task_limits import ATTEMPT_FAILURE_REASONS

log = logging.getLogger("fairqueue.dashboard")
collection_failures = FailureLog(log, "metrics")

CACHE_SECONDS = 1.5
GO_VALUES_KEPT = 10_000  # distinct sample values whose text is kept
FINISHED_STATUSES = ("succeeded", "failed", "cancelled")


def _histogram(name: str, doc: str, cells: dict[str, float], kind: str) -> HistogramMetricFamily:
    """Cumulative buckets from the per-bucket (non-cumulative) cells of the stats hash."""
    buckets: list[tuple[str, float]] = []
    running = 0.0
    for le in stats.LATENCY_BUCKETS:
        running += cells.get(f"{kind}:bucket:{le!r}", 0.0)
        buckets.append((floatToGoString(le), running))
    running += cells.get(f"{kind}:bucket:+Inf", 0.0)
    # The count is the +Inf bucket by definition; keep them equal even mid-flush.
    buckets.append(("+Inf", max(running, cells.get(f"{kind}:count", 0.0))))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=cells.get(f"{kind}:sum", 0.0))


def _capacity_families(capacity: dict[str, Any] | None) -> list[Metric]:
    """The autoscaling signal that anticipates the day (fairqueue.jobs.capacity)."""
    if not capacity:
        return []
    by_class = GaugeMetricFamily(
        "fairqueue_forecast_busy_slots",
        "Most busy slots the demand profile expects within the fleet's warm-up time, per latency class.",
        labels=["class"],
    )
    for cls, busy in sorted(capacity["forecast_busy_by_class"].items()):
        by_class.add_metric([cls], busy)
    return [
        GaugeMetricFamily(
            "fairqueue_slots_desired",
            "Slots the fleet should have: max(slots needed now, slots forecast within the warm-up time).",
            value=capacity["desired"],
        ),
        GaugeMetricFamily(
            "fairqueue_slots_needed_now",
            "Non-batch busy slots at the pool's target utilisation.",
            value=capacity["needed_now"],
        ),
        GaugeMetricFamily(
            "fairqueue_slots_forecast",
            "Slots the forecast asks for within the fleet's warm-up time, at the target utilisation.",
            value=capacity["forecast"],
        ),
        by_class,
    ]


class TenantGaugeFamily(GaugeMetricFamily):
    """A gauge with one sample per tenant, labelled `tenant` only, kept as two columns
    (`tenants`, `values`): `metrics_render` writes it from them (see there), and its
    `samples` are made only when something else reads them (prometheus_client's writers)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: Sequence[str] = ("tenant",),
        *,
        tenants: list[str] | None = None,
        values: list[float] | None = None,
    ) -> None:
        super().__init__(name, documentation, labels=labels)
        self.tenants: list[str] = tenants if tenants is not None else []
        self.values: list[float] = values if values is not None else []

    def add_metric(self, labels: Sequence[str], value: float, timestamp: Any = None) -> None:
        self.tenants.append(labels[0])
        self.values.append(value)

    @property  # type: ignore[override]  # a read of the columns, in Metric's shape
    def samples(self) -> list[Sample]:
        return [Sample(self.name, {"tenant": t}, v) for t, v in zip(self.tenants, self.values, strict=True)]

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        # Metric.__init__ sets an empty list; anything else is kept as columns.
        self.tenants = [s.labels["tenant"] for s in samples]
        self.values = [s.value for s in samples]


def _label_value(value: str) -> str:
    """A label value escaped as the text format wants (slugs never need it)."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


@dataclass(frozen=True)
class _FamilyText:
    """A tenant family as last written: its lines are written again only where a value moved."""

    documentation: str
    tenants: list[str]
    values: list[float]
    all_int: bool  # equal ints write equal text (equal floats may not: -0.0 and 0.0)
    lines: list[str]
    text: str


_family_texts: dict[str, _FamilyText] = {}  # by family name; replaced whole, never changed in place


def tenant_family_text(family: TenantGaugeFamily) -> str:
    """The family as the text format, line for line what generate_latest writes for it.

    Ten thousand tenants make thirty thousand lines a scrape, most of them as they were at
    the last scrape: the family's last text is kept, and only the lines whose tenant's value
    changed are written again (all of them when the tenants or the help text changed)."""
    name, tenants, values = family.name, family.tenants, family.values
    last = _family_texts.get(name)
    if last is not None and last.documentation == family.documentation and last.tenants == tenants:
        if last.all_int and last.values == values:
            return last.text
        lines = list(last.lines)
        for i, (value, then) in enumerate(zip(values, last.values, strict=True)):
            if value != then or type(value) is not int or type(then) is not int:
                lines[i] = _tenant_line(name, tenants[i], value)
    else:
        lines = [_tenant_line(name, tenant, value) for tenant, value in zip(tenants, values, strict=True)]
    doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    text = f"# HELP {name} {doc}\n# TYPE {name} gauge\n" + "".join(lines)
    all_int = all(type(v) is int for v in values)
    _family_texts[name] = _FamilyText(family.documentation, list(tenants), list(values), all_int, lines, text)
    return text


def _tenant_line(name: str, tenant: str, value: float) -> str:
    return f'{name}{{tenant="{_label_value(tenant)}"}} {_go_value(value)}\n'


_int_texts: dict[int, str] = {}  # few distinct values over ten thousand tenants


def _go_value(value: float) -> str:
    if type(value) is not int:
        return str(floatToGoString(value))
    text = _int_texts.get(value)
    if text is None:
        if len(_int_texts) > GO_VALUES_KEPT:
            _int_texts.clear()
        text = _int_texts[value] = floatToGoString(value)
    return text


class _AllButTenantFamilies:
    """A registry's families less the per-tenant ones, which it keeps aside."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.tenant_families: list[TenantGaugeFamily] = []

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if isinstance(family, TenantGaugeFamily):
                self.tenant_families.append(family)
            else:
                yield family


# The per-tenant gauges: the snapshot row's field, which names the metric, and its help.
TENANT_GAUGES = (
    ("in_flight", "Jobs holding a tenant's slots."),
    ("limit", "A tenant's current concurrency limit."),
    ("parked", "A tenant's jobs parked for a slot."),
)


def metrics_build(snapshot: dict[str, Any], cells: dict[str, float]) -> list[Metric]:
    """The metric families for one snapshot and one read of the stats hash."""
    # Three samples per tenant (thirty thousand at ten thousand tenants), kept as columns.
    rows = snapshot["tenants"]
    slugs = [t["slug"] for t in rows]
    per_tenant = [
        TenantGaugeFamily(f"fairqueue_tenant_{field}", documentation, tenants=slugs, values=[t[field] for t in rows])
        for field, documentation in TENANT_GAUGES
    ]
    oldest = GaugeMetricFamily(
        "fairqueue_queue_oldest_wait_seconds",
        "Age of the oldest job not yet started per shard and latency class (0 when none waits).",
        labels=["shard", "class"],
    )
    objective = GaugeMetricFamily(
        "fairqueue_queue_objective_seconds", "Latency objective of the class.", labels=["shard", "class"]
    )
    waiting = GaugeMetricFamily(
        "fairqueue_queue_waiting", "Jobs not yet started per shard and latency class.", labels=["shard", "class"]
    )
    for c in snapshot["cells"]:
        labels = [c["shard"], c["class"]]
        oldest.add_metric(labels, c["oldest_age_s"] or 0.0)
        objective.add_metric(labels, c["objective_s"])
        waiting.add_metric(labels, c["waiting"])
    pool = snapshot["pool"]
    finished = CounterMetricFamily("fairqueue_jobs_finished", "Jobs finished, by final status.", labels=["status"])
    statuses = sorted(set(FINISHED_STATUSES) | {k.split(":", 1)[1] for k in cells if k.startswith("finished:")})
    for status in statuses:
        finished.add_metric([status], cells.get(f"finished:{status}", 0.0))
    attempts_failed = CounterMetricFamily(
        "fairqueue_task_attempts_failed",
        "Task attempts that failed on a worker, by reason (exception, timeout, memory_limit, crashed).",
        labels=["reason"],
    )
    for reason in ATTEMPT_FAILURE_REASONS:
        attempts_failed.add_metric([reason], cells.get(f"attempt_failed:{reason}", 0.0))
    offered = GaugeMetricFamily(
        "fairqueue_worker_offered_slots",
        "Slots a worker offers now (fewer than configured under resource backpressure).",
        labels=["worker"],
    )
    configured = GaugeMetricFamily(
        "fairqueue_worker_configured_slots", "Slots a worker was started with.", labels=["worker"]
    )
    backpressure = GaugeMetricFamily(
        "fairqueue_worker_backpressure",
        "1 while a worker offers fewer slots than configured, labelled with the signal that made it.",
        labels=["worker", "signal"],
    )
    for w in snapshot.get("workers", []):
        offered.add_metric([w["hostname"]], w["slots"])
        configured.add_metric([w["hostname"]], w["capacity"])
        backpressure.add_metric([w["hostname"], w["signal"] or "none"], 1.0 if w["slots"] < w["capacity"] else 0.0)
    families = [
        offered,
        configured,
        backpressure,
        *_capacity_families(snapshot.get("capacity")),
        *_document_families(snapshot.get("documents")),
        *_quarantine_families(snapshot.get("quarantine")),
        *_memory_families(snapshot.get("engine_memory")),
    ]
    return [
        *families,
        *per_tenant,
        oldest,
        objective,
        waiting,
        GaugeMetricFamily("fairqueue_worker_slots", "Worker slots of live workers.", value=pool["slots"]),
        GaugeMetricFamily("fairqueue_worker_slots_busy", "Worker slots running a job.", value=pool["busy"]),
        GaugeMetricFamily(
            "fairqueue_worker_slots_busy_batch", "Worker slots running batch-lane work.", value=pool["busy_batch"]
        ),
        GaugeMetricFamily(
            "fairqueue_slot_utilisation_nonbatch",
            "Busy slots excluding batch work over all slots (the autoscaling signal).",
            value=pool["utilisation"],
        ),
        _histogram("fairqueue_admit_latency_seconds", "Engine admit call latency.", cells, "admit"),
        _histogram("fairqueue_release_latency_seconds", "Engine release call latency.", cells, "release"),
        _histogram(
            "fairqueue_due_lateness_seconds",
            "How long after its due time a delayed or retrying job entered admission.",
            cells,
            "due_lateness",
        ),
        CounterMetricFamily("fairqueue_jobs_submitted", "Jobs accepted.", value=cells.get("submitted", 0.0)),
        CounterMetricFamily(
            "fairqueue_jobs_handed_back",
            "Deliveries a worker gave back because its version cannot run the task (rolling deploys).",
            value=cells.get("handed_back", 0.0),
        ),
        CounterMetricFamily(
            "fairqueue_quarantine_moved",
            "Jobs moved to the quarantine lane after worker deaths under them.",
            value=cells.get("quarantine:moved", 0.0),
        ),
        finished,
        attempts_failed,
    ]


def _document_families(documents: dict[str, Any] | None) -> list[Metric]:
    """Fan-out: a tenant's documents in flight, their children running, and the most any one
    of them runs (its fan-out, bounded by the document's cap)."""
    in_flight = GaugeMetricFamily(
        "fairqueue_tenant_documents_in_flight",
        "A tenant's fan-out parents awaiting their children.",
        labels=["tenant"],
    )
    fan_out = GaugeMetricFamily(
        "fairqueue_tenant_fan_out_running",
        "Child jobs of a tenant's documents in flight that hold their document's key now.",
        labels=["tenant"],
    )
    fan_out_max = GaugeMetricFamily(
        "fairqueue_tenant_fan_out_max",
        "The most child jobs any one of a tenant's documents runs now.",
        labels=["tenant"],
    )
    for slug, row in sorted(((documents or {}).get("tenants") or {}).items()):
        in_flight.add_metric([slug], row["documents"])
        fan_out.add_metric([slug], row["running"])
        fan_out_max.add_metric([slug], row["max_running"])
    total = GaugeMetricFamily(
        "fairqueue_documents_in_flight",
        "Fan-out parents awaiting their children, fleet-wide.",
        value=(documents or {}).get("in_flight", 0),
    )
    return [in_flight, fan_out, fan_out_max, total]


def _quarantine_families(lane: dict[str, Any] | None) -> list[Metric]:
    """The quarantine lane (fairqueue.jobs.quarantine): its cap, its jobs and its oldest wait."""
    if lane is None:
        return []
    return [
        GaugeMetricFamily("fairqueue_quarantine_slots", "Quarantined jobs that may run at once.", value=lane["slots"]),
        GaugeMetricFamily(
            "fairqueue_quarantine_running",
            "Quarantined jobs holding a lane slot (running, or on their way to a quarantine worker).",
            value=lane["running"],
        ),
        GaugeMetricFamily("fairqueue_quarantine_waiting", "Quarantined jobs not yet started.", value=lane["waiting"]),
        GaugeMetricFamily(
            "fairqueue_quarantine_oldest_wait_seconds",
            "Age of the oldest quarantined job not yet started (0 when none waits).",
            value=lane["oldest_wait_s"] or 0.0,
        ),
        GaugeMetricFamily(
            "fairqueue_quarantine_workers",
            "Live quarantine workers (alert when jobs wait in the lane and this is 0).",
            value=lane["workers"],
        ),
        GaugeMetricFamily(
            "fairqueue_quarantine_worker_slots", "Slots of the live quarantine workers.", value=lane["worker_slots"]
        ),
    ]


def _memory_families(memory: dict[str, Any] | None) -> list[Metric]:
    """The engine Redis's memory and the memory guard (fairqueue.jobs.memory_guard)."""
    if not memory:
        return []
    families: list[Metric] = [
        GaugeMetricFamily(
            "fairqueue_engine_memory_used_bytes", "Memory the engine Redis uses.", value=memory["used_bytes"]
        ),
        GaugeMetricFamily(
            "fairqueue_engine_memory_max_bytes", "The engine Redis's maxmemory (0: none).", value=memory["max_bytes"]
        ),
        GaugeMetricFamily(
            "fairqueue_memory_guard_active",
            "1 while the memory guard refuses new waiting jobs of the largest backlogs.",
            value=1.0 if memory["guard_active"] else 0.0,
        ),
    ]
    if memory["headroom_bytes"] is not None:
        families.append(
            GaugeMetricFamily(
                "fairqueue_engine_memory_headroom_bytes",
                "Bytes left before the memory guard starts refusing.",
                value=memory["headroom_bytes"],
            )
        )
    if memory["guard_cap"] is not None:
        families.append(
            GaugeMetricFamily(
                "fairqueue_memory_guard_cap",
                "The most jobs a tenant may have waiting while the memory guard is on.",
                value=memory["guard_cap"],
            )
        )
    return families


def dependency_family(up: dict[str, bool]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "fairqueue_dependency_up",
        "1 if the dependency (database, engine Redis, broker, channel layer) answers this process now, else 0.",
        labels=["dependency"],
    )
    for name in DEPENDENCIES:
        family.add_metric([name], 1.0 if up.get(name) else 0.0)
    return family


class FairQueueCollector:
    """Registered once on the default registry (see DashboardConfig.ready)."""

    def __init__(self, cache_seconds: float = CACHE_SECONDS) -> None:
        self.cache_seconds = cache_seconds
        self._lock = threading.Lock()
        self._cached: list[Metric] = []
        self._at = float("-inf")

    def describe(self) -> list[Metric]:
        # Present so registering does not call collect() (which reads Redis) at startup.
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            if time.monotonic() - self._at >= self.cache_seconds:
                try:
                    with gc_paused():
                        self._cached = metrics_build(snapshot_build(with_history=False), stats.stats_read())
                except Exception as exc:
                    # A scrape must not fail because Redis blinked; report what is known.
                    collection_failures.failed("collection", exc)
                    self._cached = []
                else:
                    collection_failures.succeeded("collection")
                self._cached.append(dependency_family(dependencies_up()))
                self._at = time.monotonic()
            yield from self._cached

    def invalidate(self) -> None:
        """Forget the cache (tests)."""
        with self._lock:
            self._at = float("-inf")


_collector: FairQueueCollector | None = None
_register_lock = threading.Lock()


def collector_register() -> FairQueueCollector:
    """Register the collector on the default registry exactly once per process."""
    global _collector
    with _register_lock:
        if _collector is None:
            _collector = FairQueueCollector()
            REGISTRY.register(_collector)
        return _collector


def scrape_registry(multiprocess_dir: str) -> CollectorRegistry:
    """What `/metrics` exposes. One process: its default registry (django-prometheus's
    request metrics and FairQueue's collector). Under the production server's several
    worker processes (`multiprocess_dir`, PROMETHEUS_MULTIPROC_DIR, set by gunicorn.conf.py)
    a scrape reaches any one of them, so django-prometheus's counters are summed over all
    workers from their files, and FairQueue's collector, which reads Redis and is the same
    from any process, is added as it is."""
    if not multiprocess_dir:
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)
    registry.register(collector_register())
    return registry


def metrics_render(registry: CollectorRegistry) -> bytes:
    """The registry as Prometheus text (what `/metrics` answers), without the cyclic
    collector's passes over the samples being made (dashboard.gc_pause). The per-tenant
    families (three samples per tenant, thirty thousand at ten thousand tenants) are
    written here, after the rest: generate_latest validates and escapes every label name
    and sorts every sample's labels, several microseconds a sample, for a family whose one
    label name is fixed and whose values are slugs."""
    rest = _AllButTenantFamilies(registry)
    with gc_paused():
        text = generate_latest(rest)  # type: ignore[arg-type]  # any object with collect() will do
        return text + "".join(tenant_family_text(f) for f in rest.tenant_families).encode()
