"""FairQueue added to a new Django project as a new user would: README's "Add FairQueue to
your Django project", line by line.

The wheel built from this checkout is installed into a fresh virtualenv (cached under
var/host-venv/ by the hash of requirements.txt; FairQueue itself is reinstalled every run),
`django-admin startproject hostsite` makes the project, README's blocks are applied to it
as they are written, and nothing of the checkout is on its path. Then: migrate, a tenant
added through the admin, jobs submitted in-process, over REST and as a Django Tasks
`@task`, the documented FairQueue worker line runs them all, the project's own task runs
on its own worker and default queue, and the dashboard renders under the project's prefix.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.test import SimpleTestCase

from tests.base import redis_client
from tests.test_packaging import ROOT, wheel_build
from tests.workers import LOG_DIR

SECTION = "## Add FairQueue to your Django project"
BLOCK = re.compile(r"```python\n# (\S+) \((append|create|replace)\)\n(.*?)```", re.S)
DEADLINE_SECONDS = 120.0
SETUP_TIMEOUT_SECONDS = 900

# The project's own code: an app with a Celery task of its own, a Django Tasks @task, and
# an existing task it sends through FairQueue (docs/existing-tasks.md). Not FairQueue's lines.
HOSTAPP = {
    "__init__.py": "",
    "tasks.py": """
        from pathlib import Path

        from celery import shared_task
        from django_tasks import task


        @shared_task(name="hostapp.touch")
        def touch(path):
            Path(path).write_text("ran")


        @shared_task(name="hostapp.multiply")
        def multiply(x: int, y: int) -> int:
            return x * y


        @task()
        def double(n: int) -> int:
            return 2 * n
    """,
    "fairqueue_tasks.py": """
        from fairqueue.jobs.celery_tasks import celery_task_register

        from hostapp.tasks import multiply

        celery_task_register(multiply)
    """,
}

# Run in the project (`manage.py shell`): the admin adds a tenant, then jobs go in three ways.
SUBMIT = """
import json, re, sys
from django.contrib.auth import get_user_model
from django.test import Client
from django.test.utils import setup_test_environment
from tenants.models import Shard
import fairqueue
from hostapp.tasks import double, touch

setup_test_environment()
get_user_model().objects.create_superuser("owner", "owner@example.com", "pw-owner-123")
http = Client()
http.login(username="owner", password="pw-owner-123")
page = http.get("/admin/tenants/tenant/add/")
assert page.status_code == 200, page.status_code
form = page.context["adminform"].form
data = {}
for name, field in form.fields.items():
    value = form.initial.get(name, field.initial)
    value = value() if callable(value) else value
    if value is None or value is False:
        continue
    data[name] = "on" if value is True else getattr(value, "pk", value)
data.update(slug="acme", name="Acme", shard=Shard.objects.order_by("pk").first().pk)
for inline in page.context["inline_admin_formsets"]:
    data[inline.formset.prefix + "-TOTAL_FORMS"] = "0"
    data[inline.formset.prefix + "-INITIAL_FORMS"] = "0"
added = http.post("/admin/tenants/tenant/add/", data)
# The admin shows the new tenant's API key once.
keys = re.findall(r'<code class="fq-api-key">([^<]+)</code>', added.content.decode())
assert added.status_code == 200 and len(keys) == 1, added.content.decode()[-3000:]
key = keys[0]

in_process = fairqueue.submit("acme", "hostapp.multiply", {"x": 6, "y": 7})
rest = http.post("/queue/api/v1/jobs", json.dumps({"task": "hostapp.multiply", "args": {"x": 2, "y": 3}}),
                 content_type="application/json", HTTP_AUTHORIZATION="Bearer " + key)
assert rest.status_code == 202, rest.content
django_task = double.using(queue_name="acme").enqueue(21)
touch.delay(sys.argv[1])
dashboard = http.get("/queue/dashboard/")
index = http.get("/queue/")
print(json.dumps({
    "jobs": [str(in_process.pk), rest.json()["id"]],
    "django_task": django_task.id,
    "dashboard": [dashboard.status_code, 'data-ws-path="/queue/ws/dashboard/"' in dashboard.content.decode()],
    "index": 'href="/queue/api/v1/docs"' in index.content.decode(),
}))
"""

# Run in the project: its own worker's prefetch, as Celery reports it (its own app's control).
OWN_PREFETCH = """
import json
from hostsite.celery import app
stats = app.control.inspect(timeout=5).stats() or {}
print(json.dumps([v["prefetch_count"] for k, v in stats.items() if k.startswith("own@")]))
"""
#: Celery's default prefetch multiplier, which the project's own worker keeps.
CELERY_DEFAULT_PREFETCH_MULTIPLIER = 4

# Run in the project: what became of the jobs.
OUTCOME = """
import json, sys
from fairqueue.jobs.models import Job
from hostapp.tasks import double
ids = json.loads(sys.argv[1])
jobs = {str(j.pk): (j.status, j.result) for j in Job.objects.filter(pk__in=ids["jobs"])}
result = double.get_result(ids["django_task"])
value = result.return_value if result.is_finished and result.status == "SUCCESSFUL" else None
print(json.dumps({"jobs": jobs, "django_task": [result.status, value]}))
"""


def venv_cached() -> Path:
    """A virtualenv with requirements.txt installed, made once per version of it."""
    digest = hashlib.sha256((ROOT / "requirements.txt").read_bytes()).hexdigest()[:16]
    venv = ROOT / "var" / "host-venv" / digest
    if not (venv / ".installed").exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "-r", str(ROOT / "requirements.txt")], check=True, timeout=SETUP_TIMEOUT_SECONDS)
        (venv / ".installed").touch()
    return venv


def readme_blocks() -> tuple[list[tuple[str, str, str]], list[str]]:
    """README's section: its (path, how, code) blocks and its `celery -A hostsite worker` lines."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    blocks = [(m[1], m[2], m[3]) for m in BLOCK.finditer(section)]
    workers = [
        line.split("#")[0].strip() for line in section.splitlines() if line.startswith("celery -A hostsite worker")
    ]
    return blocks, workers


