"""What the due promotion costs per tick with 100,000 delayed jobs waiting (docs/tasks.md).

Run against a scratch database and Redis (it writes and deletes its own tenant's jobs):

    DATABASE_URL=postgres://.../scratch REDIS_URL=redis://127.0.0.1:6379/9 \\
        python manage.py shell -c "exec(open('scripts/due_promotion_cost.py').read())"
"""

import statistics
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from django.db import connection
from django.utils import timezone

from fairqueue.jobs.due import due_rows, jobs_promote_due
from fairqueue.jobs.models import DEFERRED_STATUSES, Job, JobStatus
from tenants.models import Shard, Tenant
from tenants.policy import policy_invalidate

WAITING = 100_000
DUE = 500
SLUG = "bench-due"


def median_ms(call: Callable[[], object], n: int = 30) -> float:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


if Job.objects.filter(status__in=sorted(DEFERRED_STATUSES)).exclude(tenant__slug=SLUG).exists():
    raise SystemExit("this database has delayed jobs of its own: use a scratch database")
# Its own shard, roomy enough that the due jobs are admitted, not parked.
shard, _ = Shard.objects.get_or_create(name=SLUG, defaults={"capacity": 1000})
tenant = Tenant.objects.filter(slug=SLUG).first() or Tenant(slug=SLUG, name="Bench due")
tenant.shard, tenant.floor = shard, 1000
if not tenant.api_key_hash:
    tenant.rotate_api_key()
tenant.save()
policy_invalidate()
Job.objects.filter(tenant=tenant).delete()
print(f"no job waiting at all: jobs_promote_due() median {median_ms(jobs_promote_due):.2f} ms")
now = timezone.now()
Job.objects.bulk_create(
    [
        Job(
            id=uuid.uuid4(),
            tenant=tenant,
            task="demo.noop",
            latency_class="default",
            status=JobStatus.SCHEDULED,
            due_at=now + timedelta(days=1, seconds=i),  # none comes due while this runs
        )
        for i in range(WAITING)
    ],
    batch_size=5000,
)
if connection.vendor == "postgresql":
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")


print(f"{WAITING:,} scheduled, none due: jobs_promote_due() median {median_ms(jobs_promote_due):.2f} ms")
print(
    f"a primary-key lookup, for scale: median {median_ms(lambda: Job.objects.filter(id=uuid.uuid4()).first()):.2f} ms"
)
sql, params = due_rows(timezone.now()).query.sql_with_params()
with connection.cursor() as cursor:
    explain = "EXPLAIN ANALYZE" if connection.vendor == "postgresql" else "EXPLAIN QUERY PLAN"
    cursor.execute(f"{explain} {sql} LIMIT {DUE}", params)
    print("\n".join(str(row[-1]) for row in cursor.fetchall()))
first = list(
    Job.objects.filter(tenant=tenant, status=JobStatus.SCHEDULED).order_by("due_at").values_list("id", flat=True)[:DUE]
)
Job.objects.filter(id__in=first).update(due_at=timezone.now() - timedelta(seconds=1))
started = time.perf_counter()
promoted = jobs_promote_due()
elapsed = (time.perf_counter() - started) * 1000
print(f"{DUE} due among {WAITING:,}: promoted and admitted {promoted} in {elapsed:.0f} ms")
Job.objects.filter(tenant=tenant).delete()
print(f"no job waiting at all: jobs_promote_due() median {median_ms(jobs_promote_due):.2f} ms")
