"""What the browser tests share: headless Chromium (Debian's package, driven by Playwright)
and a staff user who logs in through the admin's login page."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.test import SimpleTestCase

from tests.workers import ROOT

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
OUTPUT = ROOT / "var" / "test-output"  # screenshots the closing notes point at
STAFF_USERNAME = "ops"
STAFF_PASSWORD = "pw-ops-123"


def chromium_require(test: SimpleTestCase) -> None:
    """Fail (not skip) when Chromium is missing: a browser feature untested is not tested."""
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        test.fail("Chromium is missing: `apt-get install chromium` (.ci/run does) to run the browser test")
    OUTPUT.mkdir(parents=True, exist_ok=True)


def staff_create(*, superuser: bool = False) -> None:
    get_user_model().objects.create_user(STAFF_USERNAME, password=STAFF_PASSWORD, is_staff=True, is_superuser=superuser)


def chromium_launch(pw: Any, *extra_args: str) -> Any:
    return pw.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, *extra_args], headless=True)


def staff_login(page: Any, base: str, path: str) -> None:
    """Log in through the admin's login page and land on `path`."""
    page.goto(f"{base}/admin/login/?next={path}")
    page.fill("#id_username", STAFF_USERNAME)
    page.fill("#id_password", STAFF_PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"{base}{path}")
