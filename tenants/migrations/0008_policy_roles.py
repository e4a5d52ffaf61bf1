"""The operator roles, as Django groups (README, "Governed policy changes"). A user gets a
role by being made staff and joining its group; superusers keep every permission.

- policy viewer: sees every policy page and the history, and previews a change (the
  what-if), but changes nothing (the dashboard is open to every staff user);
- policy editor: adds, changes, deletes and reverts policy (tenants, sub-tenants, shards,
  latency classes, resources, pool settings);
- key manager: rotates tenants' API keys and webhook secrets, and sees tenants.

The table is frozen here, as migrations are: a later change of a role is a new migration.
"""

from django.contrib.auth.management import create_permissions
from django.db import migrations

POLICY_MODELS = ["tenant", "subtenant", "shard", "latencyclass", "resource", "poolsettings"]
VIEW = [f"view_{m}" for m in POLICY_MODELS] + ["view_policychange"]
ROLES = {
    "policy viewer": [("tenants", c) for c in VIEW],
    "policy editor": [("tenants", c) for c in VIEW]
    + [("tenants", f"{verb}_{m}") for m in POLICY_MODELS for verb in ("add", "change", "delete")],
    "key manager": [("tenants", "view_tenant"), ("tenants", "rotate_keys"), ("tenants", "view_policychange")],
}


def roles_create(apps, schema_editor):  # type: ignore[no-untyped-def]
    # Permissions are made after all migrations ran (post_migrate); on a fresh database
    # they do not exist yet, so make this app's now.
    app_config = apps.get_app_config("tenants")
    app_config.models_module = True
    create_permissions(app_config, apps=apps, verbosity=0)
    app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for name, wanted in ROLES.items():
        group, _ = Group.objects.get_or_create(name=name)
        perms = [Permission.objects.get(content_type__app_label=app, codename=code) for app, code in wanted]
        group.permissions.set(perms)


def roles_delete(apps, schema_editor):  # type: ignore[no-untyped-def]
    apps.get_model("auth", "Group").objects.filter(name__in=list(ROLES)).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("tenants", "0007_policy_history_baseline"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]
    operations = [migrations.RunPython(roles_create, roles_delete)]
