"""`GET /api/v1/jobs` (fairqueue.jobs.selectors.job_list, fairqueue.jobs.list_cursor): paging
by cursor neither skips nor repeats a job while jobs are submitted and change status between
pages; each filter alone and together; the bounded total; the deprecated offset; bad cursors
are a clear 400."""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime, timedelta
from datetime import timezone as fixed_offset
from typing import Any

from django.utils import timezone

from fairqueue.jobs.list_cursor import cursor_decode, cursor_encode
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.selectors import LIST_TOTAL_MAX
from tests.test_jobs_api import JOBS, ApiTestCase, sleep_job


class ListTestCase(ApiTestCase):
    def page(self, params: dict[str, Any] | None = None, *, key: str | None = None) -> dict[str, Any]:
        response = self.get(JOBS, params, key=key or self.key)
        self.assertEqual(response.status_code, 200, response.content)
        return response.json()  # type: ignore[no-any-return]

    def walk(self, params: dict[str, Any], between: Any = None) -> list[dict[str, Any]]:
        """Every page by cursor, calling `between(page_number)` after each page but the last."""
        items: list[dict[str, Any]] = []
        cursor = None
        for number in range(1, 10_000):
            page = self.page({**params, **({"cursor": cursor} if cursor else {})})
            items += page["items"]
            self.assertEqual(page["has_more"], page["next"] is not None)
            if not page["has_more"]:
                return items
            self.assertEqual(len(page["items"]), params.get("limit", 50), "a page short of its limit has no next")
            cursor = page["next"]
            if between is not None:
                between(number)
        self.fail("the walk never ended")

    def rows(self, n: int, **fields: Any) -> list[Job]:
        """`n` job rows of this tenant, written directly (the list reads rows, not Redis)."""
        fields.setdefault("task", "demo.sleep")
        return Job.objects.bulk_create([Job(tenant=self.tenant, latency_class="default", **fields) for _ in range(n)])

    def newest_first(self, qs: Any) -> list[str]:
        ordered = qs.filter(tenant=self.tenant).order_by("-submitted_at", "-id")
        return [str(i) for i in ordered.values_list("id", flat=True)]


class CursorStabilityTests(ListTestCase):
    def setUp(self) -> None:
        super().setUp()
        # A limit of 2: two jobs hold acme's slots and the rest park, as in production.
        self.tenant, self.key = self.tenant_with("paged", max_concurrency=2)
        self.initial = [self.submit(sleep_job(sub_tenant=f"c{i % 3}"))["id"] for i in range(23)]

    def churn(self, number: int) -> None:
        """Between two pages: two new jobs, and jobs listed and not yet listed change status
        (cancelled through the API; claimed and finished as a worker's conditional UPDATEs do)."""
        self.submit()
        self.submit(sleep_job(sub_tenant="c1"))
        parked = list(Job.objects.filter(tenant=self.tenant, status=JobStatus.PARKED).order_by("?")[:2])
        for job in parked[:1]:
            self.assertEqual(self.post(f"{JOBS}/{job.id}/cancel").status_code, 200)
        for job in parked[1:]:
            Job.objects.filter(id=job.id, status=JobStatus.PARKED).update(status=JobStatus.RUNNING)
        Job.objects.filter(tenant=self.tenant, status=JobStatus.RUNNING).exclude(id__in=[j.id for j in parked]).update(
            status=JobStatus.SUCCEEDED, finished_at=timezone.now()
        )

    def test_no_job_is_skipped_or_repeated_while_jobs_arrive_and_change_status(self) -> None:
        expected = list(reversed(self.initial))
        self.assertEqual(self.newest_first(Job.objects.all()), expected)
        items = self.walk({"limit": 4}, between=self.churn)
        listed = [item["id"] for item in items]
        self.assertEqual(listed, expected, "every job there at the start, once each, newest first")
        self.assertGreater(Job.objects.filter(tenant=self.tenant).count(), len(expected), "jobs arrived meanwhile")
        statuses = set(Job.objects.filter(tenant=self.tenant).values_list("status", flat=True))
        self.assertTrue({"cancelled", "succeeded", "parked"} <= statuses, statuses)

    def test_a_status_filter_repeats_none_and_skips_none_that_kept_the_status(self) -> None:
        parked_at_start = set(self.newest_first(Job.objects.filter(status=JobStatus.PARKED)))
        self.assertGreaterEqual(len(parked_at_start), 15)
        items = self.walk({"limit": 3, "status": "parked"}, between=self.churn)
        listed = [item["id"] for item in items]
        self.assertEqual(len(listed), len(set(listed)), "no job twice")
        self.assertTrue(all(item["status"] == "parked" for item in items))
        still_parked = set(self.newest_first(Job.objects.filter(status=JobStatus.PARKED)))
        self.assertLessEqual(parked_at_start & still_parked, set(listed), "a job parked throughout was skipped")
        self.assertLessEqual(set(listed), parked_at_start, "only jobs of the start (newer ones precede the cursor)")

    def test_jobs_of_one_instant_are_ordered_by_id_and_each_listed_once(self) -> None:
        instant = timezone.now() - timedelta(minutes=5)
        tied = Job.objects.filter(id__in=self.initial[5:17])
        self.assertEqual(tied.update(submitted_at=instant), 12)
        expected = self.newest_first(Job.objects.all())
        for limit in (1, 2, 5, 7):
            with self.subTest(limit=limit):
                self.assertEqual([i["id"] for i in self.walk({"limit": limit})], expected)
        ids_of_instant = sorted(self.initial[5:17], reverse=True)
        self.assertEqual([i for i in expected if i in ids_of_instant], ids_of_instant)


