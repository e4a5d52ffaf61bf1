"""Sending webhook events: a periodic duty claims the due ones and hands them to a small
pool of threads of its own, so no delivery ever takes a job slot, and a receiver that
never answers costs one sender thread for one timeout, nothing else.

At least once: an event is claimed by a compare-and-set (state and attempt count) that
also writes the attempt's delivery row; the attempt's outcome is written by another,
conditional on the claim. A sender that dies mid-send leaves a claim that runs out: the
next duty marks that attempt `lost` and sends the event again, with the same event id.
Failures are retried with exponential backoff (with jitter) until MAX_AGE after the event.
"""

from __future__ import annotations

import http.client
import logging
import random
import socket
import ssl
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from fairqueue.conf import fq_settings
from webhooks.models import DeliveryOutcome, EventState, WebhookDelivery, WebhookEvent
from webhooks.signing import EVENT_ID_HEADER, SIGNATURE_HEADER, signature_header
from webhooks.targets import Target, TargetRefused, target_resolve

log = logging.getLogger("fairqueue.webhooks")

RESPONSE_READ_MAX = 64 * 1024  # what is read of an answer (the status is what counts)
USER_AGENT = "FairQueue-Webhooks/1"


def _conf(name: str) -> float:
    return float(getattr(fq_settings().WEBHOOKS, name))


def backoff_seconds(attempt: int) -> float:
    """Wait after failed attempt `attempt` (1-based): doubling from the first wait, capped,
    with equal jitter (half fixed, half random) so receivers back up are not hit in step."""
    step = min(_conf("BACKOFF_MAX_SECONDS"), _conf("BACKOFF_FIRST_SECONDS") * 2 ** (attempt - 1))
    return step / 2 + random.uniform(0, step / 2)


def _claim_seconds() -> float:
    # Longer than any attempt can take (connect + send + read, each bounded by the timeout).
    return 4 * _conf("TIMEOUT_SECONDS") + 30


# --- the duty --------------------------------------------------------------------------------


class _Senders:
    """The process's sender threads and the events they have in hand."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.in_hand: set[uuid.UUID] = set()

    def free(self) -> int:
        with self._lock:
            return int(fq_settings().WEBHOOKS.SENDERS) - len(self.in_hand)

    def submit(self, event_id: uuid.UUID, attempt: int) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=int(fq_settings().WEBHOOKS.SENDERS), thread_name_prefix="fq-webhook"
                )
            self.in_hand.add(event_id)
            self._pool.submit(self._run, event_id, attempt)

    def _run(self, event_id: uuid.UUID, attempt: int) -> None:
        try:
            event_send(event_id, attempt)
        except Exception:
            log.exception("webhook event %s attempt %d: could not record its outcome", event_id, attempt)
        finally:
            with self._lock:
                self.in_hand.discard(event_id)
            connection.close()  # this thread's connection goes back (to the pool, on PostgreSQL)


senders = _Senders()


def webhooks_send_due(*, limit: int | None = None) -> int:
    """The periodic duty: claim up to as many due events as there are free sender threads
    and start sending them; returns how many were claimed. Never waits for a send."""
    free = senders.free() if limit is None else limit
    if free <= 0:
        return 0
    now = timezone.now()
    due = list(
        WebhookEvent.objects.filter(
            Q(state=EventState.PENDING, next_attempt_at__lte=now) | Q(state=EventState.SENDING, claimed_until__lt=now)
        )
        .exclude(id__in=list(senders.in_hand))
        .order_by("next_attempt_at")
        .values_list("id", "job_id", "state", "attempts")[:free]
    )
    claimed = 0
    for event_id, job_id, state, attempts in due:
        if _claim(event_id=event_id, job_id=job_id, state=state, attempts=attempts, now=now):
            senders.submit(event_id, attempts + 1)
            claimed += 1
    return claimed


def _claim(*, event_id: uuid.UUID, job_id: uuid.UUID, state: str, attempts: int, now: datetime) -> bool:
    with transaction.atomic():
        won = WebhookEvent.objects.filter(id=event_id, state=state, attempts=attempts).update(
            state=EventState.SENDING, attempts=attempts + 1, claimed_until=now + timedelta(seconds=_claim_seconds())
        )
        if not won:
            return False  # another sender (an earlier duty holder) took it
        if state == EventState.SENDING:  # the previous claim ran out mid-send
            WebhookDelivery.objects.filter(event_id=event_id, outcome=DeliveryOutcome.SENDING).update(
                outcome=DeliveryOutcome.LOST, finished_at=now, error="the sender stopped before recording an outcome"
            )
        WebhookDelivery.objects.create(event_id=event_id, job_id=job_id, attempt=attempts + 1, started_at=now)
    return True


# --- one attempt -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttemptResult:
    outcome: str
    status_code: int | None = None
    error: str = ""


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the checked address, whatever the name resolves to by now."""

    def __init__(self, target: Target, timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self._address = target.address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, target: Target, timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout, context=ssl.create_default_context())
        self._address = target.address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


