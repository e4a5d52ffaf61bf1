"""FairQueue's index page: where the dashboard, the admin and the API docs are."""

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import NoReverseMatch, reverse

from fairqueue.jobs.api import api


def _admin_url() -> str | None:
    try:
        return reverse("admin:index")
    except NoReverseMatch:  # a project without Django's admin site
        return None


def index(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "fairqueue/index.html",
        {
            "dashboard_url": reverse("dashboard"),
            "admin_url": _admin_url(),
            "docs_url": reverse(f"{api.urls_namespace}:openapi-view"),
            "openapi_url": reverse(f"{api.urls_namespace}:openapi-json"),
            "metrics_url": reverse("prometheus-django-metrics"),
        },
    )