class FilterTests(ListTestCase):
    def setUp(self) -> None:
        super().setUp()
        now = timezone.now()
        self.times = [now - timedelta(hours=h) for h in range(48)]
        for hour, at in enumerate(self.times):
            status = [JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.PARKED][hour % 3]
            task = "demo.noop" if hour % 4 == 0 else "demo.sleep"
            sub = f"cust-{hour % 5}" if hour % 2 else ""
            (job,) = self.rows(1, status=status, task=task, sub_tenant=sub)
            Job.objects.filter(id=job.id).update(submitted_at=at)
        # Another tenant's jobs match every filter too, and are never listed.
        self.other, self.other_key = self.tenant_with("globex")
        Job.objects.bulk_create(
            [
                Job(tenant=self.other, task="demo.noop", latency_class="default", status=s, sub_tenant="cust-1")
                for s in (JobStatus.PARKED, JobStatus.FAILED)
            ]
        )

    def expected(self, **lookups: Any) -> list[str]:
        return self.newest_first(Job.objects.filter(**lookups))

    def test_each_filter_alone_and_together_by_every_page_size(self) -> None:
        since, before = self.times[30], self.times[10]  # [30 hours ago, 10 hours ago)
        cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
            ({}, {}),
            ({"status": "parked"}, {"status": "parked"}),
            ({"status": "failed"}, {"status": "failed"}),
            ({"status": "cancelled"}, {"status": "cancelled"}),
            ({"task": "demo.noop"}, {"task": "demo.noop"}),
            ({"task": "demo.unknown"}, {"task": "demo.unknown"}),
            ({"sub_tenant": "cust-1"}, {"sub_tenant": "cust-1"}),
            ({"submitted_since": since.isoformat()}, {"submitted_at__gte": since}),
            ({"submitted_before": before.isoformat()}, {"submitted_at__lt": before}),
            (
                {"submitted_since": since.isoformat(), "submitted_before": before.isoformat()},
                {"submitted_at__gte": since, "submitted_at__lt": before},
            ),
            (
                {"status": "succeeded", "task": "demo.sleep", "submitted_since": since.isoformat()},
                {"status": "succeeded", "task": "demo.sleep", "submitted_at__gte": since},
            ),
            ({"sub_tenant": "cust-3", "status": "failed"}, {"sub_tenant": "cust-3", "status": "failed"}),
            # RFC 3339 allows an offset PostgreSQL's timestamptz refuses (past 15:59): the same instant.
            (
                {"submitted_since": since.astimezone(fixed_offset(timedelta(hours=-19, minutes=-54))).isoformat()},
                {"submitted_at__gte": since},
            ),
            ({"submitted_since": before.isoformat(), "submitted_before": since.isoformat()}, {"id": None}),
        ]
        for params, lookups in cases:
            expected = self.expected(**lookups)
            for limit in (1, 4, 50):
                with self.subTest(params=params, limit=limit):
                    listed = [i["id"] for i in self.walk({**params, "limit": limit})]
                    self.assertEqual(listed, expected)
                    total = self.page({**params, "limit": limit, "total": "true"})["total"]
                    self.assertEqual(total, {"value": len(expected), "relation": "eq"})
        self.assertEqual(len(self.expected(status="parked")), 16)
        self.assertEqual(len(self.expected(sub_tenant="cust-1")), 5)

    def test_time_bounds_take_any_utc_offset(self) -> None:
        at = self.times[7]
        same_instant = at.astimezone(fixed_offset(timedelta(hours=5, minutes=30))).isoformat()
        self.assertTrue(same_instant.endswith("+05:30"), same_instant)
        listed = [i["id"] for i in self.walk({"submitted_since": same_instant, "submitted_before": same_instant})]
        self.assertEqual(listed, [])
        listed = [i["id"] for i in self.walk({"submitted_since": same_instant, "limit": 3})]
        self.assertEqual(listed, self.expected(submitted_at__gte=at))
        self.assertEqual(len(listed), 8)

    def test_a_cursor_carries_over_to_other_filters_as_a_place(self) -> None:
        first = self.page({"limit": 5})
        after = self.page({"cursor": first["next"], "status": "parked", "limit": 50})
        place = cursor_decode(first["next"])
        self.assertEqual(
            [i["id"] for i in after["items"]],
            [i for i in self.expected(status="parked") if Job.objects.get(id=i).submitted_at < place.submitted_at],
        )


