"""A worker fences itself when it cannot confirm its holds: each running job's hold counts
as lost once FENCE_FRACTION of a lease passes without a confirmed renewal, before the
engine could reclaim it. Real Redis; a second Redis URL where nothing listens is the
partition. The multi-host version (network namespaces) is distributed_tests/test_hosts.py.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.test import override_settings

from fairqueue.engine import KeyLimit
from fairqueue.jobs.leases import FENCE_FRACTION, ActiveLeases
from fairqueue.jobs.registry import HoldLost, JobContext
from fairqueue.jobs.runtime import engine
from tests.base import RedisTestCase
from tests.workers import wait_for

DEAD_REDIS = "redis://127.0.0.1:1/15"  # nothing listens on port 1: a real connection failure
LEASE_SECONDS = 0.9
TAG = "fence"


def _fairqueue(lease: float) -> dict[str, object]:
    return {**settings.FAIRQUEUE, "LEASE_SECONDS": lease}


class FencingTests(RedisTestCase):
    def admitted(self, job_id: str) -> None:
        result = engine().admit(tag=TAG, job_id=job_id, keys=[KeyLimit("k", 10)], lease_seconds=LEASE_SECONDS)
        self.assertTrue(result.admitted)

    def test_a_hold_renewed_in_time_stays_valid_past_several_leases(self) -> None:
        self.admitted("kept")
        with override_settings(FAIRQUEUE=_fairqueue(LEASE_SECONDS)):
            leases = ActiveLeases()
            leases.add("kept", TAG)
            time.sleep(3 * LEASE_SECONDS)
            self.assertFalse(leases.hold_lost("kept"))
            self.assertFalse(leases.fenced())
            self.assertFalse(leases.remove("kept"))

    def test_a_hold_that_cannot_be_renewed_is_fenced_before_its_lease_ends(self) -> None:
        self.admitted("cut")
        with override_settings(FAIRQUEUE=_fairqueue(LEASE_SECONDS)):
            leases = ActiveLeases()
            started = time.monotonic()
            leases.add("cut", TAG)
            ctx = JobContext(job_id="cut", attempt=1, worker="w", generation=1).bind_hold(
                lambda: leases.hold_lost("cut")
            )
            ctx.check_hold()  # valid right after the claim
            with override_settings(REDIS_URL=DEAD_REDIS):  # the partition: renewals fail
                wait_for(ctx.hold_lost, timeout=10, message="the hold to be fenced")
                fenced_after = time.monotonic() - started
                self.assertTrue(leases.fenced(), "a fenced worker takes no new job")
                with self.assertRaises(HoldLost):
                    ctx.check_hold()
            # Fenced no earlier than its fraction of the lease, and before the lease ends
            # (with the renewer's interval as slack on this shared machine).
            self.assertGreaterEqual(fenced_after, LEASE_SECONDS * FENCE_FRACTION)
            self.assertTrue(leases.remove("cut"), "the finish learns the hold was lost")
            self.assertFalse(leases.fenced())
