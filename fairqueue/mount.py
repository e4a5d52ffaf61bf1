"""Where the host mounted FairQueue's URLs (`path("<prefix>/", include("fairqueue.urls"))`).

Read from the URL configuration itself, so nothing hard-codes /api/ or /ws/: the REST API's
fast handler (fairqueue/apiserver.py), the 500 handler, the dashboard's websocket route
(fairqueue/routing.py) and links in webhook payloads all follow the host's prefix.
"""

from __future__ import annotations

import functools

from django.conf import settings
from django.urls import NoReverseMatch, get_resolver

#: The name of fairqueue.urls' index page; its path is the mount prefix.
INDEX_URL_NAME = "fairqueue-index"
#: The REST API's version path below the mount prefix.
API_PATH = "api/v1/"
#: The dashboard's websocket path below the mount prefix.
DASHBOARD_WS_PATH = "ws/dashboard/"


@functools.cache
def _prefix_of(urlconf: str) -> str | None:
    try:
        return "/" + get_resolver(urlconf).reverse(INDEX_URL_NAME)
    except NoReverseMatch:
        return None


def mount_prefix() -> str | None:
    """The path below the script prefix where fairqueue.urls is included ("/" at the root,
    "/fq/" for `path("fq/", include(...))`), or None when the project does not include it."""
    return _prefix_of(settings.ROOT_URLCONF)


def api_prefix() -> str | None:
    """The REST API's path prefix below the script prefix (e.g. "/fq/api/"), or None."""
    prefix = mount_prefix()
    return None if prefix is None else prefix + API_PATH.split("/")[0] + "/"


def job_path(job_id: object) -> str:
    """A job's REST path (the `url` of a webhook payload); the root's when not mounted."""
    return f"{mount_prefix() or '/'}{API_PATH}jobs/{job_id}"
