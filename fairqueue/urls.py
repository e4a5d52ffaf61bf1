"""URL map: admin, REST API, dashboard and Prometheus metrics."""

from django.contrib import admin
from django.urls import include, path

from fairqueue.jobs.api import api

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("", include("dashboard.urls")),
    path("", include("django_prometheus.urls")),
]

# A database outage answers 503 with Retry-After wherever it strikes, never a 500 page.
handler500 = "fairqueue.jobs.unavailable.server_error"
