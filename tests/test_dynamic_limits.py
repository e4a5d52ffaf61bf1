"""Dynamic limits on the real stack: pressure sharing, idle expansion, sub-tenants, shards,
the batch lane, and admin edits reaching running workers."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from django.test import Client
from django.utils import timezone

from fairqueue.jobs import live
from fairqueue.jobs.admission import LiveSignals, shard_tag, tenant_key, tenant_limit_for
from fairqueue.jobs.dispatch import job_release
from fairqueue.jobs.duties import limits_pushed_forget, limits_refresh
from fairqueue.jobs.fleet import SEEN_KEY, WORKERS_KEY
from fairqueue.jobs.models import Job, JobStatus
from fairqueue.jobs.runtime import engine
from fairqueue.jobs.selectors import tenant_limits_explain
from fairqueue.jobs.submission import JobRequest, job_submit, job_submit_bulk
from tenants.models import PoolSettings, SubTenant, Tenant
from tenants.policy import policy_snapshot
from tenants.sync import policy_sync_all
from tests.factories import make_tenant
from tests.test_jobs_e2e import E2EBase, max_overlap
from tests.workers import WorkerProcess, wait_for


def result_intervals(jobs: list[Job]) -> list[tuple[datetime, datetime]]:
    return [(datetime.fromisoformat(j.result["started"]), datetime.fromisoformat(j.result["finished"])) for j in jobs]


class PressureTests(E2EBase):
    """Limits read off real Redis state: a registered fleet and real engine holds."""

    def register_fleet(self, slots: int) -> None:
        self.redis.hset(WORKERS_KEY, "fleet@test", slots)
        self.redis.zadd(SEEN_KEY, {"fleet@test": time.time() + 3600})
        live.live_invalidate()

    def test_under_saturation_every_limit_shrinks_by_the_same_factor_and_never_below_floor(self) -> None:
        tenants = [
            make_tenant("small", floor=1, burst_floor=3)[0],
            make_tenant("medium", floor=4, burst_pct=1.0)[0],
            make_tenant("large", floor=10, burst_floor=10)[0],
        ]
        self.register_fleet(20)  # pool target 20 * 0.85 = 17
        idle = {t.slug: tenant_limits_explain(tenant=t) for t in tenants}
        # Saturate: 34 non-batch jobs hold slots. The pool cap admits no more than the slots
        # there are, so they were admitted while the fleet had 40, which then shrank to 20.
        self.register_fleet(40)
        hog, _ = make_tenant("hog", floor=34, max_concurrency=34)
        for i in range(34):
            job_submit(tenant=hog, req=JobRequest(task="demo.sleep", args={"seconds": 60}, idempotency_key=f"h{i}"))
        self.register_fleet(20)
        busy = {t.slug: tenant_limits_explain(tenant=t) for t in tenants}
        self.assertEqual(busy["small"]["pool"]["in_flight"], 34)
        factors = {b["pressure_factor"] for b in busy.values()}
        self.assertEqual(factors, {0.5})  # 17 / 34, the same for everyone
        for slug, b in busy.items():
            self.assertEqual(b["limit"], max(int(b["ceiling"] * 0.5), b["floor"]), slug)
            self.assertGreaterEqual(b["limit"], b["floor"])
            self.assertLess(b["limit"], idle[slug]["limit"])
        self.assertEqual(busy["small"]["limit"], 2)  # ceiling 4 * 0.5
        self.assertEqual(busy["large"]["limit"], 10)  # 20 * 0.5 = 10, its floor

    def test_a_steady_tick_recomputes_the_limit_of_a_tenant_whose_signals_moved(self) -> None:
        PoolSettings.objects.filter(pk=1).update(rate_window_seconds=300, default_job_seconds=10)
        make_tenant("mover", floor=1)
        make_tenant("still", floor=1)
        policy_sync_all()
        self.register_fleet(200)
        now = time.time()
        for bucket in range(1, 11):  # 60 a minute
            live.record_submissions(tenant_slug="mover", count=30, now=now - bucket * 30)
        limits_pushed_forget()

        def tick_limit(slug: str) -> int | None:
            return live.tick_limit_parse(self.redis.hget(live.TICK_LIMITS_KEY, slug))[0]

        limits_refresh()
        limits_refresh()  # nothing moved: the plan of the first
        before, still = tick_limit("mover"), tick_limit("still")
        live.record_finish(tenant_slug="mover", seconds=30.0, batch=False)  # its mean: 10 s by default, now 30
        limits_refresh()
        self.assertIsNotNone(before)
        self.assertGreater(tick_limit("mover"), before)  # type: ignore[operator]
        self.assertEqual(tick_limit("still"), still)

    def test_under_saturation_tenants_below_their_fair_share_keep_their_ceiling(self) -> None:
        small = make_tenant("small", floor=1, burst_floor=3)[0]  # ceiling 4
        medium = make_tenant("medium", floor=4, burst_pct=1.0)[0]  # ceiling 8
        hog, _ = make_tenant("hog", floor=2, burst_floor=15)  # ceiling 17
        # The pool twice over its target: 34 jobs admitted while the fleet had 40 slots, and
        # the fleet down to 20 since (the pool cap admits no more than the slots there are).
        self.register_fleet(40)
        for i in range(34):
            job_submit(tenant=hog, req=JobRequest(task="demo.sleep", args={"seconds": 60}, idempotency_key=f"h{i}"))
        self.register_fleet(20)  # pool target 17
        limits_refresh()  # the tick: fair shares of the pool, published for every process
        explained = {t.slug: tenant_limits_explain(tenant=t) for t in (small, medium, hog)}
        self.assertEqual({e["pressure_factor"] for e in explained.values()}, {0.5})
        # Water-filling 17 over demands 4, 8, 17: small gets its 4, the other two 6.5 each.
        self.assertEqual([explained[s]["fair_share"] for s in ("small", "medium", "hog")], [4, 6.5, 6.5])
        self.assertEqual(explained["small"]["limit"], 4, "below its share: its full ceiling, not 4 * 0.5")
        self.assertEqual(explained["medium"]["limit"], 7, "its share (6.5, rounded up), not 8 * 0.5")
        hog_formula = explained["hog"]["limit"] - explained["hog"]["idle_share"]  # the share hands back slots
        self.assertEqual(hog_formula, 8, "above its share: squeezed by the factor, 17 * 0.5")

    def test_an_idle_share_never_lifts_a_limit_past_what_the_shard_can_run(self) -> None:
        tenant, _ = make_tenant("narrow", floor=1, burst_floor=1, shard_name="tight", shard_capacity=3)
        self.register_fleet(16)  # an idle pool: plenty of unheld slots to share out
        for i in range(40):
            job_submit(tenant=tenant, req=JobRequest(task="demo.sleep", args={"seconds": 60}, idempotency_key=f"n{i}"))
        live.live_invalidate()
        limits_refresh()
        self.assertLessEqual(tenant_limits_explain(tenant=tenant)["limit"], 3)

    def test_at_a_full_shard_a_tenant_wanting_more_gives_back_the_slots_a_shard_mate_waits_for(self) -> None:
        flood, _ = make_tenant("flood", floor=1, shard_name="tight", shard_capacity=4)
        mate, _ = make_tenant("mate", floor=1, shard_name="tight")
        self.register_fleet(16)
        sleep = {"seconds": 60}
        floods = [
            job_submit(tenant=flood, req=JobRequest(task="demo.sleep", args=sleep, idempotency_key=f"f{i}")).job
            for i in range(20)
        ]
        running = [j for j in floods if j.status == JobStatus.QUEUED]
        self.assertEqual(len(running), 4, "the shard's capacity")
        mates = [
            job_submit(tenant=mate, req=JobRequest(task="demo.sleep", args=sleep, idempotency_key=f"m{i}")).job
            for i in range(2)
        ]
        self.assertEqual([j.status for j in mates], [JobStatus.PARKED] * 2)
        live.live_invalidate()
        limits_refresh()
        explained = tenant_limits_explain(tenant=flood)
        self.assertEqual((explained["shard_cap"], explained["limit"]), (2, 2), "its fair share of the shard")
        self.assertIsNone(tenant_limits_explain(tenant=mate)["shard_cap"])
        tag = running[0].engine_tag
        for job in running[:2]:  # two flood jobs end: both slots go to the mate
            job_release(tag=tag, engine_id=job.engine_id, keys=job.engine_key_names)
        self.assertEqual(
            set(Job.objects.filter(id__in=[j.id for j in mates]).values_list("status", flat=True)), {"queued"}
        )
        waiting = [j for j in floods if j.status == JobStatus.PARKED]
        self.assertEqual(
            {engine().inspect_job(tag=tag, job_id=j.engine_id).parked_on for j in waiting},
            {tenant_key("flood")},
            "no flood job queued at the shard in front of a shard-mate",
        )
        for job in Job.objects.filter(id__in=[j.id for j in mates]):  # the mate is done
            job_release(tag=tag, engine_id=job.engine_id, keys=job.engine_key_names)
        limits_refresh()
        # The shard keeps room for what the mate held of late for a few seconds (its next
        # job would find a slot free), then gives it back to the tenant that wants it.
        flood_held = engine().counts(tag=tag, keys=[tenant_key("flood")])[tenant_key("flood")]
        self.assertLess(flood_held, 4, "room kept for the mate right after its jobs ended")

        def flood_has_the_shard() -> bool:
            limits_refresh()
            return engine().counts(tag=tag, keys=[tenant_key("flood")])[tenant_key("flood")] == 4

        wait_for(flood_has_the_shard, timeout=60, interval=0.5, message="the mate's room going back to flood")

    def test_a_burst_keeps_the_limit_the_tick_set_while_the_admitting_process_sees_the_pool_fill(self) -> None:
        hog, _ = make_tenant("hog", floor=2)  # ceiling 4
        self.register_fleet(16)
        limits_refresh()  # an idle pool: the tick sets (and publishes) 4 x f_max = 16
        tag, key = shard_tag("default"), tenant_key("hog")
        self.assertEqual(engine().inspect_key(tag=tag, key=key).limit, None, "idle keys keep no limit")
        sleep = {"seconds": 60}
        first = [JobRequest(task="demo.sleep", args=sleep, idempotency_key=f"a{i}") for i in range(20)]
        job_submit_bulk(tenant=hog, reqs=first)
        self.assertEqual(engine().inspect_key(tag=tag, key=key).held, 16)
        # This process now sees the pool full (pressure 13.6 / 16): its own formula says 3.
        live.fleet_state(max_age=0)
        self.assertEqual(
            tenant_limit_for(
                policy_snapshot(), policy_snapshot().tenants["hog"], LiveSignals(pool_slots=16, in_flight=16)
            ).limit,
            3,
        )
        second = [JobRequest(task="demo.sleep", args=sleep, idempotency_key=f"b{i}") for i in range(20)]
        job_submit_bulk(tenant=hog, reqs=second)
        self.assertEqual(engine().inspect_key(tag=tag, key=key).limit, 16, "not pulled back to the bare formula")

    def test_slots_held_at_a_place_moved_from_after_the_tick_still_count_against_its_limit(self) -> None:
        make_tenant("mover", max_concurrency=3)
        policy = policy_snapshot()
        tenant = policy.tenants["mover"]
        at_tick = LiveSignals(pool_slots=16, tick_limit=3)
        self.assertEqual(tenant_limit_for(policy, tenant, at_tick).limit, 3)
        # Moved after the tick, with 2 slots still held at the old place: 1 left here.
        moved = LiveSignals(pool_slots=16, tick_limit=3, held_elsewhere=2)
        self.assertEqual(tenant_limit_for(policy, tenant, moved).limit, 1)
        # The next tick subtracted them itself (limit 1 with 2 held elsewhere): not twice.
        ticked = LiveSignals(pool_slots=16, tick_limit=1, tick_held_elsewhere=2, held_elsewhere=2)
        self.assertEqual(tenant_limit_for(policy, tenant, ticked).limit, 1)
        # One of them finished since: the freed slot waits for the next tick, never more.
        drained = LiveSignals(pool_slots=16, tick_limit=1, tick_held_elsewhere=2, held_elsewhere=1)
        self.assertEqual(tenant_limit_for(policy, tenant, drained).limit, 1)

    def test_a_steady_tenant_earns_a_higher_base_than_a_bursty_one(self) -> None:
        steady, _ = make_tenant("steady", floor=1)
        bursty, _ = make_tenant("bursty", floor=1)
        PoolSettings.objects.filter(pk=1).update(rate_window_seconds=300, default_job_seconds=10)
        policy_sync_all()
        now = time.time()
        for bucket in range(1, 11):  # 30 jobs in each of the last ten 30 s intervals
            live.record_submissions(tenant_slug="steady", count=30, now=now - bucket * 30)
        live.record_submissions(tenant_slug="bursty", count=300, now=now - 30)  # the same 300 at once
        live.live_invalidate()
        s, b = tenant_limits_explain(tenant=steady), tenant_limits_explain(tenant=bursty)
        self.assertEqual(s["rate_per_min"], 60.0)
        self.assertEqual(s["base"], 10)  # 60/min x 10 s / 60
        self.assertEqual(b["base"], 1)  # its floor: a burst earns nothing
        self.assertGreater(s["limit"], b["limit"])


class IdleExpansionTests(E2EBase):
    def test_with_an_idle_pool_a_bursty_tenant_runs_well_past_its_floor(self) -> None:
        tenant, key = make_tenant("expander", floor=1, burst_floor=1)  # ceiling 2
        with WorkerProcess(slots=10):
            live.live_invalidate()
            explained = tenant_limits_explain(tenant=tenant)
            self.assertEqual(explained["pressure_factor"], 4.0)  # idle pool: f_max
            self.assertEqual(explained["limit"], 8)
            ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.6}})["id"] for _ in range(16)]
            jobs = self.wait_all_finished(ids)
        self.assertGreaterEqual(max_overlap(result_intervals(jobs)), 6)
        self.assertLessEqual(max_overlap(result_intervals(jobs)), 10)


class SubTenantAndShardTests(E2EBase):
    def test_a_flooding_sub_tenant_is_held_to_its_cap_while_siblings_run(self) -> None:
        tenant, key = make_tenant("hospital", floor=8, max_concurrency=8, sub_tenant_share=0.25)  # default cap 2
        SubTenant.objects.create(tenant=tenant, external_id="vip", max_concurrency=3)
        with WorkerProcess(slots=10):
            flood = [
                self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.5}, "sub_tenant": "ward-a"})["id"]
                for _ in range(10)
            ]
            time.sleep(0.2)
            sibling = [
                self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.5}, "sub_tenant": "ward-b"})["id"]
                for _ in range(2)
            ]
            vip = [
                self.submit(key, {"task": "demo.sleep", "args": {"seconds": 0.5}, "sub_tenant": "vip"})["id"]
                for _ in range(6)
            ]
            siblings = self.wait_all_finished(sibling)
            flooded = self.wait_all_finished(flood)
            vips = self.wait_all_finished(vip)
        self.assertEqual(max_overlap(result_intervals(flooded)), 2)
        self.assertEqual(max_overlap(result_intervals(vips)), 3)  # a registered sub-tenant's own cap
        # The sibling never waited for the flood: both its jobs ran together, at once.
        self.assertEqual(max_overlap(result_intervals(siblings)), 2)
        self.assertLess(max((j.started_at - j.submitted_at).total_seconds() for j in siblings), 1.0)

    def test_tenants_on_one_shard_share_its_capacity_and_a_full_shard_delays_no_other(self) -> None:
        _, key_a = make_tenant("a-on-small", shard_name="small", shard_capacity=2)
        _, key_b = make_tenant("b-on-small", shard_name="small")
        _, key_c = make_tenant("c-on-big", shard_name="big", shard_capacity=50)
        with WorkerProcess(slots=10):
            small = [self.submit(k, {"task": "demo.sleep", "args": {"seconds": 0.5}})["id"] for k in (key_a, key_b) * 4]
            time.sleep(0.2)
            big = [self.submit(key_c, {"task": "demo.sleep", "args": {"seconds": 0.5}})["id"] for _ in range(3)]
            bigs = self.wait_all_finished(big)
            smalls = self.wait_all_finished(small)
        self.assertEqual(max_overlap(result_intervals(smalls)), 2)
        self.assertEqual(max_overlap(result_intervals(bigs)), 3)
        self.assertLess(max((j.started_at - j.submitted_at).total_seconds() for j in bigs), 1.0)


class BatchLaneTests(E2EBase):
    def test_batch_waits_while_the_pool_is_busy_and_runs_when_it_is_idle(self) -> None:
        _, busy_key = make_tenant("interactive", floor=4, max_concurrency=4)
        _, batch_key = make_tenant("nightly", batch_enabled=True)
        with WorkerProcess(slots=4):  # pool target 4 * 0.85 = 3.4 -> 3 slots
            busy = [self.submit(busy_key, {"task": "demo.sleep", "args": {"seconds": 2.0}})["id"] for _ in range(4)]
            wait_for(lambda: Job.objects.filter(status=JobStatus.RUNNING).count() == 4, message="pool busy")
            batch = [
                self.submit(batch_key, {"task": "demo.sleep", "args": {"seconds": 0.2}, "batch": True})["id"]
                for _ in range(3)
            ]
            time.sleep(1.0)
            self.assertEqual(Job.objects.filter(id__in=batch, status=JobStatus.PARKED).count(), 3)
            fleet = live.fleet_state(max_age=0)
            self.assertEqual((fleet.in_flight, fleet.batch_in_flight), (4, 0))
            busy_jobs = self.wait_all_finished(busy)
            batch_jobs = self.wait_all_finished(batch, timeout=20)
        last_busy_end = max(j.finished_at for j in busy_jobs)
        self.assertGreaterEqual(min(j.started_at for j in batch_jobs), last_busy_end - timedelta(milliseconds=50))
        self.assertTrue(all(j.promoted_at is None for j in batch_jobs))

    def test_batch_jobs_are_not_counted_in_the_scale_up_signal(self) -> None:
        _, batch_key = make_tenant("bulk", batch_enabled=True)
        with WorkerProcess(slots=4):
            ids = [
                self.submit(batch_key, {"task": "demo.sleep", "args": {"seconds": 1.5}, "batch": True})["id"]
                for _ in range(3)
            ]
            wait_for(lambda: Job.objects.filter(id__in=ids, status=JobStatus.RUNNING).count() == 3, message="batch")
            fleet = wait_for(lambda: (f := live.fleet_state(max_age=0)).busy_batch == 3 and f, message="heartbeat")
            self.assertEqual(fleet.in_flight, 0)  # the pressure signal
            self.assertEqual(fleet.batch_in_flight, 3)
            self.assertEqual(fleet.busy - fleet.busy_batch, 0)  # the autoscaling signal's numerator
            self.wait_all_finished(ids)

    def test_a_waiting_batch_job_is_promoted_before_its_objective(self) -> None:
        _, busy_key = make_tenant("always-busy", floor=4, max_concurrency=4)
        _, batch_key = make_tenant("deadline", batch_enabled=True)
        PoolSettings.objects.filter(pk=1).update(batch_objective_seconds=4)
        policy_sync_all()
        with WorkerProcess(slots=4):
            busy = [self.submit(busy_key, {"task": "demo.sleep", "args": {"seconds": 6.0}})["id"] for _ in range(3)]
            wait_for(lambda: Job.objects.filter(status=JobStatus.RUNNING).count() == 3, message="busy")
            job = self.submit(batch_key, {"task": "demo.sleep", "args": {"seconds": 0.1}, "batch": True})
            done = wait_for(
                lambda: (j := Job.objects.get(id=job["id"])).status == JobStatus.SUCCEEDED and j,
                timeout=15,
                message="promoted batch job",
            )
            self.assertIsNotNone(done.promoted_at)
            waited = (done.started_at - done.submitted_at).total_seconds()
            self.assertGreaterEqual(waited, 2.5)  # it did wait in the batch lane first
            self.assertLess(waited, 4.0)  # and still met its 4 s objective
            self.assertTrue(Job.objects.filter(id__in=busy, status=JobStatus.RUNNING).exists())


class AdminEditTests(E2EBase):
    def test_raising_a_hard_max_in_the_admin_reaches_a_running_worker_within_a_second(self) -> None:
        tenant, key = make_tenant("edited", floor=1, max_concurrency=1)
        from django.contrib.auth.models import User

        staff = User.objects.create_superuser("ops", "ops@example.com", "pw")
        admin = Client()
        admin.force_login(staff)
        with WorkerProcess(slots=6):
            # Long enough that none ends (and frees a slot for a fourth) while the test looks.
            ids = [self.submit(key, {"task": "demo.sleep", "args": {"seconds": 8.0}})["id"] for _ in range(6)]
            wait_for(lambda: Job.objects.filter(status=JobStatus.RUNNING).count() == 1, message="one running")
            time.sleep(0.5)
            self.assertEqual(Job.objects.filter(status=JobStatus.RUNNING).count(), 1)
            page = admin.get(f"/admin/tenants/tenant/{tenant.pk}/change/")
            form = page.context["adminform"].form
            data = {k: v for k, v in form.initial.items() if v is not None and not isinstance(v, list)}
            data.update(
                {
                    "shard": tenant.shard_id,
                    "max_concurrency": 4,
                    "default_latency_class": "",
                    "sub_tenants-TOTAL_FORMS": 0,
                    "sub_tenants-INITIAL_FORMS": 0,
                    "active": "on",
                }
            )
            data.pop("batch_enabled", None)
            saved_at = timezone.now()
            resp = admin.post(f"/admin/tenants/tenant/{tenant.pk}/change/", data)
            self.assertEqual(resp.status_code, 302, getattr(resp, "context", None) and resp.context["adminform"].errors)
            self.assertEqual(Tenant.objects.get(pk=tenant.pk).max_concurrency, 4)
            wait_for(lambda: Job.objects.filter(status=JobStatus.RUNNING).count() == 4, timeout=5, message="4 running")
            started = sorted(j.started_at for j in Job.objects.filter(id__in=ids, started_at__gt=saved_at))
            self.assertEqual(len(started), 3)
            self.assertLess((started[-1] - saved_at).total_seconds(), 1.0)
