"""The Celery application; configuration comes from Django settings (CELERY_*)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fairqueue.settings")

app = Celery("fairqueue")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# The benchmark's plain-Celery baseline task (fairqueue/bench/tasks.py); not an installed app.
app.autodiscover_tasks(["fairqueue.bench"])
