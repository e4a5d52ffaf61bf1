"""The test runner: Django's, plus a PostgreSQL test database that can always be dropped.

Tests start real worker and web processes, and threads of this process (lease renewer,
dashboard) open connections of their own; any of them still connected when the suite
ends would make PostgreSQL refuse to drop the test database.
"""

from __future__ import annotations

from typing import Any

from django.db import connections
from django.test.runner import DiscoverRunner


class FairQueueTestRunner(DiscoverRunner):
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
