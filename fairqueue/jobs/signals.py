"""What the jobs side does when the admin renames or moves things jobs depend on.

The receivers run before the tenants app's own policy sync (their commit callbacks are
registered in pre_save), so slots still held at the old place are published before any
process sees the new one (fairqueue.jobs.moves).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.db.models.signals import post_save, pre_save
from django.dispatch import receiver

from fairqueue.jobs.models import DEFERRED_STATUSES, UNFINISHED_STATUSES, Job
from fairqueue.jobs.moves import shard_renamed, tenant_moved
from tenants.models import LatencyClass, Shard, Tenant


def _after_commit(instance: Any, callback: Callable[[], object]) -> None:
    """Run `callback` once the save commits: registered now inside a transaction (so it
    runs before callbacks registered later), else right after the save (post_save)."""
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(callback, robust=True)
    else:
        instance._fq_jobs_after_save = callback


@receiver(pre_save, sender=Tenant, dispatch_uid="fq_jobs_tenant_pre_save")
def _tenant_pre_save(sender: type[Tenant], instance: Tenant, **kwargs: Any) -> None:
    if instance.pk is None:
        return
    old = Tenant.objects.filter(pk=instance.pk).values_list("slug", "shard_id", "shard__name").first()
    if old is None or (old[0], old[1]) == (instance.slug, instance.shard_id):
        return
    _after_commit(instance, functools.partial(tenant_moved, tenant_id=instance.pk, old_slug=old[0], old_shard=old[2]))


def _old_name(sender: Any, instance: Any) -> str | None:
    """The stored name of a saved row about to be renamed, else None."""
    if instance.pk is None:
        return None
    old: str | None = sender.objects.filter(pk=instance.pk).values_list("name", flat=True).first()
    return old if old is not None and old != instance.name else None


@receiver(pre_save, sender=Shard, dispatch_uid="fq_jobs_shard_pre_save")
def _shard_pre_save(sender: type[Shard], instance: Shard, **kwargs: Any) -> None:
    if (old_name := _old_name(sender, instance)) is not None:
        _after_commit(instance, functools.partial(shard_renamed, shard_id=instance.pk, old_name=old_name))


@receiver(pre_save, sender=LatencyClass, dispatch_uid="fq_jobs_class_pre_save")
def _class_pre_save(sender: type[LatencyClass], instance: LatencyClass, **kwargs: Any) -> None:
    if (old_name := _old_name(sender, instance)) is None:
        return
    # Unfinished jobs follow their class's new name (their deliveries' priority is unchanged).
    rename = functools.partial(
        Job.objects.filter(latency_class=old_name, status__in=sorted(UNFINISHED_STATUSES | DEFERRED_STATUSES)).update,
        latency_class=instance.name,
    )
    _after_commit(instance, rename)


@receiver(post_save, sender=Tenant, dispatch_uid="fq_jobs_tenant_post_save")
@receiver(post_save, sender=Shard, dispatch_uid="fq_jobs_shard_post_save")
@receiver(post_save, sender=LatencyClass, dispatch_uid="fq_jobs_class_post_save")
def _after_autocommit_save(sender: Any, instance: Any, **kwargs: Any) -> None:
    callback = instance.__dict__.pop("_fq_jobs_after_save", None)
    if callback is not None:
        callback()
