"""Django settings. The environment is read here and only here (django-environ)."""

import sys
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from fairqueue.queues import (
    BROKER_CONNECT_TIMEOUT_SECONDS,
    JOBS_QUEUE,
    UnsupportedBroker,
    broker_transport_options,
    task_queues,
)

BASE_DIR = Path(__file__).resolve().parent.parent
RUNNING_TESTS = len(sys.argv) > 1 and sys.argv[1] == "test"

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

# --- Core -------------------------------------------------------------------------
DEBUG = env.bool("DEBUG", default=False)
# The demo and tests run without a configured secret; anything else must set one.
DEMO_MODE = env.bool("FAIRQUEUE_DEMO", default=DEBUG or RUNNING_TESTS)
SECRET_KEY = env.str("SECRET_KEY", default="insecure-demo-only-key" if DEMO_MODE else "")
if not SECRET_KEY:
    raise ImproperlyConfigured(
        "SECRET_KEY must be set outside the demo: export SECRET_KEY=<50+ random characters> "
        "(e.g. from `python -c 'import secrets; print(secrets.token_urlsafe(50))'`), "
        "or run the local demo with FAIRQUEUE_DEMO=1."
    )
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_prometheus",
    "ninja",  # the API docs' Swagger UI from ninja's bundled static files, not a CDN
    "channels",
    "simple_history",  # who changed policy, old -> new (tenants/history.py)
    "fairqueue",
    "tenants",
    "fairqueue.jobs",
    "webhooks",
    "dashboard",
]
# The demo's own tasks (demo.sleep, demo.parse, demo.noop) are registered only in the demo
# (and tests) unless asked for: in production any tenant could submit an hour-long sleep.
DEMO_TASKS = env.bool("FAIRQUEUE_DEMO_TASKS", default=DEMO_MODE)  # FAIRQUEUE["DEMO_TASKS"] below
# The demo's memory-hungry task (demo.hungry) stands in for a container's memory limit: past
# this resident size (MB) it SIGKILLs its worker, as the kernel's OOM killer would. 0: no limit.
# `make demo` gives its normal workers a small one and its quarantine worker none.
FAIRQUEUE_DEMO_WORKER_MEMORY_MB = env.int("FAIRQUEUE_DEMO_WORKER_MEMORY_MB", default=0)
if DEMO_TASKS:
    # The example app of docs/tasks.md ("Writing your own tasks"): its tasks are discovered
    # like any installed app's (a `fairqueue_tasks` module), and the test suite runs them.
    INSTALLED_APPS.append("examples.invoices")

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Tells a policy model's history who made a change in a request (sync and async alike).
    "simple_history.middleware.HistoryRequestMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
    # Static files (WhiteNoise). Last and synchronous on purpose: under ASGI, Django then runs
    # the middleware above in one thread per request; with none synchronous at the bottom it
    # hands every process_request/process_response above to a thread one by one (docs/web.md).
    # Static requests pass the other middleware first: little cost, once per browser.
    "fairqueue.staticfiles.StaticFilesMiddleware",
]

# `bench throughput` counts the SQL statements of every process of its stack.
FAIRQUEUE_BENCH_QUERY_COUNT_DIR = env.str("FAIRQUEUE_BENCH_QUERY_COUNT_DIR", default="")
if FAIRQUEUE_BENCH_QUERY_COUNT_DIR:
    INSTALLED_APPS.append("fairqueue.bench")

ROOT_URLCONF = "fairqueue.project_urls"
WSGI_APPLICATION = "fairqueue.wsgi.application"
ASGI_APPLICATION = "fairqueue.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -----------------------------------------------------------------------
DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
TEST_RUNNER = "tests.runner.FairQueueTestRunner"
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Workers and the web process write concurrently: WAL lets readers proceed, and
    # IMMEDIATE transactions take the write lock up front instead of failing mid-way.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # A file (not :memory:) so that real worker processes started by tests share it.
    DATABASES["default"]["TEST"] = {
        "NAME": env.str("FAIRQUEUE_TEST_DB_NAME", default=str(BASE_DIR / "test_db.sqlite3"))
    }
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # A pool of open connections per process (psycopg_pool). Under ASGI each request runs
    # its database work in a thread of its own, so a persistent connection (kept per
    # thread) leaked with every request until PostgreSQL refused new clients, and a fresh
    # connection per request costs a backend fork; a pooled one is handed over in
    # microseconds. Workers' threads draw from the same kind of pool.
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": env.int("FAIRQUEUE_DB_POOL_SIZE", default=12),
        # How long a caller waits for a connection when none is free, or while the server
        # is away: past it the API answers 503 database_unavailable instead of hanging.
        "timeout": env.float("FAIRQUEUE_DB_POOL_TIMEOUT", default=2.0),
        # The pool retries a failed connection with a doubling delay; after this many seconds
        # it gives that attempt up and the next caller starts a fresh one at once. Without a
        # bound the delay grows with the outage, and a database that came back stays unused
        # for up to half as long as it was away.
        "reconnect_timeout": env.float("FAIRQUEUE_DB_RECONNECT_SECONDS", default=5.0),
    }
    # A connection attempt to a server that does not answer (a failover in progress, a
    # host gone) gives up after this many seconds (libpq's minimum is 2).
    DATABASES["default"]["OPTIONS"].setdefault("connect_timeout", env.int("FAIRQUEUE_DB_CONNECT_TIMEOUT", default=2))
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # connections go back to the pool, not closed
    if env.str("FAIRQUEUE_TEST_DB_NAME", default=""):  # test shards side by side (scripts/test_shards.py)
        DATABASES["default"]["TEST"] = {"NAME": env.str("FAIRQUEUE_TEST_DB_NAME")}
