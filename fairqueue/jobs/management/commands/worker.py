"""`manage.py worker`: a Celery worker consuming the class queues, highest class first."""

from __future__ import annotations

import os
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from fairqueue.jobs.runtime import queue_name


class Command(BaseCommand):
    help = "Run a FairQueue Celery worker (queues ordered by latency class rank)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--concurrency", "-c", type=int, default=4)
        parser.add_argument("--pool", default="threads", choices=["threads", "prefork", "solo"])
        parser.add_argument("--hostname", "-n", default=f"fq{os.getpid()}@%h")
        parser.add_argument("--loglevel", "-l", default="warning")
        parser.add_argument("--no-batch", action="store_true", help="Do not consume the batch lane.")

    def handle(self, *args: Any, **opts: Any) -> None:
        from fairqueue.celery import app
        from tenants.models import LatencyClass

        queues = [queue_name(c.name) for c in LatencyClass.objects.order_by("-rank")]
        if not opts["no_batch"]:
            queues.append(queue_name("", batch=True))
        app.worker_main(
            [
                "worker",
                f"--concurrency={opts['concurrency']}",
                f"--pool={opts['pool']}",
                f"--hostname={opts['hostname']}",
                f"--loglevel={opts['loglevel']}",
                f"--queues={','.join(queues)}",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ]
        )
