"""Save/delete signals that mirror policy into Redis after the transaction commits, and
stamp each policy change's history row with its source (and mark it on the dashboard)."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete, post_save, pre_save
from django.dispatch import receiver
from simple_history.signals import post_create_historical_record, pre_create_historical_record

from tenants import sync
from tenants.change_markers import markers_push_on_commit
from tenants.changes import POLICY_MODELS, entries_build
from tenants.history import source_current
from tenants.models import LatencyClass, PoolSettings, Resource, Shard, SubTenant, Tenant

# Saving only these (API key rotation) changes no policy Redis holds, only the key version.
# Credentials: changing them changes no policy, but processes must drop their cached tenant
# rows (the webhook secret is checked from that row when a job names a callback URL).
_API_KEY_FIELDS = frozenset(
    {
        "api_key_prefix",
        "api_key_hash",
        "api_key_rotated_at",
        "webhook_secret",
        "webhook_secret_rotated_at",
        "updated_at",
    }
)


def _previous_value(sender: Any, instance: Any, field: str, update_fields: Any) -> str | None:
    """The stored value of `field` before this save (to drop keys named after an old name)."""
    if instance.pk is None or (update_fields is not None and field not in update_fields):
        return None
    value: str | None = sender.objects.filter(pk=instance.pk).values_list(field, flat=True).first()
    return value


@receiver(pre_save, sender=Tenant, dispatch_uid="fq_tenant_pre_save")
def _tenant_pre_save(sender: type[Tenant], instance: Tenant, update_fields: Any = None, **kwargs: Any) -> None:
    instance._fq_old_slug = _previous_value(sender, instance, "slug", update_fields)  # type: ignore[attr-defined]


@receiver(post_save, sender=Tenant, dispatch_uid="fq_tenant_post_save")
def _tenant_post_save(sender: type[Tenant], instance: Tenant, update_fields: Any = None, **kwargs: Any) -> None:
    if update_fields is not None and set(update_fields) <= _API_KEY_FIELDS:
        sync.api_keys_changed_on_commit()  # no policy changed, but cached keys must go
        return
    old_slug = getattr(instance, "_fq_old_slug", None)
    if old_slug and old_slug != instance.slug:
        sync.tenant_policy_delete_on_commit(slug=old_slug)
    sync.tenant_policy_sync_on_commit(tenant_ids=[instance.pk])


@receiver(post_delete, sender=Tenant, dispatch_uid="fq_tenant_post_delete")
def _tenant_post_delete(sender: type[Tenant], instance: Tenant, **kwargs: Any) -> None:
    sync.tenant_policy_delete_on_commit(slug=instance.slug)


@receiver(post_save, sender=SubTenant, dispatch_uid="fq_subtenant_post_save")
@receiver(post_delete, sender=SubTenant, dispatch_uid="fq_subtenant_post_delete")
def _subtenant_changed(sender: type[SubTenant], instance: SubTenant, **kwargs: Any) -> None:
    # The whole subtenants hash is rewritten from the database, which also covers a
    # sub-tenant moved from one tenant to another (both tenants are re-read).
    tenant_ids = {instance.tenant_id}
    old_tenant_id = getattr(instance, "_fq_old_tenant_id", None)
    if old_tenant_id:
        tenant_ids.add(old_tenant_id)
    for tenant_id in tenant_ids:
        sync.tenant_policy_sync_on_commit(tenant_ids=[tenant_id])


@receiver(pre_save, sender=SubTenant, dispatch_uid="fq_subtenant_pre_save")
def _subtenant_pre_save(sender: type[SubTenant], instance: SubTenant, **kwargs: Any) -> None:
    old = _previous_value(sender, instance, "tenant_id", kwargs.get("update_fields"))
    instance._fq_old_tenant_id = old  # type: ignore[attr-defined]


@receiver(pre_save, sender=Shard, dispatch_uid="fq_shard_pre_save")
def _shard_pre_save(sender: type[Shard], instance: Shard, update_fields: Any = None, **kwargs: Any) -> None:
    instance._fq_old_name = _previous_value(sender, instance, "name", update_fields)  # type: ignore[attr-defined]


@receiver(post_save, sender=Shard, dispatch_uid="fq_shard_post_save")
def _shard_post_save(sender: type[Shard], instance: Shard, **kwargs: Any) -> None:
    old_name = getattr(instance, "_fq_old_name", None)
    if old_name and old_name != instance.name:
        sync.shard_policy_delete_on_commit(name=old_name)
        # Tenant hashes carry the shard's name.
        sync.tenant_policy_sync_on_commit(tenant_ids=instance.tenants.values_list("pk", flat=True))
    sync.shard_policy_sync_on_commit(shard_id=instance.pk)


@receiver(post_delete, sender=Shard, dispatch_uid="fq_shard_post_delete")
def _shard_post_delete(sender: type[Shard], instance: Shard, **kwargs: Any) -> None:
    sync.shard_policy_delete_on_commit(name=instance.name)


@receiver(pre_save, sender=LatencyClass, dispatch_uid="fq_class_pre_save")
def _class_pre_save(sender: Any, instance: LatencyClass, update_fields: Any = None, **kwargs: Any) -> None:
    instance._fq_old_name = _previous_value(sender, instance, "name", update_fields)  # type: ignore[attr-defined]


@receiver(post_save, sender=LatencyClass, dispatch_uid="fq_class_post_save")
def _class_post_save(sender: type[LatencyClass], instance: LatencyClass, **kwargs: Any) -> None:
    old_name = getattr(instance, "_fq_old_name", None)
    if old_name and old_name != instance.name:
        sync.latency_class_policy_delete_on_commit(name=old_name)
        tenant_ids = Tenant.objects.filter(default_latency_class=instance).values_list("pk", flat=True)
        sync.tenant_policy_sync_on_commit(tenant_ids=tenant_ids)
    sync.latency_class_policy_sync_on_commit(latency_class_id=instance.pk)


@receiver(post_delete, sender=LatencyClass, dispatch_uid="fq_class_post_delete")
def _class_post_delete(sender: type[LatencyClass], instance: LatencyClass, **kwargs: Any) -> None:
    sync.latency_class_policy_delete_on_commit(name=instance.name)


@receiver(post_save, sender=PoolSettings, dispatch_uid="fq_pool_post_save")
def _pool_post_save(sender: type[PoolSettings], instance: PoolSettings, **kwargs: Any) -> None:
    sync.pool_policy_sync_on_commit()


@receiver(post_delete, sender=PoolSettings, dispatch_uid="fq_pool_post_delete")
def _pool_post_delete(sender: type[PoolSettings], instance: PoolSettings, **kwargs: Any) -> None:
    sync.pool_policy_delete_on_commit()


@receiver(pre_save, sender=Resource, dispatch_uid="fq_resource_pre_save")
def _resource_pre_save(sender: Any, instance: Resource, update_fields: Any = None, **kwargs: Any) -> None:
    instance._fq_old_name = _previous_value(sender, instance, "name", update_fields)  # type: ignore[attr-defined]


@receiver(post_save, sender=Resource, dispatch_uid="fq_resource_post_save")
def _resource_post_save(sender: type[Resource], instance: Resource, **kwargs: Any) -> None:
    old_name = getattr(instance, "_fq_old_name", None)
    if old_name and old_name != instance.name:
        sync.resource_policy_delete_on_commit(name=old_name)
    sync.resource_policy_sync_on_commit(resource_id=instance.pk)


@receiver(post_delete, sender=Resource, dispatch_uid="fq_resource_post_delete")
def _resource_post_delete(sender: type[Resource], instance: Resource, **kwargs: Any) -> None:
    sync.resource_policy_delete_on_commit(name=instance.name)


# --- History: where each change came from, and a marker for the dashboard's charts --------

_HISTORY_MODELS = {model.history.model: name for name, model in POLICY_MODELS.items()}  # type: ignore[attr-defined]


def _history_pre_create(sender: Any, history_instance: Any, **kwargs: Any) -> None:
    if sender in _HISTORY_MODELS:
        history_instance.history_source = source_current()


def _history_post_create(sender: Any, history_instance: Any, instance: Any = None, **kwargs: Any) -> None:
    name = _HISTORY_MODELS.get(sender)
    if name is None:
        return
    # The reason was for this change: a later save of the same instance gives its own.
    if instance is not None and hasattr(instance, "_change_reason"):
        del instance._change_reason
    markers_push_on_commit(entries_build([(name, history_instance)]))


pre_create_historical_record.connect(_history_pre_create, dispatch_uid="fq_history_source")
post_create_historical_record.connect(_history_post_create, dispatch_uid="fq_history_marker")
