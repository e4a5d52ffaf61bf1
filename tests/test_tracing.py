"""Tracing (fairqueue.tracing): one trace per job across the web process, the engine and a
real worker process, exported over real OTLP/HTTP to a receiver in the test (its spans are
what a collector would get); tracing off imports nothing of the SDK; the job's timeline on
its own row and in the admin."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from asgiref.sync import async_to_sync
from django.conf import settings
from django.contrib.auth.models import User
from django.http.response import HttpResponseBase
from django.test import AsyncClient, Client, SimpleTestCase, override_settings
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

from fairqueue import tracing
from fairqueue.jobs import timeline as tl
from fairqueue.jobs.models import Job, JobStatus
from tests.factories import quarantine_lane_off
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.test_jobs_e2e import E2EBase, _tenant
from tests.test_web_production import request
from tests.web import web_server
from tests.workers import WorkerProcess, wait_for

ROOT = Path(__file__).resolve().parent.parent
SPAN_KIND_SERVER = 2
SECRET = "payload-must-not-leak"


def _trace_id(job: Job) -> str:
    return job.traceparent.split("-")[1]


def _by_name(spans: list[ReceivedSpan], name: str, **attrs: object) -> ReceivedSpan:
    found = [
        s for s in spans if s.name == name and all(s.attributes.get(f"fairqueue.{k}") == v for k, v in attrs.items())
    ]
    assert len(found) == 1, f"{len(found)} span(s) named {name} {attrs} in {[s.name for s in spans]}"
    return found[0]


class TracingEndToEndTests(E2EBase):
    receiver: OtlpReceiver

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.receiver = OtlpReceiver().start()
        # The web process (this one) exports each span as it ends, over the same OTLP/HTTP.
        tracing.tracing_configure(
            exporter=OTLPSpanExporter(endpoint=f"{cls.receiver.endpoint}/v1/traces"), service_name="fairqueue-web"
        )

    @classmethod
    def tearDownClass(cls) -> None:
        tracing.tracing_shutdown()
        cls.receiver.stop()
        super().tearDownClass()

    def setUp(self) -> None:
        super().setUp()
        self.client = Client()  # after tracing is on: its handler loads the tracing middleware
        self.receiver.clear()

    def worker(self, **env: str) -> WorkerProcess:
        """A started worker exporting to the receiver (tearDown kills it if the test does not)."""
        return WorkerProcess(
            slots=2,
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=self.receiver.endpoint,
            OTEL_SERVICE_NAME="fairqueue-worker",
            OTEL_BSP_SCHEDULE_DELAY="100",  # export within a moment, before the test kills it
            **env,
        ).start(timeout=120)  # a loaded shared host can take a while to start one

    @contextlib.contextmanager
    def running(self, **env: str) -> Iterator[WorkerProcess]:
        worker = self.worker(**env)
        try:
            yield worker
        finally:
            worker.kill()

    def trace_of(self, job: Job, *names: str) -> list[ReceivedSpan]:
        """The job's trace once spans of every name in `names` have arrived, by start time."""
        trace_id = _trace_id(job)

        def arrived() -> list[ReceivedSpan] | None:
            spans = [s for s in self.receiver.spans() if s.trace_id == trace_id]
            return spans if set(names) <= {s.name for s in spans} else None

        spans = wait_for(arrived, timeout=60, message=f"spans {names} of job {job.id}")
        return sorted(spans, key=lambda s: s.start_ns)

    def assertConnected(self, spans: list[ReceivedSpan]) -> None:
        ids = {s.span_id for s in spans}
        roots = [s for s in spans if not s.parent_id]
        self.assertEqual(len(roots), 1, f"one root: {[(s.name, s.parent_id) for s in roots]}")
        orphans = [s.name for s in spans if s.parent_id and s.parent_id not in ids]
        self.assertEqual(orphans, [], "every span's parent is in the trace")

    def test_one_submitted_job_is_one_connected_trace_from_the_request_to_the_release(self) -> None:
        _, key = _tenant("traced")
        with self.running():
            body = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.05, "echo": SECRET}})
            job = wait_for(
                lambda: Job.objects.filter(id=body["id"], status=JobStatus.SUCCEEDED).first(), timeout=60, message="job"
            )
            spans = self.trace_of(job, "fairqueue.run", "fairqueue.release", "run/fairqueue.run_job")
        job_id = str(job.id)
        request = spans[0]
        self.assertEqual((request.service, request.kind), ("fairqueue-web", SPAN_KIND_SERVER))
        admission = _by_name(spans, "fairqueue.admission", job_id=job_id)
        publish = _by_name(spans, "apply_async/fairqueue.run_job")
        consume = _by_name(spans, "run/fairqueue.run_job")
        run = _by_name(spans, "fairqueue.run", job_id=job_id)
        release = _by_name(spans, "fairqueue.release", job_id=job_id)
        in_order = [request, admission, publish, consume, run, release]
        self.assertEqual([s.name for s in in_order], [s.name for s in sorted(in_order, key=lambda s: s.start_ns)])
        self.assertConnected(spans)
        # Who did what: the web process admitted and published, the worker ran and released.
        self.assertEqual({s.service for s in (admission, publish)}, {"fairqueue-web"})
        self.assertEqual({s.service for s in (consume, run, release)}, {"fairqueue-worker"})
        self.assertEqual(admission.parent_id, request.span_id)
        self.assertEqual(consume.parent_id, publish.span_id)  # through the message's headers
        self.assertEqual(run.parent_id, consume.span_id)
        # The admission says where and how: tenant, shard, class, keys with their limits.
        self.assertEqual(admission.attributes["fairqueue.tenant"], "traced")
        self.assertEqual(admission.attributes["fairqueue.shard"], "default")
        self.assertEqual(admission.attributes["fairqueue.latency_class"], job.latency_class)
        self.assertEqual(admission.attributes["fairqueue.outcome"], "admitted")
        self.assertIn("2:t:traced", admission.attributes["fairqueue.keys"])
        self.assertEqual(len(admission.attributes["fairqueue.limits"]), len(admission.attributes["fairqueue.keys"]))
        self.assertEqual([e for e, _ in admission.events], ["admitted"])
        self.assertEqual(run.events[0][0], "started")
        self.assertEqual(run.events[-1][0], "finished")
        self.assertEqual(release.attributes["fairqueue.woken"], 0)
        # No payload contents anywhere.
        self.assertNotIn(SECRET, repr([(s.attributes, s.events) for s in spans]))
        # The same lifecycle on the row.
        self.assertEqual(
            [s.event for s in tl.steps(job.timeline)], [tl.SUBMITTED, tl.ADMITTED, tl.STARTED, tl.FINISHED]
        )

    def test_a_bulk_submit_is_one_admission_span_and_each_job_a_connected_chain_in_its_trace(self) -> None:
        # One request, one trace: its jobs' admission is one span naming each job (not a span
        # per job); each job's publish, run and release still hang off that trace, and the
        # job that parked has its wait, ended by a sibling's release.
        _, key = _tenant("bulky", max_concurrency=2)
        with self.running():
            body = {"task": "demo.sleep", "args": {"seconds": 1.0}}
            resp = self.client.post(
                "/api/v1/jobs/bulk",
                json.dumps({"jobs": [body, body, body]}),
                content_type="application/json",
                HTTP_AUTHORIZATION=f"Bearer {key}",
            )
            self.assertEqual(resp.status_code, 202, resp.content)
            ids = [j["id"] for j in resp.json()]
            jobs = self.wait_all_finished(ids)
            self.assertEqual({j.status for j in jobs}, {JobStatus.SUCCEEDED})
            self.assertEqual(len({j.traceparent for j in jobs}), 1, "one request, one trace")
            trace_id = _trace_id(jobs[0])

            missing: list[str] = []

            def arrived() -> list[ReceivedSpan] | None:
                spans = [s for s in self.receiver.spans() if s.trace_id == trace_id]
                releases = [s for s in spans if s.name == "fairqueue.release"]
                # A span is exported when it ends, so an enclosing span (a run's delivery)
                # can arrive after the spans inside it: wait for every parent too.
                known = {s.span_id for s in spans}
                orphans = [f"{s.service}:{s.name}" for s in spans if s.parent_id and s.parent_id not in known]
                missing[:] = [f"{len(releases)} of {len(ids)} releases", f"parents not in: {orphans}"]
                return spans if len(releases) == len(ids) and not orphans else None

            try:
                spans = sorted(wait_for(arrived, timeout=60, message="the bulk's spans"), key=lambda s: s.start_ns)
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {missing}; timelines: {[j.timeline for j in jobs]}") from exc
        self.assertConnected(spans)
        admissions = [s for s in spans if s.name == "fairqueue.admission"]
        self.assertEqual(len(admissions), 1, [s.attributes for s in admissions])
        admission = admissions[0]
        self.assertEqual(admission.parent_id, spans[0].span_id)  # the request
        attrs = admission.attributes
        self.assertEqual(attrs["fairqueue.job_ids"], ids)
        self.assertEqual(attrs["fairqueue.outcomes"], ["admitted", "admitted", "parked"])
        self.assertEqual(attrs["fairqueue.parked_on"], ["", "", "2:t:bulky"])
        self.assertEqual((attrs["fairqueue.jobs"], attrs["fairqueue.admitted"], attrs["fairqueue.parked"]), (3, 2, 1))
        self.assertEqual(attrs["fairqueue.tenant"], "bulky")
        self.assertIn("2:t:bulky", attrs["fairqueue.keys"])
        self.assertEqual(
            admission.events,
            [("admitted", {"fairqueue.jobs": 2}), ("parked", {"fairqueue.key": "2:t:bulky", "fairqueue.jobs": 1})],
        )
        by_id = {s.span_id: s for s in spans}
        for job_id in ids[:2]:  # (the third may run in place, handed its slot: no broker spans)
            run = _by_name(spans, "fairqueue.run", job_id=job_id)
            release = _by_name(spans, "fairqueue.release", job_id=job_id)
            consume = by_id[run.parent_id]
            publish = by_id[consume.parent_id]
            self.assertEqual((consume.name, publish.name), ("run/fairqueue.run_job", "apply_async/fairqueue.run_job"))
            self.assertLessEqual(admission.start_ns, publish.start_ns)
            self.assertLessEqual(run.start_ns, release.start_ns)
        wait = _by_name(spans, "fairqueue.wait", job_id=ids[2])
        woke = [s for s in spans if s.name == "fairqueue.release" and s.attributes["fairqueue.woken"] == 1]
        self.assertEqual(len(woke), 1)
        self.assertEqual(wait.links, [(woke[0].trace_id, woke[0].span_id)])
        self.assertLessEqual(wait.end_ns, _by_name(spans, "fairqueue.run", job_id=ids[2]).start_ns)

    def test_a_submit_served_over_asgi_is_traced_too(self) -> None:
        # Production serves Django over ASGI (daphne, uvicorn): Django's instrumentation
        # traces those requests only with the ASGI instrumentation installed beside it.
        _, key = _tenant("asgi")

        async def post() -> HttpResponseBase:
            return await AsyncClient().post(
                "/api/v1/jobs",
                json.dumps({"task": "demo.noop", "args": {}}),
                content_type="application/json",
                headers={"Authorization": f"Bearer {key}"},
            )

        resp = async_to_sync(post)()
        self.assertEqual(resp.status_code, 202, resp.content)
        job = Job.objects.get(id=json.loads(resp.content)["id"])
        self.assertTrue(job.traceparent, "the job knows the request's trace")
        spans = self.trace_of(job, "fairqueue.admission", "apply_async/fairqueue.run_job")
        self.assertEqual((spans[0].kind, spans[0].parent_id), (SPAN_KIND_SERVER, ""))
        self.assertConnected(spans)

    def test_a_submit_through_the_production_server_is_traced(self) -> None:
        # /api/ requests go through the API's own handler (fairqueue/apiserver.py), which
        # calls the tracing middleware's hooks on the event loop and runs the view's work on
        # its thread pool: the request's span must still be the admission's parent.
        _, key = _tenant("served")
        server = web_server(
            production=True,
            processes=1,
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=self.receiver.endpoint,
            OTEL_SERVICE_NAME="fairqueue-web",
            OTEL_BSP_SCHEDULE_DELAY="100",
        )
        server.start()
        self.addCleanup(server.stop)
        status, _, body = request(
            server.port,
            "/api/v1/jobs",
            method="POST",
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            body=json.dumps({"task": "demo.noop", "args": {}}).encode(),
        )
        self.assertEqual(status, 202, body)
        job = Job.objects.get(id=json.loads(body)["id"])
        self.assertTrue(job.traceparent, "the job knows the request's trace")
        spans = self.trace_of(job, "fairqueue.admission", "apply_async/fairqueue.run_job")
        self.assertEqual((spans[0].service, spans[0].kind, spans[0].parent_id), ("fairqueue-web", SPAN_KIND_SERVER, ""))
        self.assertConnected(spans)

    def test_a_parked_jobs_trace_shows_its_wait_and_the_release_that_ended_it(self) -> None:
        _, key = _tenant("narrow", max_concurrency=1)
        with self.running():
            # Long enough that the second is submitted while the first runs, even on a loaded host.
            first = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 3.0}})
            second = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.05}})
            jobs = self.wait_all_finished([first["id"], second["id"]])
            a, b = sorted(jobs, key=lambda j: j.submitted_at)
            self.assertEqual([a.status, b.status], [JobStatus.SUCCEEDED, JobStatus.SUCCEEDED])
            a_spans = self.trace_of(a, "fairqueue.release")
            b_spans = self.trace_of(b, "fairqueue.wait", "fairqueue.run", "fairqueue.release")
        self.assertNotEqual(_trace_id(a), _trace_id(b))
        a_release = _by_name(a_spans, "fairqueue.release", job_id=str(a.id))
        self.assertEqual(a_release.attributes["fairqueue.woken"], 1)
        admission = _by_name(b_spans, "fairqueue.admission", job_id=str(b.id))
        wait = _by_name(b_spans, "fairqueue.wait", job_id=str(b.id))
        run = _by_name(b_spans, "fairqueue.run", job_id=str(b.id))
        self.assertEqual(admission.attributes["fairqueue.outcome"], "parked")
        self.assertEqual(admission.attributes["fairqueue.parked_on"], "2:t:narrow")
        self.assertEqual([e for e, _ in admission.events], ["parked"])
        # The wait runs from the park to the release that woke it, and links to that release.
        self.assertEqual(wait.links, [(a_release.trace_id, a_release.span_id)])
        self.assertEqual([e for e, _ in wait.events], ["woken"])
        self.assertLessEqual(admission.start_ns, wait.start_ns)
        self.assertLessEqual(wait.end_ns, run.start_ns)
        self.assertGreater(wait.end_ns - wait.start_ns, 1_000_000_000)  # it waited for most of A's 3 s
        self.assertLessEqual(a_release.start_ns, wait.end_ns)
        self.assertConnected(b_spans)
        # Its timeline: parked on its tenant's key, woken, started, finished; and in the admin.
        steps = tl.steps(b.timeline)
        self.assertEqual(
            [s.event for s in steps], [tl.SUBMITTED, tl.PARKED, tl.WOKEN, tl.STARTED, tl.FINISHED], b.timeline
        )
        self.assertEqual(steps[1].detail, "2:t:narrow")
        self.assertEqual(steps[-1].detail, JobStatus.SUCCEEDED)
        staff = User.objects.create_superuser("ops", "ops@example.com", "pw")
        admin = Client()
        admin.force_login(staff)
        page = admin.get(f"/admin/jobs/job/{b.id}/change/")
        self.assertEqual(page.status_code, 200)
        html = page.content.decode()
        self.assertIn('class="fq-timeline"', html)
        table = html[html.index('class="fq-timeline"') :]
        positions = [table.index(f"<td>{event}</td>") for event in ("submitted", "parked", "woken", "started")]
        self.assertEqual(positions, sorted(positions))
        self.assertIn("<td>2:t:narrow</td>", table)

    def test_a_reclaimed_job_shows_the_reclaim_and_its_second_run_in_its_trace(self) -> None:
        _, key = _tenant("fragile")
        quarantine_lane_off()  # this test is about re-delivery to a normal survivor
        lease = {"FAIRQUEUE_LEASE_SECONDS": "2"}
        with override_settings(FAIRQUEUE={**settings.FAIRQUEUE, "LEASE_SECONDS": 2.0}):
            victim = self.worker(**lease)
            body = self.submit(key, {"task": "demo.sleep", "args": {"seconds": 1.5}})
            wait_for(lambda: Job.objects.get(id=body["id"]).status == JobStatus.RUNNING, message="job to start")
            victim.kill()
            with self.running(**lease):
                job = wait_for(
                    lambda: Job.objects.filter(id=body["id"], status=JobStatus.SUCCEEDED).first(),
                    timeout=60,
                    message="the re-run",
                )
                spans = self.trace_of(job, "fairqueue.reclaim", "fairqueue.release")
        reclaim = _by_name(spans, "fairqueue.reclaim", job_id=str(job.id))
        self.assertEqual([e for e, _ in reclaim.events], ["reclaimed"])
        again = _by_name(spans, "fairqueue.admission", job_id=str(job.id), generation=1)
        run = _by_name(spans, "fairqueue.run", job_id=str(job.id), generation=1)
        self.assertLessEqual(reclaim.start_ns, again.start_ns)
        self.assertLessEqual(again.start_ns, run.start_ns)
        self.assertEqual(run.service, "fairqueue-worker")
        self.assertIn(tl.RECLAIMED, [s.event for s in tl.steps(job.timeline)])


