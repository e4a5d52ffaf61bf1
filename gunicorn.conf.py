"""The production web server: gunicorn supervising uvicorn worker processes.

`gunicorn` run from the project folder reads this file by itself (`-c gunicorn.conf.py`
from anywhere else), so `gunicorn fairqueue.asgi:application` or plain `gunicorn` serves
HTTP, websockets and static files with the settings below; command-line flags override
them. Every setting comes from the environment (README, Running in production):

    WEB_BIND          address to listen on (default 127.0.0.1:8000; 0.0.0.0:8000 in a container)
    WEB_CONCURRENCY   worker processes (default two per CPU core)
    WEB_TIMEOUT       seconds a silent worker lives before gunicorn restarts it (default 30)
    WEB_GRACEFUL_TIMEOUT  seconds a worker gets to finish its requests on SIGTERM/SIGHUP (default 30)
    WEB_KEEPALIVE     seconds an idle keep-alive connection stays open (default 5; keep it
                      above the reverse proxy's own idle timeout)
    WEB_MAX_REQUESTS  restart a worker after this many requests (default 0: never)
    WEB_ACCESS_LOG    where to write the access log ("-" for stdout; default: none)
    FORWARDED_ALLOW_IPS  proxies whose X-Forwarded-* headers are trusted (gunicorn's own variable)
    WEB_CONTROL_SOCKET  a path for gunicorn's control socket (`gunicornc`); default: none, so
                      several servers on one host (tests, a demo beside them) never share one
    PROMETHEUS_MULTIPROC_DIR  where worker processes keep their request metrics (default: a
                      new temporary folder per server start)
"""

import gc
import glob
import os
import shutil
import tempfile

# Each worker process counts its own requests. prometheus_client chooses, when it is first
# imported, between per-process counters and counters kept in files that /metrics sums over
# all workers; so the folder must be in the environment before anything imports it, in this
# master process (a --preload imports the app here) and in every worker it forks.
METRICS_DIR_OWNED = not os.environ.get("PROMETHEUS_MULTIPROC_DIR")
if METRICS_DIR_OWNED:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="fairqueue-web-metrics-")
METRICS_DIR = os.environ["PROMETHEUS_MULTIPROC_DIR"]

from prometheus_client import multiprocess  # noqa: E402

CORES = os.cpu_count() or 1

wsgi_app = "fairqueue.asgi:application"
# An ASGI worker: HTTP through Django and websockets through Channels, on uvloop and httptools.
worker_class = "uvicorn_worker.UvicornWorker"
bind = [os.environ.get("WEB_BIND", "127.0.0.1:8000")]
# Requests are short and mostly wait on Redis and the database; two per core keeps both
# cores busy while some wait.
workers = int(os.environ.get("WEB_CONCURRENCY", 2 * CORES))
timeout = int(os.environ.get("WEB_TIMEOUT", 30))
graceful_timeout = int(os.environ.get("WEB_GRACEFUL_TIMEOUT", 30))
keepalive = int(os.environ.get("WEB_KEEPALIVE", 5))
max_requests = int(os.environ.get("WEB_MAX_REQUESTS", 0))
max_requests_jitter = max_requests // 10
accesslog = os.environ.get("WEB_ACCESS_LOG") or None
errorlog = "-"
proc_name = "fairqueue-web"
control_socket = os.environ.get("WEB_CONTROL_SOCKET") or "gunicorn.ctl"
control_socket_disable = not os.environ.get("WEB_CONTROL_SOCKET")


def on_starting(server: object) -> None:
    """Forget the metric files of an earlier run, or its counts would be added to this one's."""
    for path in glob.glob(os.path.join(METRICS_DIR, "*.db")):
        os.remove(path)


def post_worker_init(worker: object) -> None:
    """The worker has loaded the app (Django, its models, URLs and API): what it holds now
    lives as long as the process, so it goes into the collector's permanent generation
    (gc.freeze, after a collection so no garbage goes with it). Otherwise every full
    collection, which a request's allocations trigger now and then (a bulk of 500 jobs
    several), walks all of it again: a sixth of a bulk job's CPU (docs/throughput.md)."""
    gc.collect()
    gc.freeze()


def child_exit(server: object, worker: object) -> None:
    """A worker ended (restart, reload, crash): drop its live gauges; its counters stay summed."""
    multiprocess.mark_process_dead(worker.pid)  # type: ignore[attr-defined]


def on_exit(server: object) -> None:
    """The server stops: remove the metrics folder if this file made it."""
    if METRICS_DIR_OWNED:
        shutil.rmtree(METRICS_DIR, ignore_errors=True)
