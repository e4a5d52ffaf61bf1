"""Large arguments and results live in a payload store and travel through Redis as a reference.

The store is a Django storage (`STORAGES["payloads"]`, fairqueue/conf.py): a folder by default,
any django-storages backend (S3, GCS, Azure) by configuration alone.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.core.files.base import ContentFile

from fairqueue.conf import fq_settings, payload_storage


def payload_threshold() -> int:
    return int(fq_settings().PAYLOAD_THRESHOLD_BYTES)


def payload_encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def payload_put(*, data: bytes, kind: str) -> str:
    """Store `data` and return its reference."""
    name = f"{kind}/{uuid.uuid4().hex}.json"
    return payload_storage().save(name, ContentFile(data))


def payload_get(ref: str) -> Any:
    with payload_storage().open(ref, "rb") as fh:
        return json.loads(fh.read())


def payload_delete(ref: str) -> None:
    payload_storage().delete(ref)
