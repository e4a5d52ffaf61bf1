"""`manage.py engine_libraries [--prune]`: the engine's Functions library versions on Redis.

Each code version of the engine loads its own library (named after a hash of its Lua), so
deploys leave old versions behind; `--prune` deletes all but this code's version.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from fairqueue.engine.scripts import library, loaded_libraries, prune_libraries
from fairqueue.jobs.runtime import redis_client


class Command(BaseCommand):
    help = "List the engine's library versions loaded on Redis; --prune deletes the ones of other code versions."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--prune", action="store_true", help="delete every version but this code's")

    def handle(self, *args: Any, **options: Any) -> None:
        client = redis_client()
        current = library().name
        if options["prune"]:
            for name in prune_libraries(client):
                self.stdout.write(f"deleted {name}")
        for name in loaded_libraries(client):
            self.stdout.write(f"{name}{'  (this code)' if name == current else ''}")
