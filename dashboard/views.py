"""The dashboard page, its way to a tenant's admin page, and the token-guarded `/metrics`."""

from __future__ import annotations

import hmac

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, HttpResponseNotFound, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from prometheus_client import CONTENT_TYPE_LATEST

from dashboard.metrics import metrics_render, scrape_registry
from dashboard.snapshot import HISTORY_LEN
from fairqueue.conf import fq_settings, metrics_multiproc_dir
from tenants.models import Tenant


@staff_member_required
def dashboard_page(request: HttpRequest) -> HttpResponse:
    """The shell of the page; all numbers arrive over the websocket."""
    return render(request, "dashboard/index.html", {"history_len": HISTORY_LEN, "title": "Queue dashboard"})


@staff_member_required
def tenant_admin(request: HttpRequest, slug: str) -> HttpResponse:
    """The tenant's admin page (live state, what-if), from the slug the dashboard knows it by."""
    pk = Tenant.objects.filter(slug=slug).values_list("pk", flat=True).first()
    if pk is None:
        return HttpResponseNotFound(f"No tenant with the slug {slug!r}.\n", content_type="text/plain")
    return HttpResponseRedirect(reverse("admin:tenants_tenant_change", args=[pk]))


def metrics(request: HttpRequest) -> HttpResponse:
    """django-prometheus's and FairQueue's series, behind `Authorization: Bearer <METRICS_TOKEN>` when one is set."""
    token = fq_settings().METRICS_TOKEN
    if token:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            response = HttpResponse("metrics require a bearer token\n", status=401, content_type="text/plain")
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
            return response
    registry = scrape_registry(metrics_multiproc_dir())
    return HttpResponse(metrics_render(registry), content_type=CONTENT_TYPE_LATEST)
