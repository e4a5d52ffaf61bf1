"""Redis Cluster for the engine (issue 18): a real local cluster of 3 primaries and 3
replicas (`redis-server --cluster-enabled yes`, joined with `redis-cli --cluster create`),
detected from FAIRQUEUE_ENGINE_URL alone; shards on different primaries; the engine's
behaviours and its multi-key cases there; jobs end to end with real workers; the rebuild
after a primary lost its data; and a failover that loses acknowledged writes, detected and
rebuilt from the database. The chaos run against a cluster is in tests/test_chaos.py.

Run with `make test-distributed` (tag "distributed"). FAIRQUEUE_TEST_CLUSTER_PORTS=7101-7106
fixes the nodes' ports; by default free ones are used.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from django.conf import settings
from django.test import override_settings, tag
from redis.cluster import RedisCluster, key_slot

from fairqueue.bench.cluster import LocalCluster, Node, ports_from_env
from fairqueue.engine import AdmitRequest, Engine, KeyLimit, TagHealth
from fairqueue.engine.cluster import connect
from fairqueue.engine.keys import STAMP_FIELD, key_name
from fairqueue.jobs import live, stats
from fairqueue.jobs.admission import shard_tag, tenant_key
from fairqueue.jobs.dispatch import job_release
from fairqueue.jobs.models import Job, JobStatus, LedgerEntry
from fairqueue.jobs.recovery import state_ensure, writes_lost
from fairqueue.jobs.runtime import engine, redis_client
from fairqueue.jobs.submission import JobRequest, job_submit, job_submit_bulk
from tenants import keys as policy_keys
from tenants.policy import policy_invalidate, policy_snapshot
from tenants.sync import policy_sync_all
from tests import test_engine_api, test_engine_batch
from tests.base import RedisTestCase
from tests.factories import make_tenant
from tests.test_jobs_e2e import E2EBase, max_overlap
from tests.workers import LOG_DIR, WorkerProcess, wait_for

QUICK = {"seconds": 0.05}
SHARDS = 3

_cluster: LocalCluster | None = None


def setUpModule() -> None:
    global _cluster
    _cluster = LocalCluster(ports_from_env(), log_dir=LOG_DIR / "cluster").start()


def tearDownModule() -> None:
    if _cluster is not None:
        _cluster.stop()


def cluster() -> LocalCluster:
    assert _cluster is not None, "setUpModule starts the cluster"
    return _cluster


def shards_on_distinct_primaries(count: int = SHARDS, prefix: str = "c") -> list[str]:
    """Shard names whose engine tags `{s:<name>}` hash to slots of `count` different primaries."""
    chosen: dict[str, str] = {}
    for i in range(1000):
        name = f"{prefix}{i}"
        primary = cluster().primary_of("{" + shard_tag(name) + "}")
        chosen.setdefault(primary.node_id, name)
        if len(chosen) == count:
            return sorted(chosen.values())
    raise AssertionError("could not spread shards over the primaries")


def primary_of_tag(tag: str) -> Node:
    return cluster().primary_of("{" + tag + "}")


class OnCluster:
    """Point the engine's role at the cluster for the test (the other roles stay on the test
    Redis), starting from an empty cluster."""

    def setUp(self) -> None:
        cluster().flush_all()
        self._engine_url = override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "ENGINE_URL": cluster().url})
        self._engine_url.enable()
        policy_invalidate()
        live.live_invalidate()
        super().setUp()  # type: ignore[misc]

    def tearDown(self) -> None:
        super().tearDown()  # type: ignore[misc]
        self._engine_url.disable()
        policy_invalidate()
        live.live_invalidate()


@tag("distributed", "cluster")
class EngineBehaviourOnClusterTests(test_engine_api.EngineBehaviour):
    """Every engine behaviour test, with the engine on the cluster (the tag lives on one of
    its primaries): multi-key admits, handoffs, fair order, leases, the clock, readiness."""

    def setUp(self) -> None:
        cluster().flush_all()
        super().setUp()
        self.e = Engine(connect(cluster().url))
        self.assertIsInstance(self.e.client, RedisCluster, "a cluster node is detected from its URL")
        # Management commands (engine_libraries) use the engine's role too.
        self._engine_url = override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "ENGINE_URL": cluster().url})
        self._engine_url.enable()
        self.addCleanup(self._engine_url.disable)


@tag("distributed", "cluster")
class ReservesOnClusterTests(test_engine_api.ReservesAndGuarantees):
    """The reserves and guarantees tests, with the engine on the cluster."""

    def setUp(self) -> None:
        cluster().flush_all()
        super().setUp()
        self.e = Engine(connect(cluster().url))
        self.assertIsInstance(self.e.client, RedisCluster)


@tag("distributed", "cluster")
class AdmitManyOnClusterTests(test_engine_batch.AdmitManyComparison, RedisTestCase):
    """A bulk's admits, one call per tag (lua/admit_jobs.lua), against the same admits one
    by one, with the runs' tags on different primaries (the pipeline split per node)."""

    def setUp(self) -> None:
        cluster().flush_all()
        super().setUp()
        self.client = connect(cluster().url)
        self.assertIsInstance(self.client, RedisCluster)
        self.e = Engine(self.client)