class TotalAndOffsetTests(ListTestCase):
    def test_the_total_is_counted_only_when_asked_and_only_up_to_its_cap(self) -> None:
        self.rows(LIST_TOTAL_MAX + 5, status=JobStatus.SUCCEEDED)
        self.rows(3, status=JobStatus.FAILED)
        self.assertIsNone(self.page({"limit": 1})["total"])
        everything = self.page({"limit": 1, "total": "true"})["total"]
        self.assertEqual(everything, {"value": LIST_TOTAL_MAX, "relation": "gte"})
        self.assertEqual(
            self.page({"limit": 1, "total": "true", "status": "failed"})["total"], {"value": 3, "relation": "eq"}
        )
        # The total is the filter's, wherever the page is.
        first = self.page({"limit": 2, "status": "failed"})
        later = self.page({"limit": 2, "status": "failed", "cursor": first["next"], "total": "true"})
        self.assertEqual((len(later["items"]), later["total"]["value"]), (1, 3))

    def test_the_deprecated_offset_is_capped_and_skips_after_a_cursor(self) -> None:
        self.rows(12, status=JobStatus.SUCCEEDED)
        expected = self.newest_first(Job.objects.all())
        first = self.page({"limit": 3})
        skipped = self.page({"limit": 3, "cursor": first["next"], "offset": 2})
        self.assertEqual([i["id"] for i in skipped["items"]], expected[5:8])
        self.assertIsNone(skipped["next_offset"], "next_offset is for paging by offset alone")
        self.assertEqual(cursor_decode(skipped["next"]).id, uuid.UUID(expected[7]))
        by_offset = self.page({"limit": 3, "offset": 9})
        self.assertEqual(([i["id"] for i in by_offset["items"]], by_offset["next_offset"]), (expected[9:12], None))
        self.assertEqual(self.page({"limit": 3, "offset": 3})["next_offset"], 6)
        edge = self.page({"limit": 500, "offset": 10_000})
        self.assertEqual((edge["items"], edge["has_more"]), ([], False))
        self.assert_error(self.get(JOBS, {"offset": 10_001}), 400, "invalid_request", "offset")


def _token(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


class BadCursorTests(ListTestCase):
    def test_anything_but_a_cursor_this_api_gave_is_a_clear_400(self) -> None:
        self.rows(3, status=JobStatus.SUCCEEDED)
        good = self.page({"limit": 1})["next"]
        place = cursor_decode(good)
        micros = str((place.submitted_at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1))
        bad = [
            "x",
            "not a cursor",
            "%%%",
            "é",
            good + "x",
            good[:-3],
            good.upper(),
            "=" * 8,
            _token("hello"),
            _token(f"2|{micros}|{place.id.hex}"),  # another version
            _token(f"1|{micros}"),
            _token(f"1|{micros}|{place.id.hex}|x"),
            _token(f"1|-{micros}|{place.id.hex}"),
            _token(f"1| {micros}|{place.id.hex}"),
            _token(f"1|{micros}|{place.id.hex.upper()}"),
            _token(f"1|{micros}|{{{place.id.hex}}}"),
            _token(f"1|{micros}|{place.id}"),  # dashes
            _token(f"1|{'9' * 30}|{place.id.hex}"),  # past year 9999
            _token(f"1|{micros}|{'g' * 32}"),
            _token(f"1|{micros}|{place.id.hex}\x00"),
        ]
        for cursor in bad:
            with self.subTest(cursor=cursor):
                error = self.assert_error(self.get(JOBS, {"cursor": cursor}), 400, "invalid_cursor", "cursor")
                self.assertIn("`next`", error["message"])
                self.assertLess(len(error["message"]), 200, "the error does not echo the input")
        self.assert_error(self.get(JOBS, {"cursor": "a" * 101}), 400, "invalid_request", "cursor")
        # What cursor_encode writes round-trips, and an empty cursor is no cursor.
        self.assertEqual(cursor_encode(Job.objects.get(id=place.id)), good)
        self.assertEqual(len(self.page({"cursor": ""})["items"]), 3)
