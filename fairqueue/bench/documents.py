"""`manage.py bench noisy --documents`: fan-out on the real stack (fairqueue.jobs.fanout).

One tenant (``noisy``) sends DOCS large documents of PAGES pages at once; the other
tenants (``quiet-N``) keep sending one-page documents. Three modes, each on a fresh stack
(as `bench noisy`'s: a new SQLite file, the bench's flushed Redis database, new worker
processes):

- ``fifo``: plain Celery. A document is its pages, each one `send_task` of the plain
  sleep to the single queue ``fq.jobs``, all sent at the document's submit.
- ``long``: FairQueue, one long job per document (`demo.sleep` of pages x page seconds):
  no fan-out, no parallelism within a document.
- ``fanout``: FairQueue, `demo.document`: the document's job fans out one `demo.page` per
  page under its document key (capped at the tenant's max fan-out per job) and joins.

Definitions (wall-clock unix seconds on one host):

- a document's end-to-end time = its end - its submit. fifo: its last page's finish (no
  join runs); long: the job's finish; fanout: the parent's finish (its join's end).
- utilisation = busy slot-seconds (page or job bodies) inside backlog periods / (slots x
  backlog seconds), as `bench noisy` defines it, over the page runs.
- peak concurrency of a document = the most of its pages running at once (by the pages'
  own clocks); a long job is one.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from fairqueue.bench import stack
from fairqueue.bench.noisy import (
    FIFO_QUEUE,
    NOISY_SLUG,
    QUIET_PREFIX,
    SHARD_CAPACITY,
    SHARD_NAME,
    Log,
    backlog_utilisation,
    percentile,
)

MODES = ("fifo", "long", "fanout")
# The small documents' P99 end-to-end time under fan-out must beat FIFO's this many times.
TARGET_VS_FIFO = 20.0


@dataclass(frozen=True)
class DocWorkload:
    workers: int = 4
    slots_per_worker: int = 4
    quiet_tenants: int = 4
    quiet_docs_per_s: float = 1.0  # per quiet tenant, evenly spaced
    # Every page's run time: long enough that FairQueue's per-job work (a few database
    # writes, two engine calls) leaves the pool's slots busy on a two-core machine.
    page_s: float = 0.5
    large_docs: int = 20
    large_pages: int = 100
    warmup_s: float = 2.0  # one-page documents before the large ones
    steady_s: float = 20.0  # how long the quiet tenants keep sending
    fan_out: int = 10  # the tenants' max fan-out per job

    @property
    def slots(self) -> int:
        return self.workers * self.slots_per_worker


PRESETS: dict[str, DocWorkload] = {
    "default": DocWorkload(),
    "quick": DocWorkload(large_docs=10, large_pages=60, page_s=0.3, steady_s=8.0),
    "smoke": DocWorkload(
        workers=1, quiet_tenants=2, large_docs=3, large_pages=12, page_s=0.05, warmup_s=0.5, steady_s=3.0, fan_out=2
    ),
}


@dataclass(frozen=True)
class PlannedDoc:
    at: float
    tenant: str
    pages: int


def doc_plan(w: DocWorkload) -> list[PlannedDoc]:
    plan = [
        PlannedDoc(at=round(k / w.quiet_docs_per_s + i * 0.1, 3), tenant=f"{QUIET_PREFIX}{i + 1}", pages=1)
        for i in range(w.quiet_tenants)
        for k in range(int(w.steady_s * w.quiet_docs_per_s))
    ]
    plan += [PlannedDoc(at=w.warmup_s, tenant=NOISY_SLUG, pages=w.large_pages) for _ in range(w.large_docs)]
    return sorted(plan, key=lambda d: (d.at, d.tenant))


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def doc_metrics(docs: list[dict[str, Any]], runs: list[dict[str, Any]], *, slots: int) -> dict[str, Any]:
    """`docs`: {tenant, submitted, finished, ok}; `runs`: every page (or long job) run as
    {doc, submitted, started, run_started, run_finished}."""
    small = [d["finished"] - d["submitted"] for d in docs if d["tenant"] != NOISY_SLUG]
    large = [d for d in docs if d["tenant"] == NOISY_SLUG]
    by_doc: dict[str, list[tuple[float, float]]] = {}
    for r in runs:
        by_doc.setdefault(r["doc"], []).append((r["run_started"], r["run_finished"]))
    util, backlog_s = backlog_utilisation(runs, slots)

    def rnd(x: float | None, n: int = 4) -> float | None:
        return None if x is None else round(x, n)

    return {
        "small_p50_s": rnd(percentile(small, 50)),
        "small_p99_s": rnd(percentile(small, 99)),
        "large_makespan_s": rnd(
            max(d["finished"] for d in large) - min(d["submitted"] for d in large) if large else None, 3
        ),
        "peak_document_concurrency": max((peak_overlap(v) for v in by_doc.values()), default=0),
        "utilization": rnd(util),
        "backlog_s": round(backlog_s, 3),
        "documents": len(docs),
        "small_documents": len(small),
        "runs": len(runs),
        "failed": sum(1 for d in docs if not d["ok"]),
    }


def targets_check(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    fan, fifo, long = (modes.get(m, {}).get("small_p99_s") for m in ("fanout", "fifo", "long"))
    ratio = round(fifo / fan, 2) if fan and fifo else None
    vs_long = round(long / fan, 2) if fan and long else None
    return {
        "small_p99_vs_fifo": {
            "target": f">= {TARGET_VS_FIFO:g}x better than fifo",
            "ratio": ratio,
            "met": None if ratio is None else ratio >= TARGET_VS_FIFO,
        },
        "small_p99_vs_long": {"target": "informational", "ratio": vs_long, "met": None},
    }


def run_command(options: dict[str, Any], *, log: Log) -> dict[str, Any]:
    preset = "smoke" if options["smoke"] else "quick" if options["quick"] else "default"
    chosen = options.get("modes") or ",".join(MODES)
    modes = [m.strip() for m in chosen.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise RuntimeError(f"unknown modes {unknown} for --documents; choose from {list(MODES)}")
    w = PRESETS[preset]
    if options.get("workers"):
        w = replace(w, workers=options["workers"])
    if options.get("slots_per_worker"):
        w = replace(w, slots_per_worker=options["slots_per_worker"])
    return run(
        redis_url=options["redis_url"],
        preset=preset,
        workload=w,
        modes=modes,
        force=options["force"],
        database_url=options.get("database_url"),
        log=log,
    )


def run(
    *,
    redis_url: str,
    preset: str,
    workload: DocWorkload,
    modes: list[str],
    force: bool,
    database_url: str | None = None,
    log: Log = print,
) -> dict[str, Any]:
    """Every mode on a fresh stack: a copy of one migrated SQLite file, or (`database_url`,
    a PostgreSQL server) a fresh database fq_bench_documents_<mode> there."""
    stack.redis_db_prepare(redis_url, force=force)
    work_dir = stack.BENCH_DIR
    work_dir.mkdir(parents=True, exist_ok=True)
    template = work_dir / "documents-template.sqlite3"
    started = time.monotonic()
    log(f"bench noisy --documents ({preset}): {workload.workers} workers x {workload.slots_per_worker} slots")
    if database_url is None:
        stack.fresh_database(template, stack.stack_env(redis_url=redis_url, db_path=template))
    results: dict[str, dict[str, Any]] = {}
    try:
        for mode in modes:
            t0 = time.monotonic()
            stack.redis_db_flush(redis_url)
            db_path = work_dir / f"documents-{mode}.sqlite3"
            if database_url is None:
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{db_path}{suffix}").unlink(missing_ok=True)
                db_path.write_bytes(template.read_bytes())
                env = stack.stack_env(redis_url=redis_url, db_path=db_path)
            else:
                mode_url = stack.fresh_postgres(database_url, f"fq_bench_documents_{mode}")
                env = stack.stack_env(redis_url=redis_url, db_path=db_path, database_url=mode_url)
                stack.migrate(env)
            with tempfile.TemporaryDirectory() as tmp:
                spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
                spec.write_text(json.dumps({"mode": mode, "workload": asdict(workload)}))
                stack.run_child(
                    "fairqueue.bench.documents", ["--child", str(spec), str(out)], env=env, timeout=_timeout(workload)
                )
                child = json.loads(out.read_text())
            results[mode] = doc_metrics(child["docs"], child["runs"], slots=workload.slots)
            log(f"  {mode:<7} {len(child['docs'])} documents in {time.monotonic() - t0:.1f}s")
    finally:
        stack.redis_db_flush(redis_url)
    doc: dict[str, Any] = {
        "modes": results,
        "workload": {**asdict(workload), "preset": preset, "slots": workload.slots},
        "database": "postgresql" if database_url else "sqlite",
        "definitions": {
            "end_to_end": "document end - document submit (fifo: last page's finish; long: the job's; "
            "fanout: the parent's, after its join)",
            "utilization": "busy slot-seconds of page (or job) bodies inside backlog periods / (slots x backlog "
            "seconds), as bench noisy's",
            "peak_document_concurrency": "the most pages of one document running at once (their own clocks)",
        },
        "targets": targets_check(results),
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    doc["all_targets_met"] = all(t["met"] for t in doc["targets"].values() if t["target"] != "informational")
    for mode, f in results.items():
        log(
            f"  {mode:<7} small docs p50 {f['small_p50_s']}s p99 {f['small_p99_s']}s, large makespan "
            f"{f['large_makespan_s']}s, peak per document {f['peak_document_concurrency']}, "
            f"utilisation {f['utilization']}"
        )
    for name, t in doc["targets"].items():
        log(f"  {name}: {t['ratio']}x ({t['target']}) {'met' if t['met'] else '' if t['met'] is None else 'NOT met'}")
    return doc


def _timeout(w: DocWorkload) -> float:
    work = w.large_docs * w.large_pages * w.page_s + w.quiet_tenants * w.steady_s * w.quiet_docs_per_s * w.page_s
    return 120 + w.steady_s + 4 * work / max(w.slots // 2, 1)


# --- the child: one mode on its own stack ------------------------------------------------------


def _policy_setup(w: DocWorkload) -> dict[str, Any]:
    # Django's models exist only after django.setup() in the child (child_main): imported here.
    from tenants.models import Shard, Tenant
    from tenants.sync import policy_sync_all

    shard = Shard.objects.create(name=SHARD_NAME, capacity=SHARD_CAPACITY)
    tenants = {}
    for slug in [f"{QUIET_PREFIX}{i + 1}" for i in range(w.quiet_tenants)] + [NOISY_SLUG]:
        tenants[slug] = Tenant.objects.create(slug=slug, name=slug, shard=shard, max_fan_out=w.fan_out)
    policy_sync_all()
    return tenants


def _drive(mode: str, plan: list[PlannedDoc], w: DocWorkload, tenants: dict[str, Any]) -> dict[str, Any]:
    """Submit the plan in real time, one thread per tenant; returns what fifo must remember
    (document id -> tenant, submit time, its pages' ids)."""
    # Deferred: the child process configures Django (django.setup) before this runs.
    from django.db import connections

    from fairqueue.bench.tasks import PLAIN_TASK_NAME
    from fairqueue.celery import app
    from fairqueue.jobs.submission import JobRequest, job_submit

    start = time.time() + 0.5
    sent: dict[str, Any] = {}
    lock = threading.Lock()
    errors: list[str] = []

    def send(items: list[PlannedDoc]) -> None:
        try:
            for d in items:
                delay = start + d.at - time.time()
                if delay > 0:
                    time.sleep(delay)
                if mode == "fifo":
                    doc_id, submitted = uuid.uuid4().hex, time.time()
                    pages = [f"{doc_id}-{i}" for i in range(d.pages)]
                    for page in pages:
                        app.send_task(PLAIN_TASK_NAME, args=[page, w.page_s], queue=FIFO_QUEUE)
                    with lock:
                        sent[doc_id] = (d.tenant, submitted, pages)
                elif mode == "long":
                    args = {"seconds": round(d.pages * w.page_s, 4)}
                    job_submit(tenant=tenants[d.tenant], req=JobRequest(task="demo.sleep", args=args))
                else:
                    args = {"pages": d.pages, "seconds_per_page": w.page_s}
                    job_submit(tenant=tenants[d.tenant], req=JobRequest(task="demo.document", args=args))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            connections.close_all()

    by_tenant: dict[str, list[PlannedDoc]] = {}
    for d in plan:
        by_tenant.setdefault(d.tenant, []).append(d)
    threads = [threading.Thread(target=send, args=(items,)) for items in by_tenant.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{mode}: submitting failed: {errors[:3]}")
    return sent


def _wait_done(mode: str, plan: list[PlannedDoc], timeout: float) -> None:
    # Deferred: the child process configures Django (django.setup) before this runs.
    from fairqueue.bench.tasks import RUNS_KEY
    from fairqueue.jobs.models import TERMINAL_STATUSES, Job
    from fairqueue.jobs.runtime import redis_client

    expected = sum(d.pages for d in plan) if mode == "fifo" else len(plan)
    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        if mode == "fifo":
            done = redis_client().hlen(RUNS_KEY)
        else:
            done = Job.objects.filter(parent__isnull=True, status__in=TERMINAL_STATUSES).count()
        if done >= expected:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{mode}: only {done} of {expected} finished within {timeout:.0f}s")


def _fifo_records(sent: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # Deferred: the child process configures Django (django.setup) before this runs.
    from fairqueue.bench.tasks import RUNS_KEY
    from fairqueue.jobs.runtime import redis_client

    raw: dict[str, str] = redis_client().hgetall(RUNS_KEY)  # type: ignore[assignment]  # decoded client
    docs, runs = [], []
    for doc_id, (tenant, submitted, pages) in sent.items():
        finished = 0.0
        for page in pages:
            started_at, finished_at, _ = raw[page].split(",", 2)
            s, f = float(started_at), float(finished_at)
            finished = max(finished, f)
            runs.append({"doc": doc_id, "submitted": submitted, "started": s, "run_started": s, "run_finished": f})
        docs.append({"tenant": tenant, "submitted": submitted, "finished": finished, "ok": True})
    return docs, runs


def _fairqueue_records(mode: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # Deferred: the child process configures Django (django.setup) before this runs.
    from fairqueue.jobs.models import JOIN_INDEX, Job, JobStatus

    def at(value: Any) -> float:
        return float(value.timestamp())

    def clock(result: Any, name: str, fallback: Any) -> float:
        if isinstance(result, dict) and name in result:
            return datetime.fromisoformat(result[name]).timestamp()
        return at(fallback)

    docs, runs = [], []
    parents = {j.id: j for j in Job.objects.filter(parent__isnull=True).select_related("tenant")}
    for j in parents.values():
        docs.append(
            {
                "tenant": j.tenant.slug,
                "submitted": at(j.submitted_at),
                "finished": at(j.finished_at),
                "ok": j.status == JobStatus.SUCCEEDED,
            }
        )
        if mode == "long":
            runs.append(
                {
                    "doc": str(j.id),
                    "submitted": at(j.submitted_at),
                    "started": at(j.started_at),
                    "run_started": clock(j.result, "started", j.started_at),
                    "run_finished": clock(j.result, "finished", j.finished_at),
                }
            )
    if mode == "fanout":
        for p in Job.objects.filter(parent__isnull=False).exclude(child_index=JOIN_INDEX):
            runs.append(
                {
                    "doc": str(p.parent_id),
                    "submitted": at(p.submitted_at),
                    "started": at(p.started_at),
                    "run_started": clock(p.result, "started", p.started_at),
                    "run_finished": clock(p.result, "finished", p.finished_at),
                }
            )
    return docs, runs


def child_main(spec_path: str, out_path: str) -> None:
    # The child configures Django itself; the functions it calls import models inside.
    import django

    django.setup()
    spec = json.loads(Path(spec_path).read_text())
    mode: str = spec["mode"]
    w = DocWorkload(**spec["workload"])
    plan = doc_plan(w)
    tenants = _policy_setup(w)
    env = dict(os.environ)
    with contextlib.ExitStack() as running:
        running.enter_context(
            stack.Workers(
                count=w.workers,
                slots=w.slots_per_worker,
                env=env,
                log_dir=stack.BENCH_DIR / "logs" / f"documents-{mode}",
                name=f"bench-docs-{mode}-",
            )
        )
        time.sleep(1.5)  # every worker's heartbeat and first tick land (fleet size known)
        sent = _drive(mode, plan, w, tenants)
        _wait_done(mode, plan, timeout=_timeout(w))
    docs, runs = _fifo_records(sent) if mode == "fifo" else _fairqueue_records(mode)
    Path(out_path).write_text(json.dumps({"mode": mode, "docs": docs, "runs": runs}))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit("usage: python -m fairqueue.bench.documents --child SPEC OUT")
