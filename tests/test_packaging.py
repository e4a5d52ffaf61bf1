"""The wheel built from the repository carries everything an installed FairQueue needs:
its apps' code and migrations, the Lua scripts and templates mapped in from the top level,
the dashboard's static files; and nothing of the checkout (tests, examples, deploy)."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from django.test import SimpleTestCase

ROOT = Path(__file__).resolve().parent.parent


def wheel_build(out_dir: Path) -> Path:
    """`pip wheel .` of the repository (build isolation: setuptools comes from the registry).
    setuptools builds in the checkout's build/, so test shards side by side take turns."""
    lock_path = ROOT / "var" / "wheel-build.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out_dir), str(ROOT)],
            check=True,
            capture_output=True,
            text=True,
        )
    (wheel,) = out_dir.glob("fairqueue-*.whl")
    return wheel


class WheelContentsTests(SimpleTestCase):
    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls._tmp = tempfile.TemporaryDirectory()
        with zipfile.ZipFile(wheel_build(Path(cls._tmp.name))) as wheel:
            cls.names = set(wheel.namelist())

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()
        super().tearDownClass()

    def test_every_lua_script_is_in_the_package(self) -> None:
        for script in (ROOT / "lua").glob("*.lua"):
            self.assertIn(f"fairqueue/engine/lua/{script.name}", self.names)

    def test_every_template_and_static_file_is_carried(self) -> None:
        for template in (ROOT / "templates").rglob("*.html"):
            self.assertIn(f"fairqueue/templates/{template.relative_to(ROOT / 'templates')}", self.names)
        for asset in (ROOT / "dashboard" / "static").rglob("*.*"):
            self.assertIn(str(asset.relative_to(ROOT)), self.names)

    def test_migrations_of_every_app_are_carried(self) -> None:
        for app in ("fairqueue/jobs", "tenants", "webhooks"):
            for migration in (ROOT / app / "migrations").glob("*.py"):
                self.assertIn(str(migration.relative_to(ROOT)), self.names)

    def test_nothing_of_the_checkout_is_carried(self) -> None:
        tops = {name.split("/")[0] for name in self.names}
        self.assertEqual(
            tops - {"fairqueue-0.1.0.dist-info"}, {"fairqueue", "tenants", "dashboard", "webhooks"}, "top-level names"
        )


class DeclaredDependenciesTests(SimpleTestCase):
    def test_the_distribution_declares_requirements_txt_pins(self) -> None:
        declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        pinned = [
            line.strip()
            for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
        self.assertEqual(sorted(declared), sorted(pinned))
