"""Two indexes for the API's job list filters (issue 43): a tenant's jobs by task, and by
sub-tenant (only the rows that name one), each newest first on (submitted_at, id) as the
list's cursor walks them. The status filter and the time range use indexes already there.

On PostgreSQL they are built CONCURRENTLY (the migration is not atomic): a plain CREATE
INDEX on a job table of millions of rows would hold up every submit and every claim until
it is done. If the build fails there, PostgreSQL leaves an INVALID index behind: drop it
(`DROP INDEX CONCURRENTLY job_tenant_task`) and migrate again.
"""

from typing import Any

from django.db import migrations, models


class AddIndexConcurrentlyOnPostgres(migrations.AddIndex):
    """AddIndex, built without locking writes on PostgreSQL; a plain CREATE INDEX elsewhere."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor != "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)
            return
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.add_index(model, self.index, concurrently=True)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor != "postgresql":
            super().database_backwards(app_label, schema_editor, from_state, to_state)
            return
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.remove_index(model, self.index, concurrently=True)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("jobs", "0012_fewer_job_indexes"),
        ("tenants", "0004_resources"),
    ]

    operations = [
        AddIndexConcurrentlyOnPostgres(
            model_name="job",
            index=models.Index(fields=["tenant", "task", "submitted_at", "id"], name="job_tenant_task"),
        ),
        AddIndexConcurrentlyOnPostgres(
            model_name="job",
            index=models.Index(
                condition=models.Q(("sub_tenant", ""), _negated=True),
                fields=["tenant", "sub_tenant", "submitted_at", "id"],
                name="job_tenant_sub_tenant",
            ),
        ),
    ]
