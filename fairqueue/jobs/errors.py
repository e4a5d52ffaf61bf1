"""The one error type the jobs side raises for a client: it carries its HTTP answer."""

from __future__ import annotations


class JobError(Exception):
    """A client error with the HTTP status, machine code and field it concerns."""

    def __init__(
        self, status: int, code: str, message: str, field: str | None = None, *, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.retry_after = retry_after  # seconds, sent as Retry-After (a 429's)
