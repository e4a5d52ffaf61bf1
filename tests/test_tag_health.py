"""A tag's state is trusted only on the server that marked it ready: a single Redis restarted
from an older snapshot looks complete but lacks the writes made since, and is rebuilt from
the database (the same check catches a promoted replica: tests/test_cluster.py)."""

from __future__ import annotations

import tempfile

from django.test import override_settings

from fairqueue.engine import Engine, TagHealth
from fairqueue.engine.keys import STAMP_FIELD, key_name
from fairqueue.jobs.admission import shard_tag
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.recovery import state_ensure, writes_lost
from fairqueue.jobs.runtime import engine
from fairqueue.jobs.submission import JobRequest, job_submit
from tenants.policy import policy_invalidate
from tests.base import RedisTestCase
from tests.factories import make_tenant
from tests.redis_server import RedisServer

QUICK = {"seconds": 0.05}


class TagHealthTests(RedisTestCase):
    def test_a_tag_is_ready_where_it_was_marked_and_foreign_under_another_stamp(self) -> None:
        e = Engine(self.redis)  # a bytes client: the stamp compares as text
        self.assertEqual(e.tags_health(["s:h"]), {"s:h": TagHealth.NOT_READY})
        self.assertTrue(e.init_tag(tag="s:h"))
        self.assertEqual(e.tags_health(["s:h", "s:other"]), {"s:h": TagHealth.READY, "s:other": TagHealth.NOT_READY})
        self.redis.hset(key_name("fq", "s:h", "state"), STAMP_FIELD, "some-other-server:history")
        self.assertEqual(e.tags_health(["s:h"]), {"s:h": TagHealth.FOREIGN})
        self.assertEqual(e.reset_tag(tag="s:h"), 1)
        self.assertEqual(e.tags_health(["s:h"]), {"s:h": TagHealth.NOT_READY})

    def test_a_server_restarted_from_an_older_snapshot_is_detected_and_rebuilt(self) -> None:
        with tempfile.TemporaryDirectory() as data, RedisServer(data_dir=data) as server:
            with override_settings(REDIS_URL=server.url):
                policy_invalidate()
                tenant, _ = make_tenant("snap", floor=2, max_concurrency=2)
                t = shard_tag(tenant.shard.name)

                def submit() -> Job:
                    with self.captureOnCommitCallbacks(execute=True):
                        job = job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args=QUICK)).job
                    return Job.objects.get(id=job.id)

                first = submit()
                server.client().save()  # the snapshot the restart will load
                second, third = submit(), submit()  # acknowledged after it: lost
                self.assertEqual(engine().inspect_job(tag=t, job_id=third.engine_id).status, "parked")
                server.stop()
                server.start()
                self.assertEqual(engine().inspect_job(tag=t, job_id=first.engine_id).status, "admitted")
                self.assertEqual(engine().tags_health([t]), {t: TagHealth.FOREIGN})
                lost = writes_lost(tag=t, shard=tenant.shard.name)
                self.assertEqual(lost, {"admissions": 1, "parks": 1, "releases": 0})
                self.assertIn(t, state_ensure())
                states = [engine().inspect_job(tag=t, job_id=j.engine_id).status for j in (first, second, third)]
                self.assertEqual(states, ["admitted", "admitted", "parked"])
                self.assertEqual(engine().tags_health([t]), {t: TagHealth.READY})
                self.assertEqual(engine().check_invariants(tag=t), [])
            policy_invalidate()

    def test_on_the_server_that_marked_it_nothing_is_missing(self) -> None:
        tenant, _ = make_tenant("whole", floor=1, max_concurrency=1)
        with self.captureOnCommitCallbacks(execute=True):
            for _ in range(2):
                job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args=QUICK))
        t = shard_tag(tenant.shard.name)
        self.assertEqual(engine().tags_health([t]), {t: TagHealth.READY})
        self.assertEqual(writes_lost(tag=t, shard=tenant.shard.name), {"admissions": 0, "parks": 0, "releases": 0})
        self.assertEqual(sorted(Job.objects.values_list("status", flat=True)), [JobStatus.PARKED, JobStatus.QUEUED])