class NewHostTests(SimpleTestCase):
    def run_in(self, site: Path, env: dict[str, str], *argv: str, timeout: float = 300) -> str:
        done = subprocess.run(
            [str(self.python), *argv], cwd=site, env=env, capture_output=True, text=True, timeout=timeout
        )
        self.assertEqual(done.returncode, 0, f"{argv}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done.stdout

    def test_a_new_project_runs_jobs_with_only_the_documented_lines(self) -> None:
        client = redis_client()
        client.flushdb()
        venv = venv_cached()
        self.python = venv / "bin" / "python"
        work = Path(tempfile.mkdtemp(prefix="fq-host-"))
        self.addCleanup(shutil.rmtree, work, ignore_errors=True)
        self.addCleanup(client.flushdb)
        wheel = wheel_build(work / "dist")
        subprocess.run(
            [str(self.python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], check=True
        )

        site = work / "site"
        site.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "PYTHON", "FAIRQUEUE", "CELERY"))}
        env |= {"REDIS_URL": settings.REDIS_URL, "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}"}
        subprocess.run([str(venv / "bin" / "django-admin"), "startproject", "hostsite", str(site)], check=True, env=env)
        blocks, worker_lines = readme_blocks()
        self.assertEqual(len(blocks), 5, "settings, celery.py, __init__.py, urls.py, asgi.py")
        for path, how, code in blocks:
            target = site / path
            if how == "append":
                target.write_text(target.read_text() + "\n" + code)
            else:
                target.write_text(code)
        # The project's own app (its code, not FairQueue's lines).
        (site / "hostapp").mkdir()
        for name, code in HOSTAPP.items():
            (site / "hostapp" / name).write_text(textwrap.dedent(code))
        settings_py = site / "hostsite" / "settings.py"
        settings_py.write_text(settings_py.read_text() + '\nINSTALLED_APPS += ["hostapp"]\n')

        probe = "import fairqueue, json, sys; print(json.dumps([fairqueue.__file__, sys.path]))"
        found, path = json.loads(self.run_in(site, env, "-c", probe))
        self.assertTrue(found.startswith(str(venv / "lib")), f"FairQueue is the installed one: {found}")
        self.assertNotIn(str(ROOT), [p.rstrip("/") for p in path], "no checkout on the path")
        self.run_in(site, env, "manage.py", "check")
        self.run_in(site, env, "manage.py", "migrate", "--noinput")
        marker = work / "own-task-ran"
        submitted = json.loads(
            self.run_in(site, env, "manage.py", "shell", "-c", SUBMIT.replace("sys.argv[1]", repr(str(marker))))
            .strip()
            .splitlines()[-1]
        )
        self.assertEqual(submitted["dashboard"], [200, True], "the dashboard under the project's prefix")
        self.assertTrue(submitted["index"], "the index leads to the API docs")

        fairqueue_line, own_line = worker_lines
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        procs: list[subprocess.Popen[bytes]] = []
        for line, name in ((fairqueue_line, "fq"), (own_line, "own")):
            # Two workers on one machine need two node names; nothing else is added.
            argv = [str(venv / "bin" / line.split()[0]), *line.split()[1:], "-n", f"{name}@%h"]
            log = (LOG_DIR / f"new-host-{name}.log").open("wb")
            procs.append(subprocess.Popen(argv, cwd=site, env=env, stdout=log, stderr=subprocess.STDOUT))
        self.addCleanup(self.stop, procs)

        outcome: dict[str, Any] = {}
        deadline = time.monotonic() + DEADLINE_SECONDS
        while time.monotonic() < deadline:
            outcome = json.loads(
                self.run_in(
                    site, env, "manage.py", "shell", "-c", OUTCOME.replace("sys.argv[1]", repr(json.dumps(submitted)))
                )
                .strip()
                .splitlines()[-1]
            )
            done = all(status == "succeeded" for status, _ in outcome["jobs"].values())
            if done and outcome["django_task"][0] == "SUCCESSFUL" and marker.exists():
                break
            time.sleep(1)
        in_process, rest = submitted["jobs"]
        self.assertEqual(outcome["jobs"][in_process], ["succeeded", 42])
        self.assertEqual(outcome["jobs"][rest], ["succeeded", 6])
        self.assertEqual(outcome["django_task"], ["SUCCESSFUL", 42])
        self.assertTrue(marker.exists(), "the project's own task ran on its own worker")
        own_prefetch = json.loads(
            self.run_in(site, env, "manage.py", "shell", "-c", OWN_PREFETCH).strip().splitlines()[-1]
        )
        slots = int(re.search(r"-c (\d+)", own_line).group(1)) if "-c " in own_line else os.cpu_count() or 1
        self.assertEqual(
            own_prefetch, [slots * CELERY_DEFAULT_PREFETCH_MULTIPLIER], "the project's worker keeps its own"
        )
        registered = {name.decode() for name in client.hkeys("fq:workers:slots")}
        self.assertTrue(registered and all(name.startswith("fq@") for name in registered), registered)

    @staticmethod
    def stop(procs: list[subprocess.Popen[bytes]]) -> None:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
