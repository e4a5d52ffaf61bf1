"""ASGI entry point of the repository's own project, written as any host's asgi.py is
(README, "Add FairQueue to your Django project"): HTTP through Django, with FairQueue's REST
API on its own fast handler (fairqueue/apiserver.py), websockets through Channels (staff only)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fairqueue.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from fairqueue.routing import fairqueue_http, websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": fairqueue_http(django_asgi_app),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns()))),
    }
)
