"""The answer when the database is away: 503 with Retry-After, never a 500 page.

The API answers it in its JSON error shape from its own exception handler
(fairqueue.jobs.api). `server_error` is the site's 500 handler (`handler500` in the root
URLconf): Django calls it for an exception no view handled, raised in a view or a
middleware (the admin's session lookup, the dashboard's page, /metrics). A database error
gets the 503; anything else the usual 500, as JSON under the API.
"""

from __future__ import annotations

import sys

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults

from fairqueue.jobs.database import is_transient
from fairqueue.mount import api_prefix

DATABASE_UNAVAILABLE = "database_unavailable"
DATABASE_UNAVAILABLE_MESSAGE = "The database is unavailable; nothing was written. Retry shortly."
DATABASE_RETRY_AFTER_SECONDS = 5

_PAGE = """<!doctype html>
<html lang="en"><head><title>Service unavailable (503)</title></head>
<body><h1>Service unavailable</h1>
<p>FairQueue cannot reach its database right now. It reconnects by itself; retry in a few seconds.</p>
</body></html>
"""


def unavailable_json(code: str, message: str) -> JsonResponse:
    response = JsonResponse({"error": {"code": code, "message": message, "field": None}}, status=503)
    response["Retry-After"] = str(DATABASE_RETRY_AFTER_SECONDS)
    return response


def server_error(request: HttpRequest) -> HttpResponse:
    """Django's handler500, called inside the `except` that caught the request's error."""
    error = sys.exc_info()[1]
    prefix = api_prefix()
    api = prefix is not None and request.path_info.startswith(prefix)
    if error is not None and is_transient(error):
        if api:
            return unavailable_json(DATABASE_UNAVAILABLE, DATABASE_UNAVAILABLE_MESSAGE)
        response = HttpResponse(_PAGE, status=503, content_type="text/html; charset=utf-8")
        response["Retry-After"] = str(DATABASE_RETRY_AFTER_SECONDS)
        return response
    if api:
        return JsonResponse(
            {"error": {"code": "internal_error", "message": "An unexpected error occurred.", "field": None}},
            status=500,
        )
    return defaults.server_error(request)