class TracingOffTests(SimpleTestCase):
    def test_tracing_is_off_by_default_and_imports_no_sdk(self) -> None:
        probe = (
            "import json, os, sys, django\n"
            "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'fairqueue.settings')\n"
            "django.setup()\n"
            "from django.conf import settings\n"
            "from fairqueue import tracing\n"
            "from fairqueue.jobs import dispatch, execution, submission  # noqa\n"
            "with tracing.span('x', job_id='1'):\n"
            "    tracing.event('y')\n"
            "print(json.dumps({'on': tracing.tracing_enabled(), 'tp': tracing.traceparent(),\n"
            "  'carry': tracing.job_carry('00-' + '1' * 32 + '-' + '2' * 16 + '-01'),\n"
            "  'sdk': sorted(m for m in sys.modules if m.startswith(\n"
            "      ('opentelemetry.sdk.trace', 'opentelemetry.exporter', 'opentelemetry.instrumentation'))),\n"
            "  'middleware': [m for m in settings.MIDDLEWARE if 'opentelemetry' in m]}))\n"
        )
        # (redis-py imports the metrics part of the SDK by itself when it is installed: not
        # ours to count; the tracing SDK, the exporters and the instrumentations are.)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertEqual(got, {"on": False, "tp": "", "carry": "", "sdk": [], "middleware": []})

    def test_an_unknown_exporter_leaves_tracing_off(self) -> None:
        probe = (
            "import os, sys, django\n"
            "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'fairqueue.settings')\n"
            "django.setup()\n"
            "from fairqueue import tracing\n"
            "print(tracing.tracing_enabled(), any(m.startswith('opentelemetry.sdk.trace') for m in sys.modules))\n"
        )
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "OTEL_TRACES_EXPORTER": "jaegr"}
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
        self.assertEqual(out.stdout.strip().splitlines()[-1], "False False", out.stderr)
        self.assertIn("not one of otlp, console, in_memory, none", out.stderr)


class TimelineTests(SimpleTestCase):
    def test_lines_read_back_as_steps_and_bad_lines_are_skipped(self) -> None:
        text = tl.line(tl.SUBMITTED) + "garbage\n" + tl.line(tl.PARKED, "1:st:acme:x")
        steps = tl.steps(text)
        self.assertEqual([(s.event, s.detail) for s in steps], [(tl.SUBMITTED, ""), (tl.PARKED, "1:st:acme:x")])
