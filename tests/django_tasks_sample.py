"""Django Tasks `@task` functions run through FairQueue's backend (tests/test_django_tasks.py)."""

from __future__ import annotations

from django_tasks import task


@task()
def add(a: int, b: int) -> int:
    return a + b


@task()
async def shout(word: str) -> str:
    return word.upper()


@task()
def explode() -> None:
    raise RuntimeError("boom")
