"""Four indexes of jobs_job fewer: every UPDATE of a job row (a claim, an outcome) writes an
entry into each of the table's indexes, and these served nothing the others do not.

- status: its own index and, on PostgreSQL, its LIKE twin (varchar_pattern_ops); lookups
  by status use job_status_finished (status, finished_at), whose first column it is.
- tenant_id: the composite indexes that start with it serve its lookups.
- error_reason: the LIKE twin only (nothing searches it by pattern). Its own index stays,
  now declared in Job.Meta under the name it has, so nothing is rebuilt.
"""

import django.db.models.deletion
from django.db import migrations, models

ERROR_REASON_INDEX = "jobs_job_error_reason_d4639c6c"  # the name Django gave the field's index


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0011_due_promotion_index"),
        ("tenants", "0004_resources"),
    ]

    operations = [
        migrations.AlterField(
            model_name="job",
            name="status",
            field=models.CharField(
                choices=[
                    ("scheduled", "Scheduled"),
                    ("retrying", "Retrying"),
                    ("queued", "Queued"),
                    ("parked", "Parked"),
                    ("running", "Running"),
                    ("succeeded", "Succeeded"),
                    ("failed", "Failed"),
                    ("cancelled", "Cancelled"),
                ],
                default="queued",
                max_length=16,
            ),
        ),
        migrations.AlterField(
            model_name="job",
            name="tenant",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="jobs",
                to="tenants.tenant",
            ),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="job",
                    name="error_reason",
                    field=models.CharField(blank=True, default="", max_length=32),
                ),
                migrations.AddIndex(
                    model_name="job",
                    index=models.Index(fields=["error_reason"], name=ERROR_REASON_INDEX),
                ),
            ],
            # The index itself stays; only PostgreSQL made the LIKE twin (IF EXISTS: a no-op elsewhere).
            database_operations=[
                migrations.RunSQL(
                    sql=f"DROP INDEX IF EXISTS {ERROR_REASON_INDEX}_like",
                    reverse_sql=migrations.RunSQL.noop,
                ),
            ],
        ),
    ]
