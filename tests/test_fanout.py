"""Fan-out on the real stack (real Redis, real Celery workers): a document's pages run as
child jobs under its document key, capped at its fan-out, joined exactly once by a
continuation that runs after the last page, without the document holding a slot."""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.test import Client, override_settings

from dashboard.metrics import collector_register
from dashboard.picture import picture_make
from dashboard.snapshot import snapshot_build
from fairqueue.jobs.models import JOIN_INDEX, Job, JobStatus, LedgerEntry
from fairqueue.jobs.recovery import state_ensure
from tenants.models import Shard, Tenant
from tenants.policy import policy_invalidate
from tests import fanout_tasks
from tests.base import RedisTransactionTestCase
from tests.factories import quarantine_lane_off
from tests.workers import WorkerProcess, kill_all_workers, wait_for

TASKS = {"FAIRQUEUE_TASK_MODULES": fanout_tasks.__name__}


def _tenant(slug: str, **fields: object) -> tuple[Tenant, str]:
    shard, _ = Shard.objects.get_or_create(name="default", defaults={"capacity": 100})
    tenant = Tenant(slug=slug, name=slug.title(), shard=shard, **fields)
    key = tenant.rotate_api_key()
    tenant.save()
    return tenant, key


def max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def _page_intervals(parent_id: object) -> list[tuple[datetime, datetime]]:
    """The pages' own clocks (their results), not the scheduler's bookkeeping."""
    pages = Job.objects.filter(parent_id=parent_id, child_index__gte=0, status=JobStatus.SUCCEEDED)
    return [(datetime.fromisoformat(p.result["started"]), datetime.fromisoformat(p.result["finished"])) for p in pages]


class FanOutBase(RedisTransactionTestCase):
    serialized_rollback = True

    def setUp(self) -> None:
        super().setUp()
        policy_invalidate()
        self.client = Client()

    def tearDown(self) -> None:
        kill_all_workers()
        super().tearDown()

    def submit(self, key: str, body: dict[str, object]) -> dict[str, Any]:
        resp = self.client.post(
            "/api/v1/jobs", json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
        )
        self.assertIn(resp.status_code, (200, 202), resp.content)
        return resp.json()  # type: ignore[no-any-return]

    def get(self, key: str, path: str) -> dict[str, Any]:
        resp = self.client.get(f"/api/v1/{path}", HTTP_AUTHORIZATION=f"Bearer {key}")
        self.assertEqual(resp.status_code, 200, resp.content)
        return resp.json()  # type: ignore[no-any-return]

    def document(self, key: str, pages: int, seconds: float, **extra: object) -> str:
        args = {"pages": pages, "seconds_per_page": seconds, **extra}
        return str(self.submit(key, {"task": "demo.document", "args": args})["id"])

    def wait_finished(self, job_id: str, timeout: float = 60) -> Job:
        def done() -> Job | None:
            job = Job.objects.get(id=job_id)
            return job if job.finished_at is not None else None

        try:
            return wait_for(done, timeout=timeout, message=f"job {job_id} to finish")  # type: ignore[no-any-return]
        except AssertionError as exc:  # say where the document stands, for the next reader
            family = Job.objects.filter(Q(id=job_id) | Q(parent_id=job_id)).order_by("child_index")
            where = [(j.child_index, j.status, j.generation, j.worker, j.engine_keys, j.timeline) for j in family]
            raise AssertionError(f"{exc}: {where}") from exc