@tag("distributed", "cluster")
class ClusterEngineTests(OnCluster, RedisTestCase):
    def test_detection_needs_nothing_but_the_url_of_any_node(self) -> None:
        for node in cluster().nodes():
            self.assertIsInstance(connect(f"redis://127.0.0.1:{node.port}/0"), RedisCluster)
        self.assertIsInstance(engine().client, RedisCluster)
        self.assertIsInstance(connect(settings.REDIS_URL), redis.Redis)  # a plain server stays plain

    def test_three_shards_on_three_primaries_admit_release_and_sweep_across_nodes(self) -> None:
        names = shards_on_distinct_primaries()
        tags = [shard_tag(n) for n in names]
        self.assertEqual(len({primary_of_tag(t).node_id for t in tags}), SHARDS)
        e = engine()
        ports = [p.port for p in cluster().primaries()]
        for port in ports:
            cluster().client(port).config_resetstat()
        for t in tags:
            self.assertTrue(e.init_tag(tag=t))
        # Three keys per job (sub-tenant, tenant, shard) in one atomic call per job, every
        # tag's calls in one pipelined round trip.
        requests = [
            AdmitRequest(
                tag=t,
                job_id=f"{t}-{i}",
                keys=[KeyLimit("u:x", 1), KeyLimit(f"t:{t}", 2), KeyLimit(t, 10, f"f{i % 2}")],
                lease_seconds=60,
                data=f"d{i}",
                require_ready=True,
            )
            for t in tags
            for i in range(3)
        ]
        outcomes = e.admit_many(requests)
        # Keys are taken in canonical (sorted) order: the shard key, the tenant, the sub-tenant.
        self.assertEqual([o.parked_on for o in outcomes], [p for t in tags for p in (None, "u:x", f"t:{t}")])
        for t in tags:
            woken = e.release(tag=t, job_id=f"{t}-0").woken
            self.assertEqual([w.job_id for w in woken], [f"{t}-1"], "the handoff happens in the call, on its node")
            self.assertEqual(e.check_invariants(tag=t), [])
            state = e.inspect_key(tag=t, key="u:x")
            self.assertEqual((state.held, state.waiting), (1, 1))
        self.assertTrue(e.expire_now(tag=tags[0], job_id=f"{tags[0]}-1"))  # a transaction on one slot
        swept = e.sweep(tags)
        self.assertEqual([r.job_id for r in swept[tags[0]].reclaimed], [f"{tags[0]}-1"])
        self.assertEqual([w.job_id for w in swept[tags[0]].woken], [f"{tags[0]}-2"])
        self.assertEqual(e.ready_tags(tags), set(tags))
        self.assertEqual(e.tags_health(tags), dict.fromkeys(tags, TagHealth.READY))
        # Every tag's keys on its own primary, and FCALL routed by its KEYS: redis-py never
        # asked a server for the keys of a call (COMMAND GETKEYS), every primary ran calls.
        for t in tags:
            node = primary_of_tag(t)
            for kind in ("state", "leases"):
                self.assertEqual(cluster().client(node.port).exists(key_name("fq", t, kind)), 1, (t, kind))
        for port in ports:
            calls = {k: v["calls"] for k, v in cluster().client(port).info("commandstats").items()}
            self.assertNotIn("cmdstat_command|getkeys", calls, f"node {port}")
            self.assertGreater(calls.get("cmdstat_fcall", 0), 0, f"node {port} ran no engine call")

    def test_a_primary_that_lost_the_library_gets_it_on_first_use(self) -> None:
        names = shards_on_distinct_primaries()
        e = engine()
        e.init_tag(tag=shard_tag(names[0]))  # loads the library everywhere
        victim = primary_of_tag(shard_tag(names[1]))
        cluster().client(victim.port).function_flush()
        admitted = e.admit(tag=shard_tag(names[1]), job_id="j", keys={"k": 1}, lease_seconds=30)
        self.assertTrue(admitted.admitted)
        self.assertTrue(cluster().client(victim.port).function_list())

    def test_tag_health_is_ready_only_where_the_serving_server_marked_it(self) -> None:
        t = shard_tag(shards_on_distinct_primaries()[0])
        e = engine()
        self.assertEqual(e.tags_health([t]), {t: TagHealth.NOT_READY})
        e.init_tag(tag=t)
        self.assertEqual(e.tags_health([t]), {t: TagHealth.READY})
        redis_client().hset(key_name("fq", t, "state"), STAMP_FIELD, "another-server:another-history")
        self.assertEqual(e.tags_health([t]), {t: TagHealth.FOREIGN})
        self.assertEqual(e.reset_tag(tag=t), 1)  # its state (no call has needed the clock yet)
        self.assertEqual(e.tags_health([t]), {t: TagHealth.NOT_READY})

    def test_policy_is_written_and_read_in_one_slot_transactions(self) -> None:
        make_tenant("policed", max_concurrency=3, shard_name=shards_on_distinct_primaries()[0])
        result = policy_sync_all()  # WATCH + MULTI over every policy key, on the cluster
        self.assertEqual(result.tenants, 1)
        slots = {key_slot(k.encode()) for k in cluster().keys(f"{policy_keys.PREFIX}*")}
        self.assertEqual(len(slots), 1, "every policy key shares the {policy} hash tag")
        policy_invalidate()
        self.assertEqual(policy_snapshot().tenants["policed"].max_concurrency, 3)


