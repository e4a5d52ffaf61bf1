"""Every bench runs with what `make test`/`make demo` install, and a missing optional
dependency is named with what installs it, not met as a traceback half-way through."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from django.test import SimpleTestCase

from fairqueue.bench.extras import INSTALL_HINT, extras_missing
from fairqueue.bench.noisy import PLOT_EXTRAS, REQUIRED_EXTRAS

ROOT = Path(__file__).resolve().parent.parent
# Runs manage.py with some modules made unimportable, as if they were not installed.
WITHOUT = (
    "import sys\n"
    "hidden, argv = sys.argv[1].split(','), sys.argv[2:]\n"
    "for name in hidden:\n"
    "    sys.modules[name] = None\n"
    "from django.core.management import execute_from_command_line\n"
    "execute_from_command_line(['manage.py', *argv])\n"
)
UNUSED_REDIS = "redis://127.0.0.1:1/0"  # never reached: the check comes first


def manage_without(hidden: list[str], *argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="fairqueue.settings", FAIRQUEUE_DEMO="1")
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, ",".join(hidden), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


class BenchExtrasTests(SimpleTestCase):
    def test_the_test_and_demo_environment_has_every_bench_extra(self) -> None:
        self.assertEqual(extras_missing(REQUIRED_EXTRAS + PLOT_EXTRAS), [])

    def test_bench_noisy_without_numpy_says_what_to_install(self) -> None:
        done = manage_without(["numpy"], "bench", "noisy", "--smoke", "--redis-url", UNUSED_REDIS)
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("bench noisy needs numpy", done.stderr)
        self.assertIn(INSTALL_HINT, done.stderr)
        self.assertNotIn("Traceback", done.stderr)

    def test_bench_noisy_plot_without_matplotlib_says_what_to_install(self) -> None:
        done = manage_without(
            ["matplotlib"], "bench", "noisy", "--smoke", "--plot", "var/never.png", "--redis-url", UNUSED_REDIS
        )
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("bench noisy needs matplotlib", done.stderr)
        self.assertIn(INSTALL_HINT, done.stderr)
        self.assertNotIn("Traceback", done.stderr)
        self.assertFalse((ROOT / "var" / "never.png").exists())