def attempt_post(*, url: str, body: bytes, secret: str, event_id: str) -> AttemptResult:
    """POST the event once; redirects are not followed (a 3xx is a failed attempt)."""
    try:
        target = target_resolve(url)
    except TargetRefused as exc:
        return AttemptResult(DeliveryOutcome.REFUSED_TARGET, error=str(exc))
    timeout = _conf("TIMEOUT_SECONDS")
    conn_class = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    conn = conn_class(target, timeout)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        EVENT_ID_HEADER: event_id,
        SIGNATURE_HEADER: signature_header(secret, body),
    }
    try:
        conn.request("POST", target.path, body=body, headers=headers)
        response = conn.getresponse()
        response.read(RESPONSE_READ_MAX)
    except TimeoutError as exc:
        return AttemptResult(DeliveryOutcome.TIMEOUT, error=f"no answer within {timeout:g} s ({exc})")
    except (OSError, http.client.HTTPException) as exc:
        return AttemptResult(DeliveryOutcome.CONNECTION_ERROR, error=f"{type(exc).__name__}: {exc}"[:500])
    finally:
        conn.close()
    if 200 <= response.status < 300:
        return AttemptResult(DeliveryOutcome.DELIVERED, status_code=response.status)
    return AttemptResult(DeliveryOutcome.HTTP_ERROR, status_code=response.status, error=response.reason[:500])


def event_send(event_id: uuid.UUID, attempt: int) -> str:
    """Send attempt `attempt` of a claimed event and record what happened; returns the
    event's new state (or 'superseded' if its claim was taken over meanwhile)."""
    event = WebhookEvent.objects.select_related("tenant").get(id=event_id)
    started = time.monotonic()
    result = attempt_post(
        url=event.url, body=event.body.encode(), secret=event.tenant.webhook_secret, event_id=str(event.id)
    )
    now = timezone.now()
    fields: dict[str, object] = {"claimed_until": None}
    if result.outcome == DeliveryOutcome.DELIVERED:
        fields.update(state=EventState.DELIVERED, delivered_at=now)
    else:
        wait = backoff_seconds(attempt)
        give_up = now + timedelta(seconds=wait) > event.created_at + timedelta(seconds=_conf("MAX_AGE_SECONDS"))
        if give_up:
            fields.update(state=EventState.FAILED)
        else:
            fields.update(state=EventState.PENDING, next_attempt_at=now + timedelta(seconds=wait))
    with transaction.atomic():
        WebhookDelivery.objects.filter(event_id=event_id, attempt=attempt, outcome=DeliveryOutcome.SENDING).update(
            outcome=result.outcome, status_code=result.status_code, error=result.error[:500], finished_at=now
        )
        won = WebhookEvent.objects.filter(id=event_id, state=EventState.SENDING, attempts=attempt).update(**fields)
    if not won:
        return "superseded"
    if result.outcome != DeliveryOutcome.DELIVERED:
        log.info(
            "webhook event %s attempt %d: %s %s (%.1f s); now %s",
            event_id,
            attempt,
            result.outcome,
            result.status_code or result.error,
            time.monotonic() - started,
            fields["state"],
        )
    return str(fields["state"])
