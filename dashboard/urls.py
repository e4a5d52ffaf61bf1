"""HTTP routes of the dashboard, its own static assets, and `/metrics` (ahead of django-prometheus's)."""

from pathlib import Path

from django.urls import URLPattern, path, re_path
from django.views.static import serve

from dashboard import views

ASSETS = Path(__file__).resolve().parent / "static" / "dashboard"

urlpatterns: list[URLPattern] = [
    path("dashboard/", views.dashboard_page, name="dashboard"),
    path("dashboard/tenants/<slug:slug>/admin/", views.tenant_admin, name="dashboard-tenant-admin"),
    # Served by the project itself so the page works under plain daphne with no CDN and
    # no collectstatic; only this app's few files are reachable here.
    re_path(r"^dashboard/assets/(?P<path>[\w.-]+)$", serve, {"document_root": ASSETS}, name="dashboard-asset"),
    # Matched before django_prometheus.urls (included after this module), which it wraps.
    path("metrics", views.metrics, name="prometheus-django-metrics"),
]
