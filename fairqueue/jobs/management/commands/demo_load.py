"""`manage.py demo_load`: a steady, bursty, realistic load through the REST API, for the demo."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from tenants.models import Tenant

# One document in LARGE_DOCUMENT_EVERY is large: LARGE_DOCUMENT_PAGES pages.
LARGE_DOCUMENT_EVERY = 20
LARGE_DOCUMENT_PAGES = (100, 400)


def _document(r: random.Random) -> dict[str, Any]:
    large = r.randrange(LARGE_DOCUMENT_EVERY) == 0
    pages = r.randint(*LARGE_DOCUMENT_PAGES) if large else r.randint(1, 2)
    return {"task": "demo.document", "args": {"pages": pages, "seconds_per_page": round(r.uniform(0.1, 0.5), 3)}}


class Command(BaseCommand):
    help = "Submit demo load over HTTP: steady tenants, a periodic noisy burst, sub-tenants and batch work."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--base-url", default="http://127.0.0.1:8000")
        parser.add_argument("--keys", default=str(Path(settings.BASE_DIR) / "var" / "demo-keys.json"))
        parser.add_argument("--burst-every", type=float, default=90.0, help="Seconds between noisy bursts.")
        parser.add_argument("--burst-size", type=int, default=1500)
        parser.add_argument("--duration", type=float, default=0, help="Stop after this many seconds (0 = forever).")
        parser.add_argument("--seed", type=int, default=7)
        parser.add_argument(
            "--hungry-every",
            type=float,
            default=120.0,
            help="Mean seconds between memory-hungry jobs (demo.hungry), which kill a lean worker and move to the "
            "quarantine lane (0 = none).",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        self.base = opts["base_url"].rstrip("/")
        self.keys = self._keys(Path(opts["keys"]))
        self.stop = threading.Event()
        rng = random.Random(opts["seed"])
        self._wait_for_server()
        streams = [
            # (tenant, jobs per second, body factory)
            ("acme", 3.0, lambda r: {"task": "demo.parse", "args": {"pages": r.randint(1, 6)}}),
            (
                "globex",
                1.0,
                lambda r: {"task": "demo.sleep", "args": {"seconds": round(r.lognormvariate(-1.2, 0.6), 3)}},
            ),
            (
                "umbrella",
                2.0,
                lambda r: {
                    "task": "demo.sleep",
                    "args": {"seconds": round(r.uniform(0.2, 1.0), 3)},
                    "sub_tenant": r.choice(["hospital-a", "hospital-a", "hospital-a", "hospital-b", "clinic-c"]),
                },
            ),
            (
                "hooli",
                1.0,
                lambda r: {"task": "demo.sleep", "args": {"seconds": round(r.uniform(0.5, 2.0), 3)}, "batch": True},
            ),
            (
                "acme",
                0.2,
                lambda r: {"task": "demo.sleep", "args": {"seconds": 0.1}, "priority": "critical"},
            ),
            # Documents that fan out one job per page (fairqueue.jobs.fanout): mostly a page
            # or two, now and then a large one, which its document key caps and whose pages
            # are one flow at globex's key, so the small documents keep flowing past it.
            ("globex", 0.5, _document),
        ]
        if opts["hungry_every"] > 0:
            streams.append(("globex", 1 / opts["hungry_every"], lambda r: {"task": "demo.hungry", "args": {"mb": 400}}))
        threads = [
            threading.Thread(target=self._steady, args=(slug, rate, body, random.Random(rng.random())), daemon=True)
            for slug, rate, body in streams
        ]
        threads.append(threading.Thread(target=self._bursts, args=(opts, random.Random(rng.random())), daemon=True))
        for t in threads:
            t.start()
        deadline = time.monotonic() + opts["duration"] if opts["duration"] else None
        try:
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        self.stop.set()

    def _keys(self, path: Path) -> dict[str, str]:
        """Demo keys from seed_demo's file; a tenant whose key was lost gets a new one."""
        keys: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
        for tenant in Tenant.objects.filter(slug__in=["acme", "globex", "initech", "umbrella", "hooli"]):
            if tenant.slug not in keys or not tenant.check_api_key(keys[tenant.slug]):
                keys[tenant.slug] = tenant.rotate_api_key()
                tenant.save(update_fields=["api_key_prefix", "api_key_hash", "api_key_rotated_at"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(keys, indent=2))
        path.chmod(0o600)
        return keys

    def _wait_for_server(self) -> None:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"{self.base}/api/v1/openapi.json", timeout=2)
                return
            except OSError:
                time.sleep(0.2)

    def _post(self, slug: str, path: str, body: dict[str, Any]) -> int:
        request = urllib.request.Request(
            f"{self.base}{path}",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.keys[slug]}", "Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            self.stderr.write(f"{slug}: HTTP {exc.code} {exc.read()[:200]!r}")
            return int(exc.code)
        except OSError as exc:
            self.stderr.write(f"{slug}: {exc}")
            return 0

    def _steady(self, slug: str, rate: float, body: Any, rng: random.Random) -> None:
        while not self.stop.is_set():
            self.stop.wait(rng.expovariate(rate))
            self._post(slug, "/api/v1/jobs", body(rng))

    def _bursts(self, opts: dict[str, Any], rng: random.Random) -> None:
        self.stop.wait(15)  # let the steady tenants settle first, so the burst is visible
        while not self.stop.is_set():
            size = opts["burst_size"]
            self.stdout.write(f"initech bursts {size} documents")
            for start in range(0, size, 200):
                jobs = [
                    {"task": "demo.sleep", "args": {"seconds": round(rng.lognormvariate(-0.9, 0.7), 3)}}
                    for _ in range(min(200, size - start))
                ]
                self._post("initech", "/api/v1/jobs/bulk", {"jobs": jobs})
            self.stop.wait(opts["burst_every"])
