"""The rows a worker's deliveries read (fairqueue.jobs.jobrows): the hand-built SELECT
gives what `Job.objects.select_related("tenant__shard")` gives, field for field, on the
suite's database (SQLite or PostgreSQL)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from django.db import models
from django.utils import timezone

from fairqueue.jobs import groupcommit, jobrows
from fairqueue.jobs.models import Job, JobStatus
from tests.base import RedisTestCase
from tests.factories import make_tenant


def values(instance: models.Model) -> dict[str, Any]:
    return {f.attname: getattr(instance, f.attname) for f in instance._meta.concrete_fields}


class JobRowsTests(RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.tenant, _ = make_tenant("rows")

    def test_a_waiting_row_is_read_as_the_queryset_reads_it(self) -> None:
        now = timezone.now()
        # Every kind of column the row has, none left at an empty default.
        job = Job.objects.create(
            tenant=self.tenant,
            sub_tenant="s1",
            task="demo.noop",
            args={"n": 1, "nested": [1, "two", None]},
            latency_class="standard",
            priority=3,
            batch=True,
            promoted_at=now,
            timeout_seconds=2.5,
            status=JobStatus.PARKED,
            generation=2,
            admitted_at=now - timedelta(seconds=1),
            due_at=now,
            result={"kept": True},
            engine_tag="{t}",
            engine_keys="a b",
            attempt_history=[{"attempt": 1}],
            timeline="line\n",
        )
        read = jobrows.jobs_waiting([str(job.id)])
        self.assertEqual(list(read), [job.id])
        expected = Job.objects.select_related("tenant__shard").get(id=job.id)
        got = read[job.id]
        self.assertEqual(values(got), values(expected))
        self.assertEqual(values(got.tenant), values(expected.tenant))
        self.assertEqual(values(got.tenant.shard), values(expected.tenant.shard))
        self.assertIsInstance(got.id, uuid.UUID)
        with self.assertNumQueries(0):  # the relations are cached, as select_related leaves them
            self.assertEqual(got.tenant.shard.name, expected.tenant.shard.name)
        self.assertFalse(got._state.adding)
        got.save(update_fields=["priority"])  # an instance the ORM can save, as one it read

    def test_only_waiting_rows_of_the_asked_ids_are_read(self) -> None:
        queued, parked, running, finished, other = (
            Job.objects.create(tenant=self.tenant, task="demo.noop", latency_class="standard", status=status)
            for status in (JobStatus.QUEUED, JobStatus.PARKED, JobStatus.RUNNING, JobStatus.SUCCEEDED, JobStatus.QUEUED)
        )
        asked = [queued.id, str(parked.id), running.id, finished.id, uuid.uuid4()]
        self.assertEqual(set(jobrows.jobs_waiting(asked)), {queued.id, parked.id})
        self.assertEqual(jobrows.jobs_waiting([]), {})
        self.assertIsNotNone(other)

    def test_a_delivery_reads_only_its_generation(self) -> None:
        job = Job.objects.create(tenant=self.tenant, task="demo.noop", latency_class="standard", generation=1)
        self.assertIsNone(groupcommit.job_waiting(job_id=str(job.id), generation=0))
        read = groupcommit.job_waiting(job_id=str(job.id), generation=1)
        self.assertIsNotNone(read)
        self.assertEqual(read.tenant.slug, "rows")