@tag("distributed", "cluster")
class ClusterJobsEndToEndTests(OnCluster, E2EBase):
    def test_jobs_on_three_shards_on_three_primaries_run_once_within_their_limits(self) -> None:
        names = shards_on_distinct_primaries(prefix="e2e")
        keys = {name: make_tenant(f"t-{name}", max_concurrency=2, shard_name=name)[1] for name in names}
        ids: dict[str, list[str]] = {}
        with (
            WorkerProcess(slots=4, name="cl1", FAIRQUEUE_ENGINE_URL=cluster().url),
            WorkerProcess(slots=4, name="cl2", FAIRQUEUE_ENGINE_URL=cluster().url),
        ):
            for name, key in keys.items():
                ids[name] = [
                    str(self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.2}})["id"]) for _ in range(8)
                ]
            jobs = self.wait_all_finished([i for group in ids.values() for i in group], timeout=90)
        self.assertEqual({j.status for j in jobs}, {JobStatus.SUCCEEDED})
        self.assertEqual(LedgerEntry.objects.filter(job_id__in=[j.id for j in jobs], writes=1).count(), len(jobs))
        for name in names:
            runs = [(j.started_at, j.finished_at) for j in Job.objects.filter(id__in=ids[name])]
            self.assertLessEqual(max_overlap(runs), 2, f"tenant of shard {name} ran above its limit")
            tag_ = shard_tag(name)
            node = primary_of_tag(tag_)
            self.assertEqual(cluster().client(node.port).exists(key_name("fq", tag_, "state")), 1)
            self.assertEqual(engine().check_invariants(tag=tag_), [])
            wait_for(
                lambda t=tag_, n=name: engine().counts(tag=t, keys=[tenant_key(f"t-{n}")]) == {tenant_key(f"t-{n}"): 0},
                message="every slot given back",
            )
        self.assertEqual(len({primary_of_tag(shard_tag(n)).node_id for n in names}), SHARDS)


@tag("distributed", "cluster")
class ClusterRebuildTests(OnCluster, RedisTestCase):
    def test_a_primary_that_lost_its_data_has_its_shards_rebuilt_from_the_database(self) -> None:
        name = shards_on_distinct_primaries(prefix="lost")[0]
        tenant, _ = make_tenant("lost", max_concurrency=2, shard_name=name)
        with self.captureOnCommitCallbacks(execute=True):
            jobs = [r.job for r in job_submit_bulk(tenant=tenant, reqs=[JobRequest(task="demo.sleep", args=QUICK)] * 6)]
        Job.objects.filter(id=jobs[0].id).update(status=JobStatus.RUNNING)  # as if a worker had claimed it
        t = shard_tag(name)
        self.assertEqual(engine().tags_health([t]), {t: TagHealth.READY})
        primary = primary_of_tag(t)
        # The primary restarted empty and its replica followed it (no persistence): keys and
        # functions gone from both.
        cluster().client(primary.port).flushall()
        cluster().client(primary.port).function_flush()
        policy_invalidate()
        self.assertEqual(engine().tags_health([t]), {t: TagHealth.NOT_READY})
        self.assertIn(t, state_ensure())
        states = [engine().inspect_job(tag=t, job_id=j.engine_id).status for j in jobs]
        self.assertEqual(states, ["admitted", "admitted"] + ["parked"] * 4)
        self.assertEqual(engine().check_invariants(tag=t), [])
        self.assertEqual(engine().tags_health([t]), {t: TagHealth.READY})


