"""A host's URLs with FairQueue under a prefix of its own (tests/test_mount.py)."""

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path


def host_home(request: HttpRequest) -> HttpResponse:
    return HttpResponse("the host's own page")


urlpatterns = [
    path("", host_home),
    path("staff/", admin.site.urls),
    path("ops/queue/", include("fairqueue.urls")),
]