else:
    # Persistent connections: Celery closes a connection after every task unless it may live
    # on, and reconnecting per job (with SQLite's pragmas) was a measurable share of its cost.
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=60)
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis ----------------------------------------------------------------------------
# REDIS_URL serves every role unless a role has its own URL: engine state (which may be a
# Redis Cluster), the Celery broker, the channel layer and the cache (README, "Running in
# production"). Tests use their own Redis database for every role and refuse to run on a
# non-empty one (tests/base.py); they ignore the roles' variables, so a test run can never
# touch a deployment's servers (a test that wants roles apart sets them itself).
REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")
if RUNNING_TESTS:
    REDIS_URL = env.str("FAIRQUEUE_TEST_REDIS_URL", default="redis://127.0.0.1:6379/15")


def _role_url(variable: str) -> str:
    """A role's URL (CELERY_BROKER_URL in the Celery section uses it too)."""
    return REDIS_URL if RUNNING_TESTS else env.str(variable, default=REDIS_URL)


# The engine's state and the jobs side's fleet-wide keys (worker registry, stats, policy,
# live signals, leases). A node of a Redis Cluster is detected (fairqueue.engine.cluster).
# Empty means REDIS_URL, looked up when a client is made (fairqueue/conf.py), so tests that
# point REDIS_URL elsewhere move the engine with it. FAIRQUEUE["ENGINE_URL"] below.
_ENGINE_URL = "" if RUNNING_TESTS else env.str("FAIRQUEUE_ENGINE_URL", default="")
CHANNELS_REDIS_URL = _role_url("CHANNELS_REDIS_URL")
CACHE_URL = _role_url("CACHE_URL")

CACHES = {"default": {**env.cache_url_config(CACHE_URL), "KEY_PREFIX": "fq:cache"}}
if CACHES["default"]["BACKEND"] == "django_redis.cache.RedisCache":
    CACHES["default"]["OPTIONS"] = {"CLIENT_CLASS": "django_redis.client.DefaultClient"}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [CHANNELS_REDIS_URL], "prefix": "fq:channels:"},
    }
}

# --- Celery -----------------------------------------------------------------------------
# Redis (the default: REDIS_URL) or RabbitMQ (amqp://user:password@host:5672/vhost);
# fairqueue/queues.py says how each one keeps the latency classes' strict order.
CELERY_BROKER_URL = _role_url("CELERY_BROKER_URL")
try:
    CELERY_TASK_QUEUES = task_queues(CELERY_BROKER_URL)
except UnsupportedBroker as exc:
    raise ImproperlyConfigured(f"CELERY_BROKER_URL: {exc}") from exc
