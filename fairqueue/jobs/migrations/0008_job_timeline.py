from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0007_job_timeout"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="traceparent",
            field=models.CharField(blank=True, default="", max_length=55),
        ),
        migrations.AddField(
            model_name="job",
            name="timeline",
            field=models.TextField(blank=True, default=""),
        ),
    ]
