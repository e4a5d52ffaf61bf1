"""The project boots: settings load, migrations seed the latency classes, Redis answers."""

from tenants.models import LatencyClass
from tests.base import RedisTestCase, redis_db_number


class SmokeTests(RedisTestCase):
    def test_latency_classes_are_seeded_in_rank_order(self) -> None:
        self.assertEqual(
            list(LatencyClass.objects.values_list("name", flat=True)), ["critical", "high", "default", "low"]
        )

    def test_redis_is_the_dedicated_test_database(self) -> None:
        self.assertTrue(self.redis.ping())
        self.assertEqual(self.redis.connection_pool.connection_kwargs["db"], redis_db_number())
