"""Resource backpressure: a worker offers fewer slots under memory pressure and takes no
new job for the withdrawn ones, then grows back; the registry and `/metrics` show it."""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

from django.test import Client, SimpleTestCase

from dashboard.metrics import collector_register
from fairqueue.jobs.backpressure import Mark, SlotController, Thresholds
from fairqueue.jobs.fleet import REASON_KEY, WORKERS_KEY
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.resources import ResourceSample, ResourceSampler, cgroup_memory, pressure_read
from fairqueue.jobs.submission import JobRequest, job_submit
from tests import worker_tasks  # noqa: F401  (registers test.hog in this process, to submit it)
from tests.base import RedisTransactionTestCase
from tests.factories import make_tenant
from tests.test_metrics import samples
from tests.workers import WorkerProcess, wait_for

GIB = 1024**3
OFF = Mark(0.0, 0.0)


def sample(memory: float, *, psi_io: float = 0.0) -> ResourceSample:
    return ResourceSample(
        memory_used_bytes=int(memory * GIB),
        memory_limit_bytes=GIB,
        memory_source="rss",
        cpu=0.1,
        pressure={"io": psi_io},
    )


def thresholds(**overrides: object) -> Thresholds:
    fields: dict[str, object] = {
        "memory": Mark(0.8, 0.6),
        "cpu": OFF,
        "pressure": {"cpu": OFF, "memory": OFF, "io": Mark(0.5, 0.2)},
        "min_slots": 1,
        "step_seconds": 1.0,
        "recover_seconds": 5.0,
    }
    fields.update(overrides)
    return Thresholds(**fields)  # type: ignore[arg-type]


class SlotControllerTests(SimpleTestCase):
    def test_shrinks_to_what_runs_then_one_per_step_and_never_below_the_floor(self) -> None:
        c = SlotController(capacity=8, thresholds=thresholds())
        self.assertEqual(c.update(sample(0.5), running=6, now=0), 8)
        self.assertEqual(c.update(sample(0.85), running=6, now=1), 6)  # stop taking work at once
        self.assertEqual(c.signal, "memory")
        self.assertIn("memory", c.reason)
        self.assertEqual(c.update(sample(0.9), running=6, now=1.5), 6)  # one step per second
        self.assertEqual(c.update(sample(0.9), running=6, now=2), 5)
        for t in range(3, 20):
            c.update(sample(0.9), running=6, now=t)
        self.assertEqual(c.offered, 1)  # the floor: kombu's prefetch cannot go under one

    def test_holds_between_the_marks_and_grows_back_one_slot_per_calm_period(self) -> None:
        c = SlotController(capacity=4, thresholds=thresholds())
        c.update(sample(0.9), running=1, now=0)
        self.assertEqual(c.offered, 1)
        for t in range(1, 30):  # 0.7 is under the high mark but over the low one: hold
            c.update(sample(0.7), running=0, now=t)
        self.assertEqual(c.offered, 1)
        c.update(sample(0.5), running=0, now=30)  # calm from here
        c.update(sample(0.5), running=0, now=34)
        self.assertEqual(c.offered, 1)
        c.update(sample(0.5), running=0, now=35)
        self.assertEqual(c.offered, 2)
        self.assertIn("recovering", c.reason)
        c.update(sample(0.7), running=0, now=39)  # back in the band: the calm clock restarts
        c.update(sample(0.5), running=0, now=40)
        c.update(sample(0.5), running=0, now=44)
        self.assertEqual(c.offered, 2)
        for t in (45, 50, 55):
            c.update(sample(0.5), running=0, now=t)
        self.assertEqual(c.offered, 4)
        self.assertEqual((c.signal, c.reason), ("", ""))

    def test_a_pressure_stall_signal_shrinks_too_and_a_disabled_signal_never_does(self) -> None:
        c = SlotController(capacity=4, thresholds=thresholds())
        c.update(sample(0.1, psi_io=0.6), running=2, now=0)
        self.assertEqual((c.offered, c.signal), (2, "pressure_io"))
        off = SlotController(capacity=4, thresholds=thresholds(memory=OFF))
        off.update(sample(0.99), running=2, now=0)
        self.assertEqual(off.offered, 4)


