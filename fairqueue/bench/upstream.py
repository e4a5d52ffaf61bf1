"""A fake rate-limited upstream on a local port: a real HTTP server in a thread that takes
`call_seconds` per call and answers 429 to a call that would make more than
`max_concurrent` calls at once (what an LLM provider's concurrency limit does).

`bench backoff` and its test point `demo.call` jobs at it and read its log: when each call
came, how it was answered, and the most calls it served at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self


@dataclass(frozen=True)
class Call:
    at: float  # time.time() when it arrived
    status: int


class FakeUpstream:
    """Start with `with FakeUpstream(...) as upstream:`; `upstream.url` is its address."""

    def __init__(self, *, max_concurrent: int, call_seconds: float, retry_after: float | None = None) -> None:
        self.max_concurrent = max_concurrent
        self.call_seconds = call_seconds
        self.retry_after = retry_after
        self.calls: list[Call] = []
        self.active = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-upstream", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/call"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                upstream._serve(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one line per call would drown the bench's output

        return Handler

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        with self._lock:
            refused = self.active >= self.max_concurrent
            if not refused:
                self.active += 1
                self.peak = max(self.peak, self.active)
            self.calls.append(Call(time.time(), 429 if refused else 200))
        if refused:
            request.send_response(429)
            if self.retry_after is not None:
                request.send_header("Retry-After", f"{self.retry_after:g}")
            request.send_header("Content-Length", "0")
            request.end_headers()
            return
        try:
            time.sleep(self.call_seconds)
        finally:
            with self._lock:
                self.active -= 1
        request.send_response(200)
        request.send_header("Content-Length", "2")
        request.end_headers()
        request.wfile.write(b"ok")

    def refusals_after(self, at: float) -> int:
        with self._lock:
            return sum(1 for c in self.calls if c.status == 429 and c.at >= at)

    def first_call_at(self) -> float | None:
        with self._lock:
            return self.calls[0].at if self.calls else None

    def served(self) -> int:
        with self._lock:
            return sum(1 for c in self.calls if c.status == 200)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
