"""FairQueue's URLs, for a project to include under any prefix:

    path("fq/", include("fairqueue.urls"))

the index page (links to the dashboard, the admin and the API docs), the REST API
(`api/v1/`, its docs at `api/v1/docs`), the live dashboard and Prometheus's `metrics`.
"""

from django.urls import include, path

from fairqueue import views
from fairqueue.jobs.api import api
from fairqueue.mount import API_PATH, INDEX_URL_NAME

urlpatterns = [
    path("", views.index, name=INDEX_URL_NAME),
    path(API_PATH, api.urls),
    path("", include("dashboard.urls")),
    path("", include("django_prometheus.urls")),
]
