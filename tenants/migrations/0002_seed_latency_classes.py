"""Seed the four standard latency classes, a default shard and the pool settings row."""

from django.db import migrations

CLASSES = [("critical", 60, 40), ("high", 300, 30), ("default", 3600, 20), ("low", 86400, 10)]


def seed(apps, schema_editor):  # type: ignore[no-untyped-def]
    LatencyClass = apps.get_model("tenants", "LatencyClass")
    for name, objective, rank in CLASSES:
        LatencyClass.objects.get_or_create(name=name, defaults={"objective_seconds": objective, "rank": rank})
    apps.get_model("tenants", "Shard").objects.get_or_create(name="default", defaults={"capacity": 100})
    apps.get_model("tenants", "PoolSettings").objects.get_or_create(pk=1)


def unseed(apps, schema_editor):  # type: ignore[no-untyped-def]
    apps.get_model("tenants", "LatencyClass").objects.filter(name__in=[c[0] for c in CLASSES]).delete()


class Migration(migrations.Migration):
    dependencies = [("tenants", "0001_initial")]
    operations = [migrations.RunPython(seed, unseed)]
