"""The REST API's own ASGI handler: no thread per request, and only the middleware it uses.

Under Django's ASGI handler every request gets a thread of its own (asgiref's
thread-sensitive context starts one per request, even for an async view, to run the
request signals), and each synchronous middleware hook is handed to that thread. For a
`POST /api/v1/jobs`, whose own work is one INSERT and two Redis round trips, that
framework cost was most of the request. `/api/` paths therefore go to ApiASGIHandler
(fairqueue/asgi.py routes them):

- the API's views are async and run their synchronous work (authentication, the service
  and its database and Redis calls) through `in_api_thread`: one call per step, on a
  fixed pool of API_THREADS threads per process that is reused, never a new thread;
- the middleware is settings.MIDDLEWARE without what a bearer-key JSON API never reads
  (sessions, users, messages, CSRF, static files). What remains (metrics, security
  headers and redirects, the host check, tracing) are hook-style middleware whose hooks
  do no I/O: they run inline on the event loop instead of a thread hop each;
- Django's request signals and `response.close` are called inline on the event loop when
  every receiver is one of INLINE_SIGNAL_RECEIVERS (Django's own: they look after the
  calling thread's connections, caches and URLconf, of which the loop holds none), else
  in asgiref's one shared sync thread as Django does; ninja's own schema and docs pages
  (synchronous views) run there too;
- no task listens for the client's disconnect to cancel the view: an API request's work
  runs to its end on the pool whether or not its client is still there.

Outside this handler (the test client, a sync caller) `in_api_thread` falls back to
Django's default, the caller's thread-sensitive thread, so a test's transaction still
sees and rolls back what a view wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar, cast

from asgiref.sync import markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import ImproperlyConfigured, MiddlewareNotUsed, RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.exception import convert_exception_to_response
from django.db import close_old_connections
from django.dispatch import Signal
from django.http import HttpRequest, HttpResponseBase
from django.urls import set_script_prefix
from django.utils.deprecation import MiddlewareMixin
from django.utils.module_loading import import_string

from fairqueue.conf import fq_settings
from fairqueue.mount import api_prefix

P = ParamSpec("P")
T = TypeVar("T")

# Middleware a bearer-key JSON API never reads: no session, user, message, CSRF cookie or
# static file is involved in any /api/ request (ninja's CSRF check is off for key auth), and
# it changes no policy (whose history the history middleware tells who changed it).
API_SKIPPED_MIDDLEWARE = frozenset(
    {
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "simple_history.middleware.HistoryRequestMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
        "fairqueue.staticfiles.StaticFilesMiddleware",
    }
)

# Hook-style middleware that is no MiddlewareMixin but whose __call__ only runs its hooks
# (OpenTelemetry's, which tracing adds to MIDDLEWARE when it is on).
HOOK_STYLE_MIDDLEWARE = frozenset({"opentelemetry.instrumentation.django.middleware.otel_middleware._DjangoMiddleware"})

# Receivers of request_started / request_finished called inline on the event loop: each
# only resets or closes what the calling thread (or context) holds, and an API request's
# loop holds no database connection, cache client or URLconf override (its database work
# runs on the pool, whose connections _with_connections looks after). Any other receiver
# is sent through asgiref's sync thread, as Django's handler does.
INLINE_SIGNAL_RECEIVERS = frozenset(
    {
        "django.db.reset_queries",
        "django.db.close_old_connections",
        "django.core.cache.close_caches",
        "django.core.handlers.base.reset_urlconf",
    }
)

# Set for the duration of a request that came through ApiASGIHandler.
_in_api_handler: contextvars.ContextVar[bool] = contextvars.ContextVar("fairqueue_api_handler", default=False)
_pool_lock = threading.Lock()
_pool: ApiPool | None = None


class ApiPool:
    """A fixed set of threads running the API's synchronous calls for the event loop.

    What `loop.run_in_executor(ThreadPoolExecutor)` does, without its two futures per call
    (a concurrent one, locked and chained to the loop's by callbacks) and its per-call
    thread-count check (a semaphore): a call goes into one queue with the loop's own future,
    and the thread that runs it settles that future on the loop. A call whose future was
    cancelled before a thread took it is not run (as an executor drops a cancelled one); one
    already running runs to its end. The threads are daemons: gunicorn's graceful stop ends
    a worker's requests before its process exits, and nothing else waits on them."""

    def __init__(self, threads: int, *, name: str = "fq-api") -> None:
        self._calls: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[[], Any]]]
        self._calls = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._serve, name=f"{name}_{i}", daemon=True).start()

    def run(self, call: Callable[[], T]) -> asyncio.Future[T]:
        """Run `call` on a pool thread; its result (or exception) on the running loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((loop, future, call))
        return future

    def _serve(self) -> None:
        while True:
            self._run_one(*self._calls.get())

    @staticmethod
    def _run_one(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], call: Callable[[], Any]) -> None:
        if future.cancelled():
            return
        result, error = None, None
        try:
            result = call()
        except BaseException as exc:  # as an executor: the awaiting request gets it, the thread lives on
            error = exc
        # A closed loop (RuntimeError) has nobody awaiting the answer any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_future_settle, future, result, error)


def _future_settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _api_pool() -> ApiPool:
    # Made on first use, in the serving process (gunicorn forks workers; threads do not survive a fork).
    global _pool
    if _pool is not None:
        return _pool
    with _pool_lock:
        if _pool is None:
            _pool = ApiPool(fq_settings().API_THREADS)
        return _pool


def _with_connections(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """One step of a request in a pool thread, with the connection care Django gives a
    request: broken or expired connections dropped before, and after, so a pooled
    PostgreSQL connection goes back to its pool (CONN_MAX_AGE 0) between requests."""
    close_old_connections()
    try:
        return fn(*args, **kwargs)
    finally:
        close_old_connections()


def in_api_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Awaitable[T]:
    """Run synchronous work (database, Redis) of an async API view off the event loop: on
    the API's thread pool under ApiASGIHandler, else in the caller's thread-sensitive
    thread as Django would. Context variables (the request's trace span) go along."""
    if _in_api_handler.get():
        # The API's own pool (not asgiref's SyncToAsync, which also re-homes its Local
        # storage and shields the call): Django's connections are plain thread-locals, and
        # context variables are carried by running the call in a copy of this context.
        context = contextvars.copy_context()

        call: Callable[[], T] = functools.partial(_with_connections, fn, *args, **kwargs)
        return _api_pool().run(functools.partial(context.run, call))
    return sync_to_async(fn)(*args, **kwargs)


class _InlineHooks:
    """A hook-style middleware (MiddlewareMixin's shape) with its process_request and
    process_response called on the event loop: MiddlewareMixin's own async path hands each
    hook to a thread. Only for middleware whose hooks do no I/O."""

    async_capable = True
    sync_capable = False

    def __init__(self, middleware: Any, get_response: Callable[[HttpRequest], Awaitable[Any]]) -> None:
        self.middleware = middleware
        self.get_response = get_response
        markcoroutinefunction(self)  # so that Django's adapters see an async middleware
        self.process_request = getattr(middleware, "process_request", None)
        self.process_response = getattr(middleware, "process_response", None)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.process_request(request) if self.process_request else None
        if response is None:
            response = await self.get_response(request)
        if self.process_response:
            response = self.process_response(request, response)
        return response  # type: ignore[no-any-return]


def _receivers_inline(signal: Signal, sender: type) -> bool:
    """Whether every live receiver of `signal` for `sender` is in INLINE_SIGNAL_RECEIVERS."""
    sync_receivers, async_receivers = signal._live_receivers(sender)
    return not async_receivers and all(
        f"{getattr(r, '__module__', '')}.{getattr(r, '__qualname__', '')}" in INLINE_SIGNAL_RECEIVERS
        for r in sync_receivers
    )


async def _send_signal(signal: Signal, sender: type, **named: Any) -> None:
    if _receivers_inline(signal, sender):
        signal.send(sender=sender, **named)
    else:
        await signal.asend(sender=sender, **named)


async def _close_response(response: HttpResponseBase, sender: type) -> None:
    """response.close() (which sends request_finished): inline when it closes no file of its
    own (only the request's uploads, which an API request has none of) and
    request_finished's receivers are inline ones."""
    closers = getattr(response, "_resource_closers", ())  # what close() closes (Django's, not in its stubs)
    closes_request_only = all(isinstance(getattr(c, "__self__", None), HttpRequest) for c in closers)
    if closes_request_only and _receivers_inline(signals.request_finished, sender):
        response.close()
    else:
        await sync_to_async(response.close)()


def _inline(method: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    async def call(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    return call


def api_middleware() -> list[str]:
    """The middleware of /api/ requests: settings.MIDDLEWARE (read now: tracing adds its
    own at start-up) without API_SKIPPED_MIDDLEWARE."""
    return [path for path in settings.MIDDLEWARE if path not in API_SKIPPED_MIDDLEWARE]


class ApiASGIHandler(ASGIHandler):
    """Django's ASGI handler for /api/ paths: api_middleware() inline, no per-request thread."""

    def load_middleware(self, is_async: bool = False) -> None:
        # Django's load_middleware, for a fixed list of hook-style middleware run inline.
        self._view_middleware: list[Any] = []
        self._template_response_middleware: list[Any] = []
        self._exception_middleware: list[Any] = []
        handler: Any = convert_exception_to_response(self._get_response_async)  # type: ignore[attr-defined]
        for path in reversed(api_middleware()):
            factory = import_string(path)
            # A MiddlewareMixin subclass with its own __call__ does more than its hooks.
            hook_style = path in HOOK_STYLE_MIDDLEWARE or (
                isinstance(factory, type)
                and issubclass(factory, MiddlewareMixin)
                and factory.__call__ is MiddlewareMixin.__call__
            )
            if not hook_style:
                raise ImproperlyConfigured(
                    f"{path}: /api/ requests run only hook-style middleware (MiddlewareMixin) inline; "
                    "add it to fairqueue.apiserver.API_SKIPPED_MIDDLEWARE or make it one"
                )
            try:
                instance = factory(handler)
            except MiddlewareNotUsed:
                continue
            if hasattr(instance, "process_view"):
                self._view_middleware.insert(0, _inline(instance.process_view))
            if hasattr(instance, "process_template_response"):
                self._template_response_middleware.append(_inline(instance.process_template_response))
            if hasattr(instance, "process_exception"):
                # Django runs the exception hooks synchronously (in a thread) in both modes.
                self._exception_middleware.append(instance.process_exception)
            handler = convert_exception_to_response(_InlineHooks(instance, handler))
        self._middleware_chain = handler

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"ApiASGIHandler serves HTTP only, not {scope['type']}")
        # No ThreadSensitiveContext (Django's handler opens one per request, and with it a
        # new thread): the views' work runs on the API pool (in_api_thread).
        token = _in_api_handler.set(True)
        try:
            await self.handle(scope, receive, send)
        finally:
            _in_api_handler.reset(token)

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Django's ASGIHandler.handle with its signals and response close inline when their
        receivers allow it (_send_signal, _close_response), and the view awaited directly
        rather than raced against a disconnect listener (two tasks per request)."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        try:
            set_script_prefix(get_script_prefix(scope))
            await _send_signal(signals.request_started, self.__class__, scope=scope)
            request, error_response = self.create_request(scope, body_file)
            if request is None:  # create_request gives a request or the answer refusing it
                response = cast(HttpResponseBase, error_response)
            else:
                response = await self.run_get_response(request)
            await self.send_response(response, send)
            await _close_response(response, self.__class__)
        finally:
            body_file.close()


def is_api_path(scope: dict[str, Any]) -> bool:
    """Whether the request's path below the script prefix (Django's path_info) is under the
    REST API's prefix (`<where the host mounted fairqueue.urls>api/`, fairqueue/mount.py)."""
    prefix = api_prefix()
    if prefix is None:
        return False
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path.startswith(prefix)


class HttpRouter:
    """HTTP: /api/ paths to ApiASGIHandler, everything else to Django's handler."""

    def __init__(self, *, api: ApiASGIHandler, default: Callable[..., Awaitable[None]]) -> None:
        self.api = api
        self.default = default

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        handler = self.api if is_api_path(scope) else self.default
        await handler(scope, receive, send)
