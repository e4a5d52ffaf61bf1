"""Static files served by the app itself: WhiteNoise's middleware, streaming under ASGI.

WhiteNoise answers a static request with a synchronous file iterator; under ASGI Django
would read such a file whole into memory (and warn about it). Here a file's chunks are
read in a thread as the server sends them.

The middleware is synchronous, like WhiteNoise's, and sits last in MIDDLEWARE on purpose
(see settings.py): under ASGI, Django then runs the whole chain above it in one thread
instead of handing each other middleware's hooks to a thread one at a time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import IO

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import FileResponse, HttpRequest
from whitenoise.middleware import WhiteNoiseMiddleware
from whitenoise.responders import StaticFile

CHUNK_BYTES = 64 * 1024


async def file_chunks(file: IO[bytes]) -> AsyncIterator[bytes]:
    """A file's content in chunks, each read in a thread (disk reads never block the loop)."""
    read = sync_to_async(file.read, thread_sensitive=False)
    while chunk := await read(CHUNK_BYTES):
        yield chunk


async def no_body() -> AsyncIterator[bytes]:
    """The empty body of a HEAD or 304 answer (a synchronous one makes Django warn too)."""
    nothing: tuple[bytes, ...] = ()
    for chunk in nothing:
        yield chunk


class StaticFilesMiddleware(WhiteNoiseMiddleware):  # type: ignore[misc]
    @staticmethod
    def serve(static_file: StaticFile, request: HttpRequest) -> FileResponse:
        response: FileResponse = WhiteNoiseMiddleware.serve(static_file, request)
        if isinstance(request, ASGIRequest):
            file = response.file_to_stream
            response.streaming_content = file_chunks(file) if file is not None else no_body()
        return response
