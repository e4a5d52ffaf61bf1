"""Imports run one way: the engine is a standalone library, and the jobs layer has no
import hidden inside a function to dodge a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from django.test import SimpleTestCase

ROOT = Path(__file__).resolve().parent.parent


class ImportLayerTests(SimpleTestCase):
    def test_the_engine_imports_neither_django_nor_celery(self) -> None:
        probe = (
            "import sys, fairqueue.engine\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'celery', 'kombu', 'tenants'))\n"
            "print(','.join(bad))\n"
        )
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
        self.assertEqual(out.stdout.strip(), "", "fairqueue.engine pulled these in")

    def test_the_jobs_layer_imports_at_module_level_only(self) -> None:
        offenders = []
        for path in sorted((ROOT / "fairqueue" / "jobs").glob("*.py")):
            if path.name == "apps.py":  # AppConfig.ready() is Django's place for late imports
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    for inner in ast.walk(node):
                        if isinstance(inner, ast.Import | ast.ImportFrom):
                            offenders.append(f"{path.name}:{inner.lineno}")
        self.assertEqual(offenders, [])