class FanOutTests(FanOutBase):
    def test_a_document_runs_its_pages_under_its_cap_and_joins_once(self) -> None:
        _, key = _tenant("docs", max_fan_out=2)
        with WorkerProcess(slots=6):
            doc = self.document(key, pages=8, seconds=0.3)
            parent = self.wait_finished(doc)
        self.assertEqual(parent.status, JobStatus.SUCCEEDED, parent.error)
        self.assertEqual(parent.result, {"pages": 8})
        pages = Job.objects.filter(parent_id=doc, child_index__gte=0)
        self.assertEqual(sorted(p.child_index for p in pages), list(range(8)))
        self.assertTrue(all(p.tenant_id == parent.tenant_id for p in pages))
        self.assertEqual(max_overlap(_page_intervals(doc)), 2)  # six slots, the cap of two
        join = Job.objects.get(parent_id=doc, child_index=JOIN_INDEX)
        self.assertEqual(join.status, JobStatus.SUCCEEDED)
        self.assertGreaterEqual(join.started_at, max(p.finished_at for p in pages))
        self.assertEqual(LedgerEntry.objects.get(job_id=join.id).writes, 1)
        self.assertEqual(LedgerEntry.objects.filter(task="demo.page", job_id__in=[p.id for p in pages]).count(), 8)
        # The document's own run ended before its pages did: it awaited them holding no slot.
        self.assertIn("awaiting", parent.timeline)

    def test_the_call_may_lower_the_cap_never_raise_it(self) -> None:
        _, key = _tenant("lower", max_fan_out=3)
        with WorkerProcess(slots=6):
            low = self.document(key, pages=6, seconds=0.3, max_fan_out=1)
            high = self.document(key, pages=6, seconds=0.3, max_fan_out=50)
            self.wait_finished(low)
            self.wait_finished(high)
        self.assertEqual(max_overlap(_page_intervals(low)), 1)
        self.assertEqual(max_overlap(_page_intervals(high)), 3)
        self.assertEqual({p.fan_out_cap for p in Job.objects.filter(parent_id=high, child_index__gte=0)}, {3})

    def test_failed_pages_are_named_to_the_continuation_and_fail_the_document(self) -> None:
        _, key = _tenant("flaky")
        with WorkerProcess(slots=4):
            doc = self.document(key, pages=5, seconds=0.05, fail_pages=[1, 3])
            parent = self.wait_finished(doc)
        self.assertEqual(parent.status, JobStatus.FAILED)
        self.assertIn("2 of 5 pages failed: [1, 3]", parent.error)
        join = Job.objects.get(parent_id=doc, child_index=JOIN_INDEX)
        self.assertEqual(join.args["failed"], [1, 3])

    def test_one_tenant_limit_of_one_cannot_deadlock_on_parents(self) -> None:
        # The documents' own runs end before their pages run: with a tenant limit of one,
        # a waiting parent holding its slot would starve its own pages for ever.
        _, key = _tenant("tight", max_concurrency=1, floor=1)
        with WorkerProcess(slots=2):
            docs = [self.document(key, pages=3, seconds=0.05) for _ in range(3)]
            finished = [self.wait_finished(d) for d in docs]
        self.assertEqual([j.status for j in finished], [JobStatus.SUCCEEDED] * 3)
        self.assertEqual([j.result for j in finished], [{"pages": 3}] * 3)


class FanOutRetryTests(FanOutBase):
    def test_a_failed_page_follows_its_retry_policy_and_the_join_sees_only_final_failures(self) -> None:
        _, key = _tenant("retries", max_fan_out=4)
        with WorkerProcess(slots=4, **TASKS):
            body = {"task": "tests.flaky_document", "args": {"fail_times": [0, 2, 0, 0], "permanent": [3]}}
            doc = self.submit(key, body)["id"]
            parent = self.wait_finished(doc, timeout=60)
        self.assertEqual(parent.status, JobStatus.SUCCEEDED, parent.error)
        # Page 1 failed twice and then succeeded (retried, not failed); page 3 failed for good.
        self.assertEqual(parent.result, {"failed": [3], "statuses": ["succeeded", "succeeded", "succeeded", "failed"]})
        retried = Job.objects.get(parent_id=doc, child_index=1)
        self.assertEqual((retried.status, retried.attempts), (JobStatus.SUCCEEDED, 3))
        self.assertEqual(Job.objects.filter(parent_id=doc, child_index=JOIN_INDEX).count(), 1)


class FanOutCancelTests(FanOutBase):
    def test_cancelling_a_document_cancels_its_pages_not_started(self) -> None:
        _, key = _tenant("cancel", max_fan_out=1)
        with WorkerProcess(slots=2):
            doc = self.document(key, pages=6, seconds=1.0)
            wait_for(
                lambda: (
                    Job.objects.get(id=doc).status == JobStatus.AWAITING
                    and Job.objects.filter(parent_id=doc, status=JobStatus.RUNNING).exists()
                ),
                message="document awaiting, a page running",
            )
            resp = self.client.post(f"/api/v1/jobs/{doc}/cancel", HTTP_AUTHORIZATION=f"Bearer {key}")
            self.assertEqual(resp.status_code, 200, resp.content)
            self.assertEqual(resp.json()["status"], "cancelled")
            wait_for(
                lambda: not Job.objects.filter(parent_id=doc, finished_at__isnull=True).exists(),
                message="pages to end",
            )
            time.sleep(0.5)  # a join would come now, if one were (wrongly) submitted
        pages = Job.objects.filter(parent_id=doc, child_index__gte=0)
        statuses = sorted(p.status for p in pages)
        self.assertEqual(statuses.count(JobStatus.CANCELLED), 5, statuses)  # all but the one running
        self.assertEqual(statuses.count(JobStatus.SUCCEEDED), 1, statuses)
        self.assertFalse(Job.objects.filter(parent_id=doc, child_index=JOIN_INDEX).exists())
        self.assertEqual(Job.objects.get(id=doc).status, JobStatus.CANCELLED)


