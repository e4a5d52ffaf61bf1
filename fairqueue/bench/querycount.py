"""SQL statements counted in every process of a benchmark's stack (`bench throughput`).

Installed only when FAIRQUEUE_BENCH_QUERY_COUNT_DIR is set (settings then adds this
package as an app; see apps.py): every database connection the process opens gets an
execute wrapper that counts the statements sent through a cursor (a multi-row INSERT is
one; BEGIN and COMMIT are not statements sent this way and are not counted), and the
process's running total is kept in one file of that folder, rewritten in place on each
statement. The bench sums the files before and after a phase.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.db.backends.signals import connection_created

_counted = 0
_count_lock = threading.Lock()
_fd: int | None = None
_lock = threading.Lock()
COUNT_WIDTH = 20
FLUSH_SECONDS = 0.1
SETTLE_SECONDS = 3 * FLUSH_SECONDS  # every process has written what it counted before then


def _count(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
    global _counted
    with _count_lock:
        _counted += 1
    return execute(sql, params, many, context)


def _flush_forever(fd: int) -> None:
    while True:
        os.pwrite(fd, f"{_counted:>{COUNT_WIDTH}}\n".encode(), 0)
        time.sleep(FLUSH_SECONDS)


def _on_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    if _count not in connection.execute_wrappers:
        connection.execute_wrappers.append(_count)


def install(directory: str) -> None:
    """Count this process's statements into `directory`/<pid> from now on."""
    global _fd
    with _lock:
        if _fd is not None:
            return
        Path(directory).mkdir(parents=True, exist_ok=True)
        _fd = os.open(Path(directory) / str(os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        threading.Thread(target=_flush_forever, args=(_fd,), name="bench-querycount", daemon=True).start()
    connection_created.connect(_on_connection, dispatch_uid="fq_bench_querycount")


def total(directory: str | Path) -> int:
    """The statements counted so far by every process that wrote into `directory`."""
    time.sleep(SETTLE_SECONDS)
    count = 0
    for path in Path(directory).iterdir():
        text = path.read_text().strip()
        if text:
            count += int(text)
    return count