@tag("distributed", "cluster")
class ClusterFailoverTests(OnCluster, RedisTestCase):
    def test_a_promoted_replica_that_missed_acknowledged_writes_is_detected_and_rebuilt(self) -> None:
        name = shards_on_distinct_primaries(prefix="fo")[0]
        tenant, _ = make_tenant("fo", floor=3, max_concurrency=3, shard_name=name)  # a limit of exactly 3
        t = shard_tag(name)
        submit = self.submitter(tenant)
        first, second = submit(), submit()  # admitted, and replicated
        cluster().wait_healthy()
        primary = primary_of_tag(t)
        replica = cluster().replicas_of(primary)[0]
        self.cut_replication(primary, replica)
        # Acknowledged by the primary, never replicated: two admissions, a park, then a
        # release that hands the parked job its slot.
        third, fourth, fifth = submit(), submit(), submit()
        self.assertEqual(
            [engine().inspect_job(tag=t, job_id=j.engine_id).status for j in (third, fourth, fifth)],
            ["admitted", "parked", "parked"],
        )
        Job.objects.filter(id=first.id).update(status=JobStatus.SUCCEEDED)
        job_release(tag=t, engine_id=first.engine_id, keys=first.engine_key_names)
        self.assertEqual(Job.objects.get(id=fourth.id).status, JobStatus.QUEUED, "woken by the release")
        started = time.monotonic()
        cluster().kill(primary.port)
        promoted, waited = cluster().wait_failover(primary)
        self.assertEqual(promoted.node_id, replica.node_id)
        cluster().client(replica.port).config_set("masterauth", "")
        health = wait_for(lambda: engine().tags_health([t]).get(t), timeout=30, message="the promoted replica")
        self.assertEqual(health, TagHealth.FOREIGN, "a replica's copy is not the state the primary acknowledged")
        foreign_at = time.monotonic()

        # What the replica lacks, against the database: the admissions of the third and
        # fourth job (the fourth was woken by a release), the park of the fifth, and the
        # release of the first, which the replica still holds.
        self.assertEqual(writes_lost(tag=t, shard=name), {"admissions": 2, "parks": 1, "releases": 1})
        self.assertIn(t, state_ensure())
        rebuilt_at = time.monotonic()
        status = {
            j.id: engine().inspect_job(tag=t, job_id=j.engine_id).status for j in Job.objects.filter(tenant=tenant)
        }
        self.assertEqual(
            [status[j.id] for j in (first, second, third, fourth, fifth)],
            ["unknown", "admitted", "admitted", "admitted", "parked"],
        )
        self.assertEqual(engine().check_invariants(tag=t), [])
        self.assertEqual(engine().tags_health([t]), {t: TagHealth.READY})
        stats.flush()
        counters = stats.stats_read()
        self.assertEqual(counters.get("foreign_rebuilds"), 1)
        self.assertEqual(counters.get("writes_lost:admissions"), 2)
        print(
            f"\n  failover: replica promoted {waited:.2f}s after the SIGKILL; tag read foreign "
            f"{foreign_at - started:.2f}s after it, rebuilt in {rebuilt_at - foreign_at:.2f}s"
        )
        cluster().restart(primary.port)  # rejoins as the new primary's replica
        cluster().wait_healthy()

    def submitter(self, tenant: Any) -> Any:
        def submit() -> Job:
            with self.captureOnCommitCallbacks(execute=True):
                job = job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args=QUICK)).job
            return Job.objects.get(id=job.id)

        return submit

    def cut_replication(self, primary: Node, replica: Node) -> None:
        """Stop the replica from receiving anything more: drop its link, and make its
        reconnection fail (it authenticates, the primary has no password)."""
        cluster().client(replica.port).config_set("masterauth", "no-such-password")
        cluster().client(primary.port).client_kill_filter(_type="replica")
        wait_for(
            lambda: cluster().client(replica.port).info("replication").get("master_link_status") == "down",
            timeout=10,
            message="the replica to lose its primary",
        )