_VISIBILITY_TIMEOUT = env.int(
    "FAIRQUEUE_VISIBILITY_TIMEOUT", default=6 * 3600
)  # FAIRQUEUE["VISIBILITY_TIMEOUT_SECONDS"]
# This project's workers run only FairQueue's jobs, so its app uses FairQueue's transport
# options and queues for everything (a plain `celery -A fairqueue worker` is a FairQueue
# worker). A host running tasks of its own leaves both out: FairQueue applies them to its own
# connections and workers (docs/celery.md).
CELERY_BROKER_TRANSPORT_OPTIONS = broker_transport_options(CELERY_BROKER_URL, visibility_timeout=_VISIBILITY_TIMEOUT)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
# FairQueue's task acknowledges late and its workers prefetch one message per slot by
# themselves (fairqueue/jobs/tasks.py, fairqueue/jobs/celery_host.py): nothing to set here.
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A worker outlives a broker outage of any length (it keeps retrying) rather than exiting.
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
# A broker that does not answer (RabbitMQ restarting) fails a publish within this long.
CELERY_BROKER_CONNECTION_TIMEOUT = BROKER_CONNECT_TIMEOUT_SECONDS
# Every worker, `celery -A fairqueue worker` or `manage.py worker`, consumes CELERY_TASK_QUEUES:
# latency classes are message priorities in fq.jobs, and the batch lane is read only when
# no class waits (fq.batch on Redis, the lowest priority of fq.jobs on RabbitMQ).
CELERY_TASK_DEFAULT_QUEUE = JOBS_QUEUE
# Jobs renew their leases from a thread of the process that runs them, and the fleet
# registry counts them there: a FairQueue worker runs the threads pool (this project's
# workers are all FairQueue's; a host passes `-P threads` on its FairQueue worker's line).
CELERY_WORKER_POOL = env("FAIRQUEUE_WORKER_POOL", default="threads")
CELERY_WORKER_CONCURRENCY = env.int("FAIRQUEUE_WORKER_SLOTS", default=4)
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# --- Django Tasks ---------------------------------------------------------------------------
# `@task` functions enqueue through FairQueue's throttle (docs/django-tasks.md): the tenant
# is the task's queue_name, or OPTIONS["TENANT"] for the default queue.
TASKS = {"default": {"BACKEND": "fairqueue.tasks_backend.FairQueueBackend"}}

# --- Static files ------------------------------------------------------------------------
# The app serves /static/ itself (WhiteNoise, fairqueue/staticfiles.py), so the admin, the
# dashboard and the API docs need no proxy rule or CDN, on-premises and offline too.
# Production serves what `collectstatic` wrote to STATIC_ROOT: content-hashed names cached
# for a year, gzip copies beside them. With DEBUG it serves the apps' folders directly.
STATIC_URL = "static/"
STATIC_ROOT = env.path("STATIC_ROOT", default=BASE_DIR / "var" / "static")
STATICFILES_BACKEND = "whitenoise.storage.CompressedManifestStaticFilesStorage"
if RUNNING_TESTS:
    # Tests render pages with DEBUG off: hashed names would need a collectstatic first
    # (the production server's tests run one for the server they start).
    STATICFILES_BACKEND = "django.contrib.staticfiles.storage.StaticFilesStorage"
# Where the production server's worker processes keep request metrics that /metrics sums
# (gunicorn.conf.py sets it for its workers; prometheus_client reads it from the environment).
PROMETHEUS_MULTIPROC_DIR = env.str("PROMETHEUS_MULTIPROC_DIR", default="")

