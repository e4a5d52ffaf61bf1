"""Fairness where a key shared by several tenants binds (issue 16), on the real stack."""

from __future__ import annotations

import time

from fairqueue.jobs.models import Job
from tests.factories import make_tenant
from tests.test_jobs_e2e import E2EBase
from tests.workers import WorkerProcess

FLOOD_JOBS = 60
JOB_SECONDS = 0.5
LATE_JOBS = 4
LATE_AFTER_SECONDS = 2.0
LATE_EVERY_SECONDS = 0.5
START_WITHIN_SECONDS = 1.0


class SharedShardTests(E2EBase):
    def bulk(self, key: str, jobs: list[dict[str, object]]) -> list[str]:
        resp = self.client.post(
            "/api/v1/jobs/bulk", {"jobs": jobs}, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
        )
        self.assertEqual(resp.status_code, 202, resp.content)
        return [j["id"] for j in resp.json()]

    def test_a_flood_at_a_shared_shard_does_not_delay_a_shard_mate(self) -> None:
        # Two tenants on one shard of capacity 2, one worker of 8 slots: the shard binds.
        _, flood_key = make_tenant("flood", shard_name="busy", shard_capacity=2)
        _, mate_key = make_tenant("mate", shard_name="busy")
        sleep = {"task": "demo.sleep", "args": {"seconds": JOB_SECONDS}}
        with WorkerProcess(slots=8):
            self.bulk(flood_key, [sleep] * FLOOD_JOBS)
            time.sleep(LATE_AFTER_SECONDS)
            late = []
            for _ in range(LATE_JOBS):
                late.append(self.submit(mate_key, sleep)["id"])
                time.sleep(LATE_EVERY_SECONDS)
            jobs = self.wait_all_finished(late, timeout=60)
        waits = sorted((j.started_at - j.submitted_at).total_seconds() for j in jobs)
        self.assertLess(waits[-1], START_WITHIN_SECONDS, waits)

    def test_splitting_work_over_a_thousand_sub_tenants_gains_nothing_at_the_shard(self) -> None:
        _, split_key = make_tenant("splitter", shard_name="shared", shard_capacity=2)
        _, whole_key = make_tenant("whole", shard_name="shared")
        short = {"seconds": 0.2}
        with WorkerProcess(slots=8):
            split = self.bulk(
                split_key, [{"task": "demo.sleep", "args": short, "sub_tenant": f"c{i}"} for i in range(1000)]
            )
            whole = self.bulk(whole_key, [{"task": "demo.sleep", "args": short}] * 40)
            self.wait_all_finished(whole, timeout=120)
        # While both had work waiting, the shard served them alike: from the moment the tenant
        # that did not split submitted until it had finished its 40, the splitter did not start
        # many more than 40. (Counted from that moment, not from the splitter's own bulk: the
        # time between the two bulks is the splitter's alone, and grows on a loaded machine.)
        whole_jobs = Job.objects.filter(id__in=whole)
        arrived_at = min(whole_jobs.values_list("submitted_at", flat=True))
        done_at = max(whole_jobs.values_list("finished_at", flat=True))
        started_split = Job.objects.filter(id__in=split, started_at__gte=arrived_at, started_at__lte=done_at).count()
        self.assertLessEqual(started_split, 40 + 4, "splitting must not buy a bigger share of the shard")
        self.assertGreaterEqual(started_split, 40 - 4, "nor a smaller one")
