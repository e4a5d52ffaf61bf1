"""Several hosts on one machine (network namespaces, tests/netns.py): the web process and
two worker hosts reach Redis and the database over veth links; one worker host is cut off
for longer than the running lease, then healed.

What must hold: the cut host's jobs are reclaimed and run on the other host; every job's
result and side effect are recorded exactly once; the cut worker fences itself before its
leases end (its tasks stop, it takes no new job), and once healed it records no stale
result, its busy slots are back to what it really runs, and it takes work again. The test
prints the window in which a reclaimed job ran twice and the peak concurrency against the
tenant's limit (figures in docs/deployment.md).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime

from django.db import connection
from django.test import tag

from fairqueue.bench.stack import free_port
from fairqueue.jobs.fleet import BUSY_KEY, SEEN_KEY
from fairqueue.jobs.models import Job, JobStatus, LedgerEntry
from tests.factories import make_tenant, quarantine_lane_off
from tests.netns import Host, TcpForwarder, netns_available
from tests.redis_server import RedisServer
from tests.test_jobs_e2e import E2EBase, max_overlap
from tests.workers import LOG_DIR, ROOT, WorkerProcess, wait_for, worker_env

LEASE_SECONDS = 3.0
JOB_SECONDS = 2.5
JOBS = 12
SLOTS = 3
TENANT_LIMIT = 6  # both hosts' slots: the limit, not the fleet, is what a double run would break
CUT_SECONDS = 3 * LEASE_SECONDS  # well past the running lease
FENCED_LINE = re.compile(r"job (\S+) generation (\d+) fenced at ([\d.]+)")


def http_json(url: str, key: str, body: object | None = None) -> tuple[int, object]:
    request = urllib.request.Request(
        url,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@tag("distributed")
class PartitionedWorkerHostTests(E2EBase):
    def setUp(self) -> None:
        super().setUp()
        reason = netns_available()
        if reason:
            raise RuntimeError(f"this test needs network namespaces: {reason}")
        self.hosts: list[Host] = []
        self.forwarder: TcpForwarder | None = None
        self.web: subprocess.Popen[bytes] | None = None

    def tearDown(self) -> None:
        if self.web and self.web.poll() is None:
            self.web.kill()
            self.web.wait(10)
        super().tearDown()  # kills the workers
        for host in self.hosts:
            host.destroy()
        if self.forwarder:
            self.forwarder.stop()

    def host(self, name: str) -> Host:
        host = Host(name, len(self.hosts) + 1).create()
        self.hosts.append(host)
        return host

    def host_env(self, host: Host, redis_port: int) -> dict[str, str]:
        """What a process on `host` is told: Redis and the database through its gateway."""
        overrides = {
            "REDIS_URL": f"redis://{host.gateway}:{redis_port}/0",
            "FAIRQUEUE_LEASE_SECONDS": str(LEASE_SECONDS),
            "DEBUG": "0",
            "ALLOWED_HOSTS": host.address,
        }
        db = connection.settings_dict
        if not db["ENGINE"].endswith("sqlite3"):  # PostgreSQL listens on loopback only
            if self.forwarder is None:
                self.forwarder = TcpForwarder(db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)).start()
            user = db["USER"]
            password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
            overrides["DATABASE_URL"] = f"postgres://{user}{password}@{host.gateway}:{self.forwarder.port}/{db['NAME']}"
        return overrides

    def start_web(self, host: Host, env: dict[str, str]) -> str:
        port = free_port()
        log = (LOG_DIR / f"web-{host.namespace}.log").open("wb")
        argv = [sys.executable, "-m", "daphne", "-b", host.address, "-p", str(port), "fairqueue.asgi:application"]
        self.web = subprocess.Popen(
            host.argv(argv), cwd=ROOT, env=worker_env(**env), stdout=log, stderr=subprocess.STDOUT
        )
        base_url = f"http://{host.address}:{port}"

        def answers() -> bool:
            try:
                with urllib.request.urlopen(base_url + "/admin/login/", timeout=2):
                    return True
            except urllib.error.HTTPError:
                return True  # it answers
            except OSError:
                return False

        wait_for(answers, timeout=60, message="the web host to answer")
        return base_url

    def test_a_cut_worker_host_is_fenced_its_jobs_run_elsewhere_once_and_it_rejoins_when_healed(self) -> None:
        _, key = make_tenant("hosts", max_concurrency=TENANT_LIMIT, floor=TENANT_LIMIT)
        quarantine_lane_off()  # the cut host's jobs run again on the other host, a normal worker
        with RedisServer(bind="0.0.0.0") as shared:
            web_host, cut_host, other_host = self.host("web"), self.host("w1"), self.host("w2")
            base_url = self.start_web(web_host, self.host_env(web_host, shared.port))
            cut = WorkerProcess(
                slots=SLOTS, name="cut", argv_prefix=cut_host.argv([]), **self.host_env(cut_host, shared.port)
            ).start(timeout=60)
            other = WorkerProcess(
                slots=SLOTS, name="other", argv_prefix=other_host.argv([]), **self.host_env(other_host, shared.port)
            ).start(timeout=60)

            ids = []
            for i in range(JOBS):
                status, body = http_json(
                    base_url + "/api/v1/jobs", key, {"task": "demo.sleep", "args": {"seconds": JOB_SECONDS, "echo": i}}
                )
                self.assertEqual(status, 202, body)
                ids.append(body["id"])  # type: ignore[index]

            def running_on_cut() -> list[Job]:
                jobs = list(Job.objects.filter(id__in=ids, status=JobStatus.RUNNING, worker=cut.hostname))
                return jobs if len(jobs) >= 2 else []

            stranded = {str(j.id): j for j in wait_for(running_on_cut, timeout=60, message="jobs on the cut host")}
            cut_host.cut()
            cut_at = time.time()

            def rerun_elsewhere() -> bool:
                rows = Job.objects.filter(id__in=list(stranded))
                return all(
                    r.generation > stranded[str(r.id)].generation and r.worker == other.hostname and r.started_at
                    for r in rows
                )

            wait_for(rerun_elsewhere, timeout=60, message="the cut host's jobs to start on the other host")
            reruns = {str(r.id): r for r in Job.objects.filter(id__in=list(stranded))}
            time.sleep(max(0.0, cut_at + CUT_SECONDS - time.time()))
            cut_host.heal()
            healed_at = time.time()

            finished = self.wait_all_finished(ids, timeout=180)
            self.assertEqual({j.status for j in finished}, {JobStatus.SUCCEEDED})
            for job_id in stranded:
                final = next(j for j in finished if str(j.id) == job_id)
                self.assertEqual(final.worker, other.hostname, "a reclaimed job's result comes from its new delivery")
                self.assertGreater(final.generation, stranded[job_id].generation)
            self.assertEqual(
                sorted(LedgerEntry.objects.filter(job_id__in=ids).values_list("writes", flat=True)),
                [1] * JOBS,
                "every job's side effect written exactly once",
            )

            # The cut worker fenced each stranded job before its lease ended, and says when.
            def fenced_lines() -> dict[str, float]:
                text = cut.log_path.read_text(errors="replace")
                return {m[1]: float(m[3]) for m in FENCED_LINE.finditer(text) if m[1] in stranded}

            fenced = wait_for(lambda: len(fenced_lines()) == len(stranded) and fenced_lines(), timeout=30)
            # Once healed it is a live worker again, runs nothing stale and counts no busy slot
            # for the jobs it lost.
            client = shared.client()
            wait_for(
                lambda: (client.zscore(SEEN_KEY, cut.hostname) or 0) > healed_at,
                timeout=60,
                message="the healed worker to heartbeat again",
            )
            wait_for(lambda: client.hget(BUSY_KEY, cut.hostname) == "0", timeout=30, message="its busy slots at 0")
            self.assertIsNone(cut.proc.poll() if cut.proc else None, "the cut worker survived the partition")
            more = {"jobs": [{"task": "demo.sleep", "args": {"seconds": 1.0}}] * (2 * SLOTS)}
            status, body = http_json(base_url + "/api/v1/jobs/bulk", key, more)
            self.assertEqual(status, 202, body)
            later = [j["id"] for j in body]  # type: ignore[union-attr,index]
            after = self.wait_all_finished(later, timeout=120)
            self.assertIn(cut.hostname, {j.worker for j in after}, "the healed host takes work again")

        # Figures: how long a reclaimed job ran twice (stale delivery still running after the
        # new one started; negative = never), and the tenant's peak concurrency counting the
        # stale deliveries until they stopped.
        overlaps = [fenced[j] - reruns[j].started_at.timestamp() for j in stranded]
        intervals = [(j.started_at, j.finished_at) for j in finished]
        intervals += [
            (stranded[j].started_at, datetime.fromtimestamp(fenced[j], tz=UTC))
            for j in stranded
            if stranded[j].started_at
        ]
        peak = max_overlap(intervals)  # type: ignore[arg-type]
        print(
            f"\n[hosts] lease {LEASE_SECONDS}s, cut {CUT_SECONDS}s: {len(stranded)} jobs reclaimed; "
            f"fenced {min(fenced.values()) - cut_at:.2f}-{max(fenced.values()) - cut_at:.2f}s after the cut; "
            f"double-run window max {max(overlaps):.2f}s; peak concurrency {peak} (limit {TENANT_LIMIT})"
        )
        self.assertLessEqual(max(overlaps), 0.0, "the stale delivery stopped before the new one started")
        self.assertLessEqual(peak, TENANT_LIMIT)
