"""Private redis-servers for tests (fairqueue.bench.redis_server), logging with the test
shard's other logs."""

from __future__ import annotations

from typing import Any

from fairqueue.bench import redis_server
from tests.workers import LOG_DIR


class RedisServer(redis_server.RedisServer):
    def __init__(self, **options: Any) -> None:
        super().__init__(log_dir=LOG_DIR, **options)
