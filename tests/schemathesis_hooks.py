"""Schemathesis hooks for tests/test_api_schema_live.py (loaded by the `st` process through
SCHEMATHESIS_HOOKS; no Django here).

A positive (schema-valid) request is steered, before it is sent, only where its validity
rests on what no static schema can say, each named in the field's description:

- `callback_url`: a public address that resolves (a DNS lookup at submit) and a tenant with
  a webhook secret: a URL of the test's, in a network the server was told to allow;
- `run_at`: at most 366 days after the server's clock: an hour from now;
- `run_at` and `delay_seconds` both set: refused ("not both"): the delay is dropped;
- `idempotency_key` repeated within one bulk: refused: each made unique;
- `cursor`: only a `next` the server gave: one it gave the test.

Everything else (the task and its arguments, the latency classes and resources, the
bounds) is sent as generated. Negative cases are left as generated but for one thing: a
valid idempotency key gets a suffix of its own, since a key the tenant used before answers
the job it made then, whatever else the body says (the API's idempotency), and an invalid
body would be answered as if accepted.
"""

from __future__ import annotations

import itertools
import os
from datetime import UTC, datetime, timedelta
from typing import Any

import schemathesis

CALLBACK_URL = os.environ.get("FQ_FUZZ_CALLBACK_URL", "")
CURSOR = os.environ.get("FQ_FUZZ_CURSOR", "")
RUN_AT_AHEAD = timedelta(hours=1)
IDEMPOTENCY_MAX = 200
_calls = itertools.count()


def _steer_job(job: Any) -> None:
    if not isinstance(job, dict):
        return
    if isinstance(job.get("callback_url"), str):
        job["callback_url"] = CALLBACK_URL
    if isinstance(job.get("run_at"), str):
        job["run_at"] = (datetime.now(UTC) + RUN_AT_AHEAD).isoformat()
        if job.get("delay_seconds") is not None:
            job["delay_seconds"] = None


def _steer_bulk(body: Any) -> None:
    jobs = body.get("jobs") if isinstance(body, dict) else None
    if not isinstance(jobs, list):
        return
    seen: set[str] = set()
    for i, job in enumerate(jobs):
        _steer_job(job)
        key = job.get("idempotency_key") if isinstance(job, dict) else None
        if isinstance(key, str):
            while key in seen:
                key = f"{key[:190]}-{i}"
            job["idempotency_key"] = key
            seen.add(key)


def _fresh_keys(body: Any) -> None:
    """Suffix each valid idempotency key with this call's number (a repeat within one bulk stays a repeat)."""
    jobs = body.get("jobs") if isinstance(body, dict) and "jobs" in body else [body]
    suffix = f"~{next(_calls)}"
    for job in jobs if isinstance(jobs, list) else []:
        key = job.get("idempotency_key") if isinstance(job, dict) else None
        if isinstance(key, str) and 1 <= len(key) <= IDEMPOTENCY_MAX:
            job["idempotency_key"] = key[: IDEMPOTENCY_MAX - len(suffix)] + suffix


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    label = case.operation.label
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        if label in ("POST /api/v1/jobs", "POST /api/v1/jobs/bulk"):
            _fresh_keys(case.body)
        return
    if label == "POST /api/v1/jobs":
        _steer_job(case.body)
    elif label == "POST /api/v1/jobs/bulk":
        _steer_bulk(case.body)
    elif label == "GET /api/v1/jobs" and isinstance(case.query, dict) and case.query.get("cursor"):
        case.query["cursor"] = CURSOR
