"""History starts with the policy as it is: one "created" row per existing policy row,
from source "migration", so the first change made afterwards shows its old value and can
be reverted."""

from django.db import migrations
from django.utils import timezone

MODELS = ["Tenant", "SubTenant", "Shard", "LatencyClass", "Resource", "PoolSettings"]
REASON = "History starts: the policy as it was when history was turned on."


def baseline(apps, schema_editor):  # type: ignore[no-untyped-def]
    now = timezone.now()
    for name in MODELS:
        model = apps.get_model("tenants", name)
        historical = apps.get_model("tenants", f"Historical{name}")
        tracked = [f.attname for f in historical._meta.fields if not f.name.startswith("history_")]
        rows = [
            historical(
                history_date=now,
                history_type="+",
                history_source="migration",
                history_change_reason=REASON,
                **{attname: getattr(row, attname) for attname in tracked},
            )
            for row in model.objects.all()
        ]
        historical.objects.bulk_create(rows, batch_size=500)


def unbaseline(apps, schema_editor):  # type: ignore[no-untyped-def]
    for name in MODELS:
        apps.get_model("tenants", f"Historical{name}").objects.filter(history_change_reason=REASON).delete()


class Migration(migrations.Migration):
    dependencies = [("tenants", "0006_policy_history")]
    operations = [migrations.RunPython(baseline, unbaseline)]
