"""Run the dashboard broadcaster on its own, so cell history accrues while nobody watches."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from django.core.management.base import BaseCommand

from dashboard.ticker import ticker_run


class Command(BaseCommand):
    help = "Build and broadcast the dashboard snapshot once per second (one process per tick wins)."

    def handle(self, *args: Any, **options: Any) -> None:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(ticker_run())