class FanOutWorkerLossTests(FanOutBase):
    def setUp(self) -> None:
        super().setUp()
        quarantine_lane_off()  # a page or parent whose worker died runs again on the survivor

    def test_a_parent_re_delivered_after_submitting_submits_no_page_twice(self) -> None:
        _, key = _tenant("redeliver", max_fan_out=2)
        state_ensure()
        lease = {"FAIRQUEUE_LEASE_SECONDS": "2"}
        with override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "LEASE_SECONDS": 2.0}):
            victim = WorkerProcess(slots=1, name="victim", **TASKS, **lease).start()
            # A document whose own run is slow after submitting: killed then, it is re-run.
            doc = self.submit(key, {"task": "tests.slow_document", "args": {"pages": 4, "linger": 30}})["id"]
            wait_for(lambda: Job.objects.filter(parent_id=doc).count() == 4, message="pages submitted")
            victim.kill()
            with WorkerProcess(slots=3, name="survivor", **TASKS, **lease):
                parent = self.wait_finished(doc, timeout=60)
        self.assertEqual(parent.status, JobStatus.SUCCEEDED, parent.error)
        self.assertGreaterEqual(parent.attempts, 2)
        self.assertEqual(Job.objects.filter(parent_id=doc, child_index__gte=0).count(), 4)
        self.assertEqual(Job.objects.filter(parent_id=doc, child_index=JOIN_INDEX).count(), 1)
        self.assertEqual(parent.result, {"pages": 4})
        pages = Job.objects.filter(parent_id=doc, child_index__gte=0)
        self.assertEqual([e.writes for e in LedgerEntry.objects.filter(job_id__in=[p.id for p in pages])], [1] * 4)

    def test_the_cap_holds_when_a_worker_dies_under_a_page(self) -> None:
        _, key = _tenant("killcap", max_fan_out=2)
        state_ensure()
        lease = {"FAIRQUEUE_LEASE_SECONDS": "2"}
        with override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "LEASE_SECONDS": 2.0}):
            victim = WorkerProcess(slots=2, name="victim", **lease).start()
            doc = self.document(key, pages=6, seconds=1.0)
            wait_for(
                lambda: Job.objects.filter(parent_id=doc, status="running", worker__startswith="victim").exists(),
                message="a page running on the victim",
            )
            victim.kill()
            with WorkerProcess(slots=6, name="survivor", **lease):
                parent = self.wait_finished(doc, timeout=90)
        self.assertEqual(parent.status, JobStatus.SUCCEEDED, parent.error)
        # The killed pages' runs never finished, so their clocks are not in the results:
        # each succeeded page's own run, plus the survivor's re-runs, never exceed the cap.
        self.assertLessEqual(max_overlap(_page_intervals(doc)), 2)
        self.assertEqual(Job.objects.filter(parent_id=doc, child_index=JOIN_INDEX).count(), 1)
        self.assertEqual(parent.result, {"pages": 6})


class FanOutApiTests(FanOutBase):
    def test_the_api_shows_parents_children_and_the_document_key_a_page_waits_on(self) -> None:
        _, key = _tenant("rest", max_fan_out=1)
        with WorkerProcess(slots=4):
            doc = self.document(key, pages=5, seconds=0.6)
            wait_for(
                lambda: Job.objects.filter(parent_id=doc, status=JobStatus.PARKED).count() >= 3,
                message="pages parked on their document key",
            )
            parked = Job.objects.filter(parent_id=doc, status=JobStatus.PARKED).order_by("child_index").last()
            assert parked is not None
            page = self.get(key, f"jobs/{parked.id}")
            self.assertEqual(page["parent_id"], doc)
            self.assertIsNone(page["children"])
            self.assertEqual(page["waiting_on"]["key"], f"1:d:{doc}")
            self.assertEqual(page["waiting_on"]["document"], doc)
            self.assertEqual(page["waiting_on"]["limit"], 1)
            running = self.get(key, f"jobs/{doc}")
            self.assertEqual(running["status"], "awaiting")
            self.assertEqual(running["children"]["total"], 5)
            self.assertEqual(running["children"]["running"], 1)
            self.assertEqual(running["children"]["waiting"] + running["children"]["succeeded"], 4)
            self.wait_finished(doc)
        done = self.get(key, f"jobs/{doc}")
        self.assertEqual(done["status"], "succeeded")
        self.assertEqual(done["result"], {"pages": 5})
        self.assertIsNone(done["parent_id"])
        self.assertEqual(done["children"], {"total": 5, "waiting": 0, "running": 0, "succeeded": 5, "failed": 0})
        # The list by parent: its five pages and its continuation, two a page by the cursor.
        seen: list[str] = []
        path = f"jobs?parent_id={doc}&limit=2"
        while True:
            page_of = self.get(key, path)
            self.assertLessEqual(len(page_of["items"]), 2)
            seen += [item["id"] for item in page_of["items"]]
            self.assertTrue(all(item["parent_id"] == doc for item in page_of["items"]))
            if not page_of["has_more"]:
                break
            path = f"jobs?parent_id={doc}&limit=2&cursor={page_of['next']}"
        self.assertEqual(sorted(seen), sorted(str(j.id) for j in Job.objects.filter(parent_id=doc)))
        self.assertEqual(len(seen), 6)
        self.assertEqual(self.get(key, "jobs?status=awaiting")["items"], [])
        bad = self.client.get("/api/v1/jobs?parent_id=not-a-uuid", HTTP_AUTHORIZATION=f"Bearer {key}")
        self.assertEqual(bad.status_code, 400, bad.content)
        # Another tenant's document lists nothing of it.
        _, other = _tenant("other")
        self.assertEqual(self.get(other, f"jobs?parent_id={doc}")["items"], [])


