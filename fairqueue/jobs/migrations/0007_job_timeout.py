from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0006_webhook_deliveries"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="timeout_seconds",
            field=models.FloatField(
                blank=True,
                help_text="Wall-clock limit asked at submit; the task's own limit applies if lower.",
                null=True,
            ),
        ),
    ]
