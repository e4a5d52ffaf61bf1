"""The test runner: Django's, plus a PostgreSQL test database that can always be dropped,
`--slowest N` to list the tests that take longest (Python 3.11's unittest has no
`--durations`) and `--module-durations PATH` to write each module's seconds as JSON (the
weights scripts/test_shards.py deals modules to shards by; tests/durations.json).

Tests start real worker and web processes, and threads of this process (lease renewer,
dashboard) open connections of their own; any of them still connected when the suite
ends would make PostgreSQL refuse to drop the test database.
"""

from __future__ import annotations

import json
import time
import unittest
from argparse import ArgumentParser
from collections import defaultdict
from typing import Any

from django.db import connections
from django.test.runner import DiscoverRunner


class TimedTextTestResult(unittest.TextTestResult):
    """Records each test's wall time (setUp and tearDown included)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.durations: list[tuple[float, str]] = []
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        self._started = time.perf_counter()
        super().startTest(test)

    def stopTest(self, test: unittest.TestCase) -> None:
        super().stopTest(test)
        self.durations.append((time.perf_counter() - self._started, test.id()))


class FairQueueTestRunner(DiscoverRunner):
    def __init__(self, slowest: int = 0, module_durations: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slowest = slowest
        self.module_durations = module_durations

    @classmethod
    def add_arguments(cls, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--slowest", type=int, default=0, metavar="N", help="List the N slowest tests at the end.")
        parser.add_argument("--module-durations", default="", metavar="PATH", help="Write seconds per test module.")

    def get_resultclass(self) -> Any:
        resultclass = super().get_resultclass()
        if (self.slowest or self.module_durations) and resultclass is None:
            return TimedTextTestResult
        return resultclass

    def run_suite(self, suite: Any, **kwargs: Any) -> Any:
        result = super().run_suite(suite, **kwargs)
        durations = getattr(result, "durations", None)
        if self.slowest and durations:
            print(f"\nSlowest {self.slowest} tests:")
            for seconds, name in sorted(durations, reverse=True)[: self.slowest]:
                print(f"{seconds:8.2f} s  {name}")
        if self.module_durations and durations:
            per_module: dict[str, float] = defaultdict(float)
            for seconds, name in durations:
                per_module[name.rsplit(".", 2)[0]] += seconds
            ordered = {module: round(seconds, 1) for module, seconds in sorted(per_module.items())}
            with open(self.module_durations, "w") as out:
                json.dump(ordered, out, indent=1)
                out.write("\n")
        return result

    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        for connection in connections.all():
            if connection.vendor != "postgresql":
                continue
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
        super().teardown_databases(old_config, **kwargs)
