"""A floor a tenant can count on when jobs are long (issue 41), on the real stack: the
broker never holds an admitted backlog, a steady tenant's jobs are served before a flood's
next round, and with floor headroom its first job starts at once."""

from __future__ import annotations

import time

from django.test import SimpleTestCase

from fairqueue.jobs.admission import flood_utilisation, flow_weight, pool_room
from fairqueue.jobs.models import Job, JobStatus
from tenants.models import PoolSettings
from tenants.sync import policy_sync_all
from tests.factories import make_tenant
from tests.test_jobs_e2e import E2EBase
from tests.workers import WorkerProcess, wait_for

SLOTS = 8
FLOOD_JOBS = 40
FLOOD_JOB_SECONDS = 20.0
STEADY_JOBS = 5
STEADY_AFTER_SECONDS = 3.0
STEADY_EVERY_SECONDS = 1.0
STEADY_JOB = {"task": "demo.sleep", "args": {"seconds": 0.2}}
# The bound with headroom: the steady tenant's first job starts within a second.
FIRST_JOB_WITHIN_SECONDS = 1.0


class PoolRoomTests(SimpleTestCase):
    def test_the_pool_room_is_the_live_slots_less_what_other_shards_hold(self) -> None:
        self.assertEqual(pool_room(slots=8, held_by_shard={"a": 3, "b": 2}, shard="a", margin=0), 6)
        self.assertEqual(pool_room(slots=8, held_by_shard={"a": 3, "b": 9}, shard="a", margin=0), 0)
        self.assertEqual(pool_room(slots=8, held_by_shard={}, shard="a", margin=1), 9)
        # No worker registered: nothing to count, no cap (the tenants' limits bound it).
        self.assertIsNone(pool_room(slots=0, held_by_shard={"a": 3}, shard="a"))

    def test_weights_share_slot_seconds_and_the_headroom_costs_its_share(self) -> None:
        # Equal floors: a tenant of 20 s jobs weighs a hundredth of one of 0.2 s jobs.
        self.assertAlmostEqual(flow_weight(2, 0.2) / flow_weight(2, 20.0), 100.0)
        self.assertAlmostEqual(flow_weight(4, 1.0) / flow_weight(2, 1.0), 2.0)
        self.assertEqual(flow_weight(0, 1.0), flow_weight(1, 1.0))  # a floor of 0 still gets served
        self.assertEqual(flood_utilisation(slots=16, headroom=2), 14 / 16)
        self.assertEqual(flood_utilisation(slots=0, headroom=2), 1.0)


class FloorUnderLongJobsTests(E2EBase):
    """The issue's scenario: one worker of 8 slots; N (floor 2) sends 40 jobs of 20 s in one
    bulk; 3 s later S (floor 2, idle until then) sends 5 jobs of 0.2 s, one a second."""

    def bulk(self, key: str, jobs: list[dict[str, object]]) -> list[dict[str, object]]:
        resp = self.client.post(
            "/api/v1/jobs/bulk", {"jobs": jobs}, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
        )
        self.assertEqual(resp.status_code, 202, resp.content)
        return list(resp.json())

    def headroom_set(self, slots: int) -> None:
        pool = PoolSettings.load()
        pool.floor_headroom = slots
        pool.save()
        policy_sync_all()

    def flood_then_steady(self) -> tuple[list[dict[str, object]], list[float]]:
        _, noisy_key = make_tenant("noisy", floor=2)
        _, steady_key = make_tenant("steady", floor=2)
        with WorkerProcess(slots=SLOTS):
            # The fleet's slots are known before the flood (as in a running deployment).
            wait_for(
                lambda: (
                    self.client.get("/api/v1/limits", HTTP_AUTHORIZATION=f"Bearer {noisy_key}").json()["pool"]["slots"]
                    == SLOTS
                ),
                timeout=30,
            )
            flood = self.bulk(noisy_key, [{"task": "demo.sleep", "args": {"seconds": FLOOD_JOB_SECONDS}}] * FLOOD_JOBS)
            time.sleep(STEADY_AFTER_SECONDS)
            steady = []
            for _ in range(STEADY_JOBS):
                steady.append(self.submit(steady_key, STEADY_JOB)["id"])
                time.sleep(STEADY_EVERY_SECONDS)
            jobs = self.wait_all_finished(steady, timeout=3 * FLOOD_JOB_SECONDS)
            # The flood is not this test's business any more: cancel what waits.
            Job.objects.filter(tenant__slug="noisy", status=JobStatus.PARKED).update(status=JobStatus.CANCELLED)
        by_submit = sorted(jobs, key=lambda j: j.submitted_at)
        return flood, [(j.started_at - j.submitted_at).total_seconds() for j in by_submit]

    def test_the_broker_holds_no_backlog_and_a_steady_tenant_waits_at_most_one_round(self) -> None:
        flood, waits = self.flood_then_steady()
        # Admitted at once: no more jobs than the slots that exist; the rest park, in fair order.
        admitted = [j for j in flood if j["status"] == "queued"]
        self.assertLessEqual(len(admitted), SLOTS)
        self.assertEqual(len(flood) - len(admitted), sum(j["status"] == "parked" for j in flood))
        # Without headroom: the steady tenant's jobs start when the first of the flood's
        # jobs end, before its next round: never two rounds.
        self.assertLess(max(waits), FLOOD_JOB_SECONDS + STEADY_AFTER_SECONDS, waits)

    def test_with_headroom_a_steady_tenants_first_job_starts_at_once(self) -> None:
        self.headroom_set(2)
        _, waits = self.flood_then_steady()
        self.assertLessEqual(waits[0], FIRST_JOB_WITHIN_SECONDS, waits)
        # And every one of its jobs, one a second, finds a kept slot.
        self.assertLessEqual(max(waits), FIRST_JOB_WITHIN_SECONDS, waits)
