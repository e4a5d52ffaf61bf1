"""An app installed only in a benchmark's processes (settings: FAIRQUEUE_BENCH_QUERY_COUNT_DIR)."""

from django.apps import AppConfig
from django.conf import settings


class BenchConfig(AppConfig):
    name = "fairqueue.bench"
    label = "bench"
    verbose_name = "Benchmark instrumentation"

    def ready(self) -> None:
        # Imported here: the counter hooks database connections, which exist only now.
        from fairqueue.bench import querycount

        querycount.install(settings.FAIRQUEUE_BENCH_QUERY_COUNT_DIR)
