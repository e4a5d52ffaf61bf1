"""Test bases: every test gets a clean, dedicated Redis database.

Tests refuse to run against a Redis database that already holds data, so they can never
wipe a demo or production instance by accident; they flush it around each test.
"""

from __future__ import annotations

import redis
from django.conf import settings
from django.test import TestCase, TransactionTestCase

_checked_empty = False


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def redis_db_number() -> int:
    """The database number tests were told to use (never the demo's db 0 by default)."""
    return int(redis.connection.parse_url(settings.REDIS_URL).get("db", 0))


def _guard_and_flush() -> None:
    global _checked_empty
    client = redis_client()
    if not _checked_empty:
        size = client.dbsize()
        if size:
            raise RuntimeError(
                f"Refusing to run tests: Redis at {settings.REDIS_URL} holds {size} keys. "
                "Point FAIRQUEUE_TEST_REDIS_URL at an empty database."
            )
        _checked_empty = True
    client.flushdb()


class RedisTestMixin:
    """Flushes the test Redis database before each test's fixtures load and after it ends."""

    redis: redis.Redis

    @classmethod
    def _pre_setup(cls) -> None:
        # Before fixtures: restoring serialized rows fires the policy-sync signals.
        _guard_and_flush()
        cls.redis = redis_client()
        super()._pre_setup()  # type: ignore[misc]

    def _post_teardown(self) -> None:
        super()._post_teardown()  # type: ignore[misc]
        self.redis.flushdb()


class RedisTestCase(RedisTestMixin, TestCase):
    """A transactional test (rolled back) with a clean Redis."""


class RedisTransactionTestCase(RedisTestMixin, TransactionTestCase):
    """For tests where other processes (real workers) must see committed rows."""
