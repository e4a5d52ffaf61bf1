"""The repository's own project's URLs: the admin and FairQueue, mounted as any host mounts
them (README, "Add FairQueue to your Django project"), here at the root."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("fairqueue.urls")),
]

# A database outage answers 503 with Retry-After wherever it strikes, never a 500 page.
handler500 = "fairqueue.jobs.unavailable.server_error"
