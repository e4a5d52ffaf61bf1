"""What a host's asgi.py calls: FairQueue's HTTP router and its websocket routes.

    application = ProtocolTypeRouter({
        "http": fairqueue_http(django_asgi_app),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns()))),
    })

Both follow the prefix under which the host's urls.py includes fairqueue.urls (fairqueue/mount.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from django.urls import URLPattern, path

from dashboard.consumers import DashboardConsumer
from fairqueue.apiserver import ApiASGIHandler, HttpRouter
from fairqueue.mount import DASHBOARD_WS_PATH, mount_prefix


def websocket_urlpatterns() -> list[URLPattern]:
    """The dashboard's websocket route, under the prefix the host mounted fairqueue.urls at."""
    prefix = (mount_prefix() or "/").lstrip("/")
    return [path(prefix + DASHBOARD_WS_PATH, DashboardConsumer.as_asgi())]


def fairqueue_http(django_asgi_app: Callable[..., Awaitable[None]]) -> HttpRouter:
    """The host's HTTP application with FairQueue's REST API on its own fast handler
    (fairqueue/apiserver.py); every other path goes to `django_asgi_app`."""
    return HttpRouter(api=ApiASGIHandler(), default=django_asgi_app)


__all__ = ["fairqueue_http", "websocket_urlpatterns"]
