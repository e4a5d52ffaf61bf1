"""`bench parked-memory` (fairqueue.bench.parked_memory) runs and reports its figures: the
bytes per parked job and their split by structure, on a private redis-server."""

from __future__ import annotations

from django.test import SimpleTestCase

from fairqueue.bench import parked_memory


class ParkedMemoryBenchTests(SimpleTestCase):
    def test_a_quick_run_reports_bytes_per_parked_job_by_structure(self) -> None:
        result = parked_memory.run_command({"quick": True}, log=lambda _: None)
        self.assertEqual(result["parked"], parked_memory.PARKED["quick"])
        parts = result["bytes_by_structure"]
        self.assertEqual(set(parts), {"wait_entry", "job_record", "flow_records", "cells"})
        for name in ("wait_entry", "job_record", "cells"):
            self.assertGreater(parts[name], 20, parts)  # each holds at least the job's id
        # The structures account for most of the server's growth (the rest: the allocator).
        self.assertLessEqual(result["structures_sum"], result["bytes_per_parked_job"] * 1.1, result)
        self.assertGreater(result["structures_sum"], result["bytes_per_parked_job"] * 0.7, result)
        self.assertEqual(result["meets_target"], result["bytes_per_parked_job"] <= parked_memory.TARGET_BYTES)
