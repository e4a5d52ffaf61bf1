"""`manage.py worker`: the same worker as `celery -A fairqueue worker`, with its options.

Everything FairQueue needs of a worker (the queues, the threads pool, the fleet registry,
heartbeat, leases and periodic duties) comes from the Celery configuration and the
signal handlers in fairqueue.jobs.worker, so both commands start the same thing.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from fairqueue.celery import app
from fairqueue.queues import BATCH_QUEUE, QUARANTINE_QUEUE, broker_is_amqp


class Command(BaseCommand):
    help = "Run a FairQueue Celery worker (same as `celery -A fairqueue worker`)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--concurrency", "-c", type=int, default=None, help="Slots (default: settings).")
        parser.add_argument("--pool", "-P", default=None, choices=["threads", "solo"])
        parser.add_argument("--hostname", "-n", default=None)
        parser.add_argument("--loglevel", "-l", default="warning")
        parser.add_argument("--no-batch", action="store_true", help="Do not consume the batch lane.")
        parser.add_argument(
            "--events", "-E", action="store_true", help="Send task events (Flower, celery-exporter), as celery's -E."
        )
        parser.add_argument(
            "--quarantine",
            action="store_true",
            help=f"Consume only the quarantine lane ({QUARANTINE_QUEUE}): jobs whose workers died under them. "
            f"Same as `celery -A fairqueue worker -Q {QUARANTINE_QUEUE}`.",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        argv = ["worker", f"--loglevel={opts['loglevel']}"]
        for option in ("concurrency", "pool", "hostname"):
            if opts[option] is not None:
                argv.append(f"--{option}={opts[option]}")
        if opts["events"]:
            argv.append("--task-events")
        if opts["quarantine"]:
            if opts["no_batch"]:
                raise CommandError("--quarantine consumes only the quarantine lane: --no-batch says nothing more")
            argv.append(f"--queues={QUARANTINE_QUEUE}")
        elif opts["no_batch"]:
            if broker_is_amqp(app.conf.broker_url):
                raise CommandError(
                    "--no-batch needs the Redis broker: on RabbitMQ the batch lane is the lowest "
                    "priority of fq.jobs (fairqueue/queues.py), which every worker reads"
                )
            argv.append(f"--exclude-queues={BATCH_QUEUE}")
        app.worker_main(argv)
