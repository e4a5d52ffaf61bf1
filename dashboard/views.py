"""The dashboard page and the token-guarded `/metrics`."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from prometheus_client import CONTENT_TYPE_LATEST

from dashboard.metrics import metrics_render, scrape_registry
from dashboard.snapshot import HISTORY_LEN


@staff_member_required
def dashboard_page(request: HttpRequest) -> HttpResponse:
    """The shell of the page; all numbers arrive over the websocket."""
    return render(request, "dashboard/index.html", {"history_len": HISTORY_LEN, "title": "Queue dashboard"})


def metrics(request: HttpRequest) -> HttpResponse:
    """django-prometheus's and FairQueue's series, behind `Authorization: Bearer <METRICS_TOKEN>` when one is set."""
    token = settings.FAIRQUEUE.get("METRICS_TOKEN") or ""
    if token:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            response = HttpResponse("metrics require a bearer token\n", status=401, content_type="text/plain")
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
            return response
    registry = scrape_registry(settings.PROMETHEUS_MULTIPROC_DIR)
    return HttpResponse(metrics_render(registry), content_type=CONTENT_TYPE_LATEST)
