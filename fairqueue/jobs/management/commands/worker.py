"""`manage.py worker`: a FairQueue worker of the project's Celery app, the same as
`celery -A <project> worker -Q fq.jobs,fq.batch -P threads` (docs/celery.md).

Everything FairQueue needs of a worker (its queues' declarations and transport options,
the fleet registry, heartbeat, leases and periodic duties) comes from the signal handlers
in fairqueue.jobs.celery_host and fairqueue.jobs.worker, so both commands start the same thing.
"""

from __future__ import annotations

from typing import Any

from celery import current_app as app
from django.core.management.base import BaseCommand, CommandError, CommandParser

from fairqueue.queues import BATCH_QUEUE, JOBS_QUEUE, QUARANTINE_QUEUE, broker_is_amqp


class Command(BaseCommand):
    help = "Run a FairQueue Celery worker of the project's Celery app (its queues, the threads pool)."

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
        # Jobs renew their leases from a thread of the process that runs them: threads pool.
        opts["pool"] = opts["pool"] or "threads"
        for option in ("concurrency", "pool", "hostname"):
            if opts[option] is not None:
                argv.append(f"--{option}={opts[option]}")
        if opts["events"]:
            argv.append("--task-events")
        amqp = broker_is_amqp(app.conf.broker_url)
        if opts["quarantine"]:
            if opts["no_batch"]:
                raise CommandError("--quarantine consumes only the quarantine lane: --no-batch says nothing more")
            queues = [QUARANTINE_QUEUE]
        else:
            if opts["no_batch"] and amqp:
                raise CommandError(
                    "--no-batch needs the Redis broker: on RabbitMQ the batch lane is the lowest "
                    "priority of fq.jobs (fairqueue/queues.py), which every worker reads"
                )
            queues = [JOBS_QUEUE] if amqp or opts["no_batch"] else [JOBS_QUEUE, BATCH_QUEUE]
        argv.append(f"--queues={','.join(queues)}")
        app.worker_main(argv)