class ResourceReadingTests(SimpleTestCase):
    def test_cgroup_v2_working_set_and_pressure_files(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            (d / "memory.max").write_text("1073741824\n")
            (d / "memory.current").write_text("900000000\n")
            (d / "memory.stat").write_text("anon 700000000\nfile 200000000\ninactive_file 150000000\n")
            self.assertEqual(cgroup_memory(d), (750_000_000, 1_073_741_824))
            (d / "memory.max").write_text("max\n")
            self.assertIsNone(cgroup_memory(d))  # no limit: the sampler falls back to RSS
            (d / "io").write_text(
                "some avg10=12.50 avg60=3.00 avg300=1.00 total=123\nfull avg10=1.00 avg60=0 avg300=0 total=9\n"
            )
            self.assertAlmostEqual(pressure_read("io", directory=d) or 0, 0.125)
            self.assertIsNone(pressure_read("cpu", directory=d))

    def test_the_sampler_reads_this_process(self) -> None:
        s = ResourceSampler(memory_limit_bytes=64 * GIB, detect_cgroup=False).sample()
        self.assertEqual(s.memory_source, "rss")
        self.assertGreater(s.memory_used_bytes, 10 * 1024 * 1024)
        self.assertEqual(s.memory_limit_bytes, 64 * GIB)


class WorkerBackpressureTests(RedisTransactionTestCase):
    """A real 4-slot worker process, a task that allocates memory past its threshold."""

    serialized_rollback = True  # the latency classes the migrations seed survive the flush

    LIMIT_BYTES = 1 * GIB
    HOG_MB = 700  # past the high mark (0.5 of the limit) on top of the worker's own ~150 MB

    def setUp(self) -> None:
        super().setUp()
        self.tenant, _ = make_tenant("acme", floor=8, max_concurrency=8)
        self.http = Client()

    def offered(self, hostname: str) -> int:
        return int(self.redis.hget(WORKERS_KEY, hostname) or -1)

    def reason(self, hostname: str) -> tuple[str, str]:
        signal, _, sentence = (self.redis.hget(REASON_KEY, hostname) or b"").decode().partition("\t")
        return signal, sentence

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        collector_register().invalidate()
        return samples(self.http.get("/metrics").content.decode())

    def submit(self, task: str, args: dict[str, object]) -> Job:
        return job_submit(tenant=self.tenant, req=JobRequest(task=task, args=args)).job

    def test_memory_pressure_withdraws_slots_and_they_come_back(self) -> None:
        worker = WorkerProcess(
            slots=4,
            name="bp",
            FAIRQUEUE_TASK_MODULES="tests.worker_tasks",
            FAIRQUEUE_WORKER_MEMORY_LIMIT_BYTES=str(self.LIMIT_BYTES),
            FAIRQUEUE_BACKPRESSURE_MEMORY_HIGH="0.5",
            FAIRQUEUE_BACKPRESSURE_MEMORY_LOW="0.4",
            FAIRQUEUE_BACKPRESSURE_RECOVER_SECONDS="1",
        )
        with worker:
            host = worker.hostname
            me = (("worker", host),)
            wait_for(lambda: self.offered(host) == 4, message="the worker offers its 4 slots")
            s = self.scrape()
            self.assertEqual(s[("fairqueue_worker_offered_slots", me)], 4)
            self.assertEqual(s[("fairqueue_worker_configured_slots", me)], 4)

            hold = f"test:hold:{uuid.uuid4().hex}"
            self.redis.set(hold, "1", ex=300)
            hog = self.submit("test.hog", {"megabytes": self.HOG_MB, "hold_key": hold})
            wait_for(lambda: self.offered(host) < 4, timeout=60, message="slots withdrawn under memory pressure")
            self.assertEqual(self.offered(host), 1)  # what it runs: the hog
            signal, reason = self.reason(host)
            self.assertEqual(signal, "memory")
            self.assertIn("memory", reason)
            s = self.scrape()
            self.assertEqual(s[("fairqueue_worker_offered_slots", me)], 1)
            self.assertEqual(s[("fairqueue_worker_backpressure", (("signal", "memory"), ("worker", host)))], 1)
            self.assertEqual(s[("fairqueue_worker_slots", ())], 1)  # the fleet's capacity as offered

            # Withdrawn slots take no job: these wait while the hog holds its memory.
            sleepers = [self.submit("demo.sleep", {"seconds": 0.1}) for _ in range(3)]
            time.sleep(3)  # ample for a free slot to pick them up (they start within ~0.1 s otherwise)
            started = Job.objects.filter(id__in=[j.id for j in sleepers], started_at__isnull=False).count()
            self.assertEqual(started, 0, "a worker under pressure took new work")
            self.assertEqual(self.offered(host), 1)

            self.redis.delete(hold)  # the hog frees its memory and finishes
            wait_for(
                lambda: Job.objects.get(id=hog.id).status == JobStatus.SUCCEEDED, timeout=60, message="hog finished"
            )
            wait_for(lambda: self.offered(host) == 4, timeout=60, message="slots offered again")
            wait_for(
                lambda: Job.objects.filter(id__in=[j.id for j in sleepers], status=JobStatus.SUCCEEDED).count() == 3,
                timeout=60,
                message="the waiting jobs ran once pressure eased",
            )
            self.assertEqual(self.reason(host), ("", ""))
            s = self.scrape()
            self.assertEqual(s[("fairqueue_worker_offered_slots", me)], 4)
            self.assertEqual(s[("fairqueue_worker_backpressure", (("signal", "none"), ("worker", host)))], 0)
