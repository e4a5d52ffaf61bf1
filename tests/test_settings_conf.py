"""FairQueue's settings (fairqueue/conf.py): a partial FAIRQUEUE over documented defaults,
a wrong setting named by `manage.py check`, and docs/settings.md's table kept to the module."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.test import SimpleTestCase, override_settings

from fairqueue.checks import SETTINGS_ERROR
from fairqueue.conf import DEFAULTS, engine_url, fq_settings, settings_problems

DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"
ROW = re.compile(r"^\| `([A-Z_.]+)` \| `([^`]*)` \|")


def _flat(defaults: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in defaults.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class SettingsTableTests(SimpleTestCase):
    def test_every_default_is_in_the_table_and_every_row_is_a_default(self) -> None:
        rows = {m[1]: ast.literal_eval(m[2]) for line in DOC.read_text().splitlines() if (m := ROW.match(line))}
        self.assertEqual(rows, _flat(DEFAULTS), "docs/settings.md's keys and defaults against fairqueue.conf")


class MergeTests(SimpleTestCase):
    def test_a_partial_dict_keeps_every_other_default(self) -> None:
        problems, merged = settings_problems({"LEASE_SECONDS": 5, "WEBHOOKS": {"SENDERS": 2}})
        self.assertEqual(problems, [])
        self.assertEqual(merged.LEASE_SECONDS, 5)
        self.assertEqual(merged.WEBHOOKS.SENDERS, 2)
        self.assertEqual(merged.WEBHOOKS.TIMEOUT_SECONDS, DEFAULTS["WEBHOOKS"]["TIMEOUT_SECONDS"])
        self.assertEqual(merged.DISPATCH_LEASE_SECONDS, DEFAULTS["DISPATCH_LEASE_SECONDS"])

    def test_each_wrong_setting_is_named(self) -> None:
        problems, merged = settings_problems(
            {
                "LEASE_SECONDZ": 1,
                "LEASE_SECONDS": "30",
                "ISOLATED_POOL_SIZE": 0,
                "PULL_DELIVERIES": 1,
                "TASK_MODULES": "a.b",
                "WEBHOOKS": {"SENDER": 3},
                "BACKPRESSURE": {"MEMORY_HIGH": 0.5, "MEMORY_LOW": 0.7},
                "FORECAST": [],
            }
        )
        text = "\n".join(problems)
        for name in (
            'FAIRQUEUE["LEASE_SECONDZ"] is not a FairQueue setting',
            'FAIRQUEUE["LEASE_SECONDS"] must be a number',
            'FAIRQUEUE["ISOLATED_POOL_SIZE"] must be at least 1',
            'FAIRQUEUE["PULL_DELIVERIES"] must be True or False',
            'FAIRQUEUE["TASK_MODULES"] must be a list of strings',
            'FAIRQUEUE["WEBHOOKS"]["SENDER"] is not a FairQueue setting',
            'FAIRQUEUE["BACKPRESSURE"]["MEMORY_LOW"] (0.7) must be between 0 and the high mark (0.5)',
            'FAIRQUEUE["FORECAST"] must be a dict',
        ):
            self.assertIn(name, text)
        self.assertEqual(len(problems), 8, text)
        self.assertEqual(merged.LEASE_SECONDS, DEFAULTS["LEASE_SECONDS"], "a wrong value is left at its default")

    def test_manage_py_check_reports_it_and_a_process_reading_it_is_told_which(self) -> None:
        with override_settings(FAIRQUEUE={"RETENTION_DAYS": -1}):
            errors = [e for e in run_checks() if e.id == SETTINGS_ERROR]
            self.assertEqual(len(errors), 1)
            self.assertIn('FAIRQUEUE["RETENTION_DAYS"] must be 0', errors[0].msg)
            with self.assertRaisesMessage(ImproperlyConfigured, 'FAIRQUEUE["RETENTION_DAYS"]'):
                fq_settings()
        self.assertEqual([e for e in run_checks() if e.id == SETTINGS_ERROR], [])

    def test_no_fairqueue_setting_at_all_is_every_default(self) -> None:
        with override_settings(FAIRQUEUE={}):
            self.assertEqual(fq_settings().LEASE_SECONDS, DEFAULTS["LEASE_SECONDS"])
        with override_settings(FAIRQUEUE={"ENGINE_URL": "redis://engine:6379/3"}):
            self.assertEqual(engine_url(), "redis://engine:6379/3")