# --- FairQueue ----------------------------------------------------------------------------
# Every key has a default in fairqueue/conf.py (docs/settings.md); this project sets them all
# from its environment, a host sets only what it changes. `manage.py check` names a wrong one.
FAIRQUEUE = {
    "ENGINE_URL": _ENGINE_URL,
    "DEMO_TASKS": DEMO_TASKS,
    "VISIBILITY_TIMEOUT_SECONDS": _VISIBILITY_TIMEOUT,
    "PREFETCH_MULTIPLIER": env.int("FAIRQUEUE_PREFETCH_MULTIPLIER", default=1),
    "PROMETHEUS_MULTIPROC_DIR": PROMETHEUS_MULTIPROC_DIR,
    # Seconds a running job's hold lives without a heartbeat.
    "LEASE_SECONDS": env.float("FAIRQUEUE_LEASE_SECONDS", default=30.0),
    # Seconds an admitted job may wait in the broker before a worker starts it.
    "DISPATCH_LEASE_SECONDS": env.float("FAIRQUEUE_DISPATCH_LEASE_SECONDS", default=600.0),
    "PAYLOAD_THRESHOLD_BYTES": env.int("FAIRQUEUE_PAYLOAD_THRESHOLD_BYTES", default=256 * 1024),
    "PAYLOAD_DIR": env.str("FAIRQUEUE_PAYLOAD_DIR", default=str(BASE_DIR / "var" / "payloads")),
    "MAX_REQUEST_BYTES": env.int("FAIRQUEUE_MAX_REQUEST_BYTES", default=16 * 1024 * 1024),
    # Threads per web process that run the REST API's database and Redis work
    # (fairqueue/apiserver.py); keep it below the database pool's size (FAIRQUEUE_DB_POOL_SIZE).
    "API_THREADS": env.int("FAIRQUEUE_API_THREADS", default=8),
    "POISON_PILL_LIMIT": env.int("FAIRQUEUE_POISON_PILL_LIMIT", default=3),
    # Group commit (fairqueue/jobs/groupcommit.py): a worker process sends the claims (and,
    # apart, the outcomes) its threads make at once as one statement; a batch waits at most
    # this long for a thread on its way to it (a lone thread waits for nothing). 0 sends
    # each job's own statement. docs/throughput.md says why 6.
    "GROUP_COMMIT_MS": env.float("FAIRQUEUE_GROUP_COMMIT_MS", default=6.0),
    # A worker slot whose job ended takes the broker's next delivery itself instead of
    # waiting for Celery's consumer to fetch it (fairqueue/jobs/handoff.py; Redis broker).
    "PULL_DELIVERIES": env.bool("FAIRQUEUE_PULL_DELIVERIES", default=True),
    # The worker's per-job statements (row read, claim, outcome) prepared once per PostgreSQL
    # connection (fairqueue/jobs/prepared.py); 0 sends them as plain text, e.g. behind a
    # pooler in transaction mode that does not carry prepared statements.
    "DB_PREPARED": env.bool("FAIRQUEUE_DB_PREPARED", default=True),
    # On SIGTERM, running jobs get this long to finish before they are handed back.
    "SHUTDOWN_GRACE_SECONDS": env.float("FAIRQUEUE_SHUTDOWN_GRACE_SECONDS", default=30.0),
    "METRICS_TOKEN": env.str("FAIRQUEUE_METRICS_TOKEN", default=""),
    # The live dashboard's tenant table: this many tenants, those that need attention most
    # (plus the ones a page pins or searches for); the fleet's totals stay exact.
    "DASHBOARD_TOP_TENANTS": env.int("FAIRQUEUE_DASHBOARD_TOP_TENANTS", default=50),
    # A worker hands back a job whose task (or arguments) its version does not know, for
    # another worker; after this long since the first hand-back the job fails `unknown_task`.
    "HANDBACK_SECONDS": env.float("FAIRQUEUE_HANDBACK_SECONDS", default=300.0),
    # Tasks are discovered in every installed app's `fairqueue_tasks` module (docs/tasks.md);
    # these modules are imported at start-up too (tasks kept outside an app).
    "TASK_MODULES": env.list("FAIRQUEUE_TASK_MODULES", default=[]),
    # Child processes per worker process that run isolated tasks (fairqueue/jobs/isolation.py);
    # an isolated job finding them all busy waits in its slot for one.
    "ISOLATED_POOL_SIZE": env.int("FAIRQUEUE_ISOLATED_POOL_SIZE", default=2),
    # Completion webhooks (webhooks/). Targets on private, loopback, link-local or other
    # non-public addresses are refused unless inside one of ALLOWED_NETWORKS (CIDRs, e.g.
    # "10.0.0.0/8" for an internal receiver). Failed deliveries are retried with
    # exponential backoff (first, doubling, capped) until MAX_AGE after the event.
    "WEBHOOKS": {
        "ALLOWED_NETWORKS": env.list("FAIRQUEUE_WEBHOOK_ALLOWED_NETWORKS", default=[]),
        "TIMEOUT_SECONDS": env.float("FAIRQUEUE_WEBHOOK_TIMEOUT_SECONDS", default=5.0),
        "BACKOFF_FIRST_SECONDS": env.float("FAIRQUEUE_WEBHOOK_BACKOFF_FIRST_SECONDS", default=10.0),
        "BACKOFF_MAX_SECONDS": env.float("FAIRQUEUE_WEBHOOK_BACKOFF_MAX_SECONDS", default=3600.0),
        "MAX_AGE_SECONDS": env.float("FAIRQUEUE_WEBHOOK_MAX_AGE_SECONDS", default=24 * 3600.0),
        # Deliveries in flight at once, on threads of the worker that holds the duty lease
        # (never its job slots).
        "SENDERS": env.int("FAIRQUEUE_WEBHOOK_SENDERS", default=8),
    },
    # Finished jobs older than this many days are deleted by the periodic duties; 0 keeps them.
    "RETENTION_DAYS": env.float("FAIRQUEUE_RETENTION_DAYS", default=30.0),
    # Resource backpressure (fairqueue/jobs/backpressure.py): per worker, so each host's
    # environment sets its own. Marks are shares (0..1); a high mark of 0 turns a signal off.
    # CPU and CPU/IO stalls are off by default: a fleet sized to run hot is busy by design.
    "BACKPRESSURE": {
        "ENABLED": env.bool("FAIRQUEUE_BACKPRESSURE", default=True),
        "SAMPLE_SECONDS": env.float("FAIRQUEUE_BACKPRESSURE_SAMPLE_SECONDS", default=0.25),
        # 0: the cgroup's memory.max, or the machine's RAM outside a limited cgroup.
        "MEMORY_LIMIT_BYTES": env.int("FAIRQUEUE_WORKER_MEMORY_LIMIT_BYTES", default=0),
        "MEMORY_HIGH": env.float("FAIRQUEUE_BACKPRESSURE_MEMORY_HIGH", default=0.90),
        "MEMORY_LOW": env.float("FAIRQUEUE_BACKPRESSURE_MEMORY_LOW", default=0.80),
        "CPU_HIGH": env.float("FAIRQUEUE_BACKPRESSURE_CPU_HIGH", default=0.0),
        "CPU_LOW": env.float("FAIRQUEUE_BACKPRESSURE_CPU_LOW", default=0.0),
        "PSI_CPU_HIGH": env.float("FAIRQUEUE_BACKPRESSURE_PSI_CPU_HIGH", default=0.0),
        "PSI_CPU_LOW": env.float("FAIRQUEUE_BACKPRESSURE_PSI_CPU_LOW", default=0.0),
        "PSI_MEMORY_HIGH": env.float("FAIRQUEUE_BACKPRESSURE_PSI_MEMORY_HIGH", default=0.25),
        "PSI_MEMORY_LOW": env.float("FAIRQUEUE_BACKPRESSURE_PSI_MEMORY_LOW", default=0.10),
        "PSI_IO_HIGH": env.float("FAIRQUEUE_BACKPRESSURE_PSI_IO_HIGH", default=0.0),
        "PSI_IO_LOW": env.float("FAIRQUEUE_BACKPRESSURE_PSI_IO_LOW", default=0.0),
        "MIN_SLOTS": env.int("FAIRQUEUE_BACKPRESSURE_MIN_SLOTS", default=1),
        "STEP_SECONDS": env.float("FAIRQUEUE_BACKPRESSURE_STEP_SECONDS", default=1.0),
        "RECOVER_SECONDS": env.float("FAIRQUEUE_BACKPRESSURE_RECOVER_SECONDS", default=10.0),
    },
    # Slots desired (fairqueue/jobs/capacity.py): the forecast looks one warm-up ahead, the
    # time from asking for a worker to its first job (node, image pull, start-up).
    "FORECAST": {
        "WARMUP_SECONDS": env.float("FAIRQUEUE_FLEET_WARMUP_SECONDS", default=600.0),
        "WEEKS": env.int("FAIRQUEUE_FORECAST_WEEKS", default=4),
        "DECAY": env.float("FAIRQUEUE_FORECAST_DECAY", default=0.5),  # weight of each older week
        # Headroom for the random spread around the hourly mean, in standard deviations.
        "SPREAD_SIGMAS": env.float("FAIRQUEUE_FORECAST_SPREAD_SIGMAS", default=1.0),
        "REFRESH_SECONDS": env.float("FAIRQUEUE_FORECAST_REFRESH_SECONDS", default=900.0),
        "RECORD_SECONDS": env.float("FAIRQUEUE_CAPACITY_RECORD_SECONDS", default=60.0),
        "HISTORY_POINTS": env.int("FAIRQUEUE_CAPACITY_HISTORY_POINTS", default=180),  # 3 h at one a minute
    },
}
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": STATICFILES_BACKEND},
    # Offloaded job arguments and results; swap in a django-storages backend to share it.
    "payloads": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": FAIRQUEUE["PAYLOAD_DIR"]},
    },
}
DATA_UPLOAD_MAX_MEMORY_SIZE = FAIRQUEUE["MAX_REQUEST_BYTES"]

# --- Auth, i18n, static ---------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "/admin/login/"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
# STATIC_URL, STATIC_ROOT and the static storage: see "Static files" above.

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="WARNING")},
    "loggers": {"fairqueue": {"level": env.str("FAIRQUEUE_LOG_LEVEL", default="INFO")}},
}
if RUNNING_TESTS:
    # Tests provoke 4xx responses and Redis data loss on purpose; keep their output readable.
    LOGGING["loggers"] = {"fairqueue": {"level": "ERROR"}, "django.request": {"level": "ERROR"}}

if not DEBUG and not DEMO_MODE:
    SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# The project's Celery app, made the current one in every process that loads these
# settings (web, worker, commands): FairQueue publishes through it. A host does this in its
# package's __init__.py (`from .celery import app as celery_app`); this project's package is
# also the library, whose import must stay free of Celery, so it is done here.
from fairqueue.celery import app as celery_app  # noqa: E402, F401
