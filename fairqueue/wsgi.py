"""WSGI entry point (the ASGI one in asgi.py is what the web server serves: gunicorn.conf.py)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fairqueue.settings")
application = get_wsgi_application()
