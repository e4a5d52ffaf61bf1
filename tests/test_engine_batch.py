"""`admit_many` admits a tag's jobs in one call (lua/admit_jobs.lua): the fast path, checked
against the general one. The same items, on the same starting state, admitted one by one
with `admit` and all at once with `admit_many`, must give the same replies, job for job,
and leave the same state (waiters in the same order, the same holders, limits, flows)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import redis
import redis.asyncio
from django.conf import settings

from fairqueue.engine import AdmitRequest, AsyncEngine, Engine, KeyLimit
from fairqueue.engine.engine import ADMITS_PER_CALL
from fairqueue.engine.keys import READY_FIELD, STAMP_FIELD, key_name
from tests.base import RedisTestCase

KEYS = ("a", "b", "c")
# Fields holding absolute times: lease expiries move with the clock between the two runs.
CLOCKED = {b"\x01due", READY_FIELD.encode(), STAMP_FIELD.encode()}


def random_items(rng: random.Random, tags: tuple[str, ...], count: int) -> list[AdmitRequest]:
    """Admits that park, wake (a raised limit), change limits, repeat a job id (a
    re-delivery), wait in flows of several weights, at several priorities, some on a tag
    that is not ready with require_ready."""
    items = []
    for n in range(count):
        names = rng.sample(KEYS, rng.randint(1, 3))
        keys: Any
        if rng.random() < 0.5:
            keys = {k: rng.choice((0, 1, 2, 3)) for k in names}
        else:
            keys = [
                KeyLimit(k, rng.choice((1, 2, 3)), rng.choice(("", "x", "y")), rng.choice((0.5, 1.0, 3.0)))
                for k in names
            ]
        job = f"j{rng.randrange(n + 1)}" if rng.random() < 0.1 else f"j{n}"
        items.append(
            AdmitRequest(
                tag=rng.choice(tags),
                job_id=job,
                keys=keys,
                lease_seconds=60,
                priority=rng.choice((0, 0, 5, 250)),
                data=f"d{n}",
                require_ready=rng.random() < 0.2,
            )
        )
    return items


def tag_state(client: redis.Redis, tag: str) -> tuple[Any, ...]:
    """A tag's engine state without its clocked values: the hash, the wait queue in order,
    the leased jobs."""
    state = {f: v for f, v in client.hgetall(key_name("fq", tag, "state")).items() if f not in CLOCKED}
    waits = client.zrange(key_name("fq", tag, "waits"), 0, -1)
    leases = sorted(client.zrange(key_name("fq", tag, "leases"), 0, -1))
    return state, waits, leases


class AdmitManyComparison:
    """The comparisons, on whatever engine ``setUp`` gives (a plain server here, a cluster
    in tests.test_cluster, where the runs' tags sit on different primaries)."""

    client: Any
    e: Engine
    assertEqual: Any
    assertGreater: Any
    subTest: Any

    def prepare(self, tags: tuple[str, ...]) -> None:
        """The same starting state on each run's tags: the first is ready, holds jobs on
        every key, two of them with a lease run out (the first admit reclaims them and wakes
        a waiter); the second is not ready."""
        ready, _ = tags
        self.e.init_tag(tag=ready)
        for i, key in enumerate(KEYS * 2):
            self.e.admit(tag=ready, job_id=f"old{i}", keys={key: 2}, lease_seconds=60, data=f"old{i}")
        self.e.admit(tag=ready, job_id="waiter", keys={"a": 2}, lease_seconds=60, data="waiter")
        self.e.expire_now(tag=ready, job_id="old0")
        self.e.expire_now(tag=ready, job_id="old3")

    def run_both(self, items: list[AdmitRequest]) -> None:
        one_tags, many_tags = ("r1", "u1"), ("r2", "u2")
        self.prepare(one_tags)
        self.prepare(many_tags)
        rename = dict(zip(one_tags, many_tags, strict=True))
        one = [
            self.e.admit(
                tag=i.tag,
                job_id=i.job_id,
                keys=i.keys,
                priority=i.priority,
                lease_seconds=i.lease_seconds,
                data=i.data,
                require_ready=i.require_ready,
            )
            for i in items
        ]
        many = self.e.admit_many(
            [
                AdmitRequest(rename[i.tag], i.job_id, i.keys, i.lease_seconds, i.priority, i.data, i.require_ready)
                for i in items
            ]
        )
        self.assertEqual(many, one)
        for a, b in zip(one_tags, many_tags, strict=True):
            self.assertEqual(tag_state(self.client, b), tag_state(self.client, a), (a, b))
            self.assertEqual(self.e.check_invariants(tag=b), [])

    def test_random_bulks_give_the_replies_and_state_of_admits_one_by_one(self) -> None:
        for seed in range(12):
            with self.subTest(seed=seed):
                items = random_items(random.Random(seed), ("r1", "u1"), 80)
                self.run_both(items)
                for tag in ("r1", "u1", "r2", "u2"):
                    self.e.reset_tag(tag=tag)

    def test_a_lone_admit_on_a_tag_is_the_same_too(self) -> None:
        # One job of a tag goes as admit_job itself; here it reclaims the expired leases and
        # raises a limit, so its reply carries both.
        items = [AdmitRequest("r1", "lone", {"a": 3}, 60, 0, "d"), AdmitRequest("u1", "other", {"a": 1}, 60, 0, "")]
        self.run_both(items)
        self.assertEqual([w.job_id for w in self.e.admit_many(items[:1])[0].reclaimed], [])  # a re-delivery now

    def test_a_bulk_larger_than_one_call_keeps_its_order(self) -> None:
        count = ADMITS_PER_CALL * 2 + 7
        items = [AdmitRequest("r1", f"j{n}", {"a": 3, "b": 1 + n % 2}, 60, n % 3, f"d{n}") for n in range(count)]
        self.run_both(items)
        self.assertGreater(self.e.inspect_key(tag="r2", key="a").waiting, ADMITS_PER_CALL)


class AdmitManyMatchesAdmitsOneByOne(AdmitManyComparison, RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.client = redis.Redis.from_url(settings.REDIS_URL)
        self.e = Engine(self.client)

    def test_the_random_bulks_cover_every_kind_of_reply(self) -> None:
        items = random_items(random.Random(3), ("r1", "u1"), 80)
        self.prepare(("r1", "u1"))
        replies = self.e.admit_many(items)
        self.assertTrue(any(r.admitted for r in replies))
        self.assertTrue(any(r.parked_on for r in replies))
        self.assertTrue(any(r.not_ready for r in replies))
        self.assertTrue(any(r.duplicate for r in replies))
        self.assertTrue(any(r.woken for r in replies))
        self.assertEqual([w.job_id for w in replies[0].reclaimed], ["old0", "old3"])

    def test_one_call_per_tag_when_all_are_admitted(self) -> None:
        before = int(self.client.info("commandstats").get("cmdstat_fcall", {}).get("calls", 0))
        items = [AdmitRequest(t, f"j{n}", {"a": 1000}, 60, 0, "") for n in range(40) for t in ("x", "y")]
        self.assertTrue(all(a.admitted for a in self.e.admit_many(items)))
        after = int(self.client.info("commandstats")["cmdstat_fcall"]["calls"])
        self.assertEqual(after - before, 2)
        self.assertEqual(self.e.inspect_key(tag="x", key="a").held, 40)

    def test_the_asyncio_engine_admits_alike(self) -> None:
        items = random_items(random.Random(7), ("r1", "u1"), 40)
        self.prepare(("r1", "u1"))
        expected = self.e.admit_many(items)
        state = tag_state(self.client, "r1")
        self.client.flushdb()
        self.prepare(("r1", "u1"))

        async def admit() -> Any:
            client = redis.asyncio.Redis.from_url(settings.REDIS_URL)
            try:
                return await AsyncEngine(client).admit_many(items)
            finally:
                await client.aclose()

        self.assertEqual(asyncio.run(admit()), expected)
        self.assertEqual(tag_state(self.client, "r1"), state)