class FanOutFairnessTests(FanOutBase):
    def test_a_large_document_delays_the_tenants_one_page_documents_by_about_one_page(self) -> None:
        # The tenant runs two jobs at once; its large document may run 20 (its cap binds
        # nowhere), so 18 of its pages wait at the tenant's key: were they one FIFO queue
        # there with the tenant's other jobs, a one-page document would wait for them all.
        _, key = _tenant("fair", max_concurrency=2, max_fan_out=20)
        with WorkerProcess(slots=4):
            big = self.document(key, pages=60, seconds=0.2)
            wait_for(
                lambda: Job.objects.filter(parent_id=big, status=JobStatus.PARKED).count() >= 40,
                message="the large document's backlog",
            )
            small = []
            for _ in range(3):
                small.append(self.document(key, pages=1, seconds=0.2))
                time.sleep(0.7)
            finished = [self.wait_finished(doc, timeout=60) for doc in small]
            backlog = Job.objects.filter(parent_id=big, child_index__gte=0, finished_at__isnull=True).count()
            self.wait_finished(big, timeout=120)
        self.assertEqual([j.result for j in finished], [{"pages": 1}] * 3)
        self.assertGreater(backlog, 10, "the large document still had a backlog when the small ones were done")
        big_pages = list(Job.objects.filter(parent_id=big, child_index__gte=0))
        for doc in small:
            page = Job.objects.get(parent_id=doc, child_index=0)
            ahead = [p for p in big_pages if page.submitted_at < p.started_at < page.started_at]
            # Each of the two slots may start one page of the large document first (equal
            # fair-order tags go to the flow that began to wait first), and one more may be
            # admitted between the page's submit and its admission; not its backlog.
            self.assertLessEqual(len(ahead), 3, f"{len(ahead)} large-document pages started first")


class FanOutDashboardTests(FanOutBase):
    def test_the_snapshot_and_metrics_show_documents_in_flight_and_their_fan_out(self) -> None:
        _, key = _tenant("dash", max_fan_out=2)
        with WorkerProcess(slots=6):
            doc = self.document(key, pages=8, seconds=0.8)

            def busy() -> dict[str, Any] | None:
                view = snapshot_build(with_history=False)["documents"]
                row = view["tenants"].get("dash")
                return view if row and row["running"] == 2 else None

            view = wait_for(busy, message="the document running two pages in the snapshot")
            self.assertEqual(view["in_flight"], 1)
            self.assertEqual(view["tenants"]["dash"], {"documents": 1, "children": 8, "running": 2, "max_running": 2})
            self.assertEqual(view["top"], [{"id": doc, "tenant": "dash", "children": 8, "cap": 2, "running": 2}])
            picture = picture_make(snapshot_build(with_history=False), top_n=5, watched=())
            self.assertEqual(picture["documents"]["top"][0]["id"], doc)
            collector_register().invalidate()
            text = self.client.get("/metrics").content.decode()
            self.assertIn('fairqueue_tenant_documents_in_flight{tenant="dash"} 1.0', text)
            self.assertRegex(text, r'fairqueue_tenant_fan_out_max\{tenant="dash"\} [12]\.0')
            self.wait_finished(doc)
        self.assertEqual(snapshot_build(with_history=False)["documents"]["in_flight"], 0)


class ContinuationSubmitTests(FanOutBase):
    def test_a_continuation_task_cannot_be_submitted_by_itself(self) -> None:
        _, key = _tenant("sneaky")
        body = {"task": "demo.document_join", "args": {"parent_id": "x", "children": [], "failed": []}}
        resp = self.client.post(
            "/api/v1/jobs", json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
        )
        self.assertEqual(resp.status_code, 400, resp.content)
        self.assertEqual(resp.json()["error"]["code"], "continuation_task")
        self.assertFalse(Job.objects.exists())
