"""FairQueue's settings: a host's partial ``settings.FAIRQUEUE = {...}`` merged over defaults.

This module is the only place FairQueue's code reads its settings. Every key has a default
here (docs/settings.md is the table, tested against ``DEFAULTS``); a host sets only what it
changes. A wrong key, type or value is reported by ``manage.py check`` (fairqueue/checks.py)
naming the setting, and by an ImproperlyConfigured naming it when a process reads it anyway.
The merged settings are cached and rebuilt when a test changes a setting.

Besides the ``FAIRQUEUE`` dict, FairQueue reads two of Django's own settings when present:
``REDIS_URL`` (where the engine's state lives when ``ENGINE_URL`` is empty) and
``STORAGES["payloads"]`` (the payload store; a folder at ``PAYLOAD_DIR`` without it).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.files.storage import FileSystemStorage, Storage, storages
from django.core.signals import setting_changed

#: The engine's Redis when neither ENGINE_URL nor Django's REDIS_URL says otherwise.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: The payload store's storage alias in STORAGES, when a host configures one.
PAYLOAD_STORAGE = "payloads"


@dataclass(frozen=True)
class WebhookSettings:
    """Completion webhooks (webhooks/)."""

    ALLOWED_NETWORKS: tuple[str, ...] = ()
    TIMEOUT_SECONDS: float = 5.0
    BACKOFF_FIRST_SECONDS: float = 10.0
    BACKOFF_MAX_SECONDS: float = 3600.0
    MAX_AGE_SECONDS: float = 24 * 3600.0
    SENDERS: int = 8


@dataclass(frozen=True)
class BackpressureSettings:
    """Resource backpressure per worker (fairqueue/jobs/backpressure.py); marks are shares."""

    ENABLED: bool = True
    SAMPLE_SECONDS: float = 0.25
    MEMORY_LIMIT_BYTES: int = 0
    MEMORY_HIGH: float = 0.90
    MEMORY_LOW: float = 0.80
    CPU_HIGH: float = 0.0
    CPU_LOW: float = 0.0
    PSI_CPU_HIGH: float = 0.0
    PSI_CPU_LOW: float = 0.0
    PSI_MEMORY_HIGH: float = 0.25
    PSI_MEMORY_LOW: float = 0.10
    PSI_IO_HIGH: float = 0.0
    PSI_IO_LOW: float = 0.0
    MIN_SLOTS: int = 1
    STEP_SECONDS: float = 1.0
    RECOVER_SECONDS: float = 10.0


@dataclass(frozen=True)
class ForecastSettings:
    """Slots desired (fairqueue/jobs/capacity.py)."""

    WARMUP_SECONDS: float = 600.0
    WEEKS: int = 4
    DECAY: float = 0.5
    SPREAD_SIGMAS: float = 1.0
    REFRESH_SECONDS: float = 900.0
    RECORD_SECONDS: float = 60.0
    HISTORY_POINTS: int = 180


@dataclass(frozen=True)
class FairQueueSettings:
    """Every FairQueue setting with its default (docs/settings.md says what each does)."""

    ENGINE_URL: str = ""
    LEASE_SECONDS: float = 30.0
    DISPATCH_LEASE_SECONDS: float = 600.0
    PAYLOAD_THRESHOLD_BYTES: int = 256 * 1024
    PAYLOAD_DIR: str = ""
    MAX_REQUEST_BYTES: int = 16 * 1024 * 1024
    API_THREADS: int = 8
    POISON_PILL_LIMIT: int = 3
    GROUP_COMMIT_MS: float = 6.0
    PULL_DELIVERIES: bool = True
    DB_PREPARED: bool = True
    SHUTDOWN_GRACE_SECONDS: float = 30.0
    METRICS_TOKEN: str = ""
    PROMETHEUS_MULTIPROC_DIR: str = ""
    DASHBOARD_TOP_TENANTS: int = 50
    HANDBACK_SECONDS: float = 300.0
    TASK_MODULES: tuple[str, ...] = ()
    DEMO_TASKS: bool = False
    ISOLATED_POOL_SIZE: int = 2
    VISIBILITY_TIMEOUT_SECONDS: int = 6 * 3600
    PREFETCH_MULTIPLIER: int = 1
    RETENTION_DAYS: float = 30.0
    WEBHOOKS: WebhookSettings = field(default_factory=WebhookSettings)
    BACKPRESSURE: BackpressureSettings = field(default_factory=BackpressureSettings)
    FORECAST: ForecastSettings = field(default_factory=ForecastSettings)


_SECTIONS: dict[str, type[Any]] = {
    "WEBHOOKS": WebhookSettings,
    "BACKPRESSURE": BackpressureSettings,
    "FORECAST": ForecastSettings,
}


def _defaults_of(cls: type[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        out[f.name] = _defaults_of(_SECTIONS[f.name]) if f.name in _SECTIONS else f.default
    return out


#: Every key and its default, sections as nested dicts (the table in docs/settings.md).
DEFAULTS: dict[str, Any] = _defaults_of(FairQueueSettings)


def _type_problem(value: Any, kind: Any) -> str | None:
    """Why `value` is not of the declared `kind`, or None."""
    if kind is bool:
        return None if isinstance(value, bool) else "must be True or False"
    if kind is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be a whole number"
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return None if ok else "must be a number"
    if kind is str:
        return None if isinstance(value, str) else "must be a string"
    # tuple[str, ...]: a list or tuple of strings
    ok = isinstance(value, list | tuple) and all(isinstance(item, str) for item in value)
    return None if ok else "must be a list of strings"


#: Values beyond their type: (section or "", key, test, what it must be).
_RANGES: tuple[tuple[str, str, typing.Callable[[Any], bool], str], ...] = (
    ("", "LEASE_SECONDS", lambda v: v > 0, "must be more than 0"),
    ("", "DISPATCH_LEASE_SECONDS", lambda v: v > 0, "must be more than 0"),
    ("", "PAYLOAD_THRESHOLD_BYTES", lambda v: v > 0, "must be more than 0"),
    ("", "API_THREADS", lambda v: v >= 1, "must be at least 1"),
    ("", "POISON_PILL_LIMIT", lambda v: v >= 1, "must be at least 1"),
    ("", "GROUP_COMMIT_MS", lambda v: v >= 0, "must be 0 (off) or more"),
    ("", "SHUTDOWN_GRACE_SECONDS", lambda v: v >= 0, "must be 0 or more"),
    ("", "DASHBOARD_TOP_TENANTS", lambda v: v >= 1, "must be at least 1"),
    ("", "HANDBACK_SECONDS", lambda v: v > 0, "must be more than 0"),
    ("", "ISOLATED_POOL_SIZE", lambda v: v >= 1, "must be at least 1"),
    ("", "VISIBILITY_TIMEOUT_SECONDS", lambda v: v >= 1, "must be at least 1"),
    ("", "PREFETCH_MULTIPLIER", lambda v: v >= 1, "must be at least 1"),
    ("", "RETENTION_DAYS", lambda v: v >= 0, "must be 0 (keep finished jobs) or a number of days"),
    ("WEBHOOKS", "SENDERS", lambda v: v >= 1, "must be at least 1"),
    ("WEBHOOKS", "TIMEOUT_SECONDS", lambda v: v > 0, "must be more than 0"),
    ("BACKPRESSURE", "SAMPLE_SECONDS", lambda v: v > 0, "must be more than 0"),
    ("BACKPRESSURE", "MIN_SLOTS", lambda v: v >= 0, "must be 0 or more"),
    ("FORECAST", "WEEKS", lambda v: v >= 1, "must be at least 1"),
    ("FORECAST", "HISTORY_POINTS", lambda v: v >= 1, "must be at least 1"),
)
#: Backpressure's signals, each a high and a low mark (a high mark of 0 turns it off).
BACKPRESSURE_SIGNALS = ("MEMORY", "CPU", "PSI_CPU", "PSI_MEMORY", "PSI_IO")


def _name(section: str, key: str) -> str:
    return f'FAIRQUEUE["{section}"]["{key}"]' if section else f'FAIRQUEUE["{key}"]'


def _check_section(raw: Any, cls: type[Any], section: str, problems: list[str]) -> dict[str, Any]:
    """The valid keys of `raw` (a dict over `cls`'s fields); what is wrong goes to `problems`."""
    where = f'FAIRQUEUE["{section}"]' if section else "FAIRQUEUE"
    if not isinstance(raw, dict):
        problems.append(f"{where} must be a dict, not {type(raw).__name__}.")
        return {}
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    valid: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            problems.append(f"{_name(section, key)} is not a FairQueue setting (docs/settings.md lists them).")
        elif not section and key in _SECTIONS:
            valid[key] = _check_section(value, _SECTIONS[key], key, problems)
        elif (problem := _type_problem(value, hints[key])) is not None:
            problems.append(f"{_name(section, key)} {problem}, not {value!r}.")
        else:
            valid[key] = tuple(value) if isinstance(value, list) else value
    return valid


def settings_problems(raw: Any) -> tuple[list[str], FairQueueSettings]:
    """What is wrong with a FAIRQUEUE dict (one sentence each, naming the setting), and the
    settings it gives with every wrong value left at its default."""
    problems: list[str] = []
    valid = _check_section(raw, FairQueueSettings, "", problems)
    sections = {key: _SECTIONS[key](**valid.pop(key, {})) for key in _SECTIONS}
    merged = FairQueueSettings(**valid, **sections)
    for section, key, test, must in _RANGES:
        value = getattr(getattr(merged, section) if section else merged, key)
        if not test(value):
            problems.append(f"{_name(section, key)} {must}, not {value!r}.")
    for signal in BACKPRESSURE_SIGNALS:
        high = getattr(merged.BACKPRESSURE, f"{signal}_HIGH")
        low = getattr(merged.BACKPRESSURE, f"{signal}_LOW")
        if high and not 0 <= low <= high:
            problems.append(
                f'FAIRQUEUE["BACKPRESSURE"]["{signal}_LOW"] ({low}) must be between 0 and the high mark ({high}).'
            )
    return problems, merged


def _raw() -> Any:
    return getattr(settings, "FAIRQUEUE", {})


def configured_problems() -> list[str]:
    """What is wrong with this process's FAIRQUEUE setting (the system check's errors)."""
    return settings_problems(_raw())[0]


@functools.cache
def fq_settings() -> FairQueueSettings:
    """FairQueue's settings: the host's FAIRQUEUE over the defaults (cached per process)."""
    problems, merged = settings_problems(_raw())
    if problems:
        raise ImproperlyConfigured(" ".join(problems))
    return merged


def engine_url() -> str:
    """Where the engine's state lives: ENGINE_URL, else Django's REDIS_URL, else the local Redis."""
    return fq_settings().ENGINE_URL or getattr(settings, "REDIS_URL", "") or DEFAULT_REDIS_URL


def payload_dir() -> Path:
    """The payload folder: PAYLOAD_DIR, else var/payloads under the project's BASE_DIR."""
    if fq_settings().PAYLOAD_DIR:
        return Path(fq_settings().PAYLOAD_DIR)
    return Path(getattr(settings, "BASE_DIR", Path.cwd())) / "var" / "payloads"


@functools.cache
def _folder_storage(location: str) -> FileSystemStorage:
    return FileSystemStorage(location=location)


def payload_storage() -> Storage:
    """The payload store: STORAGES["payloads"] when the host configures one, else a folder."""
    if PAYLOAD_STORAGE in settings.STORAGES:
        return storages[PAYLOAD_STORAGE]
    return _folder_storage(str(payload_dir()))


def metrics_multiproc_dir() -> str:
    """Where a multi-process web server's workers keep request metrics: PROMETHEUS_MULTIPROC_DIR
    in FAIRQUEUE, else the environment variable prometheus_client itself writes by."""
    return fq_settings().PROMETHEUS_MULTIPROC_DIR or os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")


def _settings_changed(*, setting: str, **_: Any) -> None:
    if setting in ("FAIRQUEUE", "REDIS_URL", "STORAGES", "BASE_DIR"):
        fq_settings.cache_clear()


setting_changed.connect(_settings_changed, dispatch_uid="fairqueue.conf")
