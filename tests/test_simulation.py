"""The what-if simulation: its engine model agrees with the reference model on random
operations, and on small hand-made scenarios the scheduler keeps the engine's rules (FIFO
within a flow, priority first, fair across flows, limits never exceeded, a woken job
starts only when a slot frees)."""

from __future__ import annotations

import random
from dataclasses import replace

from django.test import SimpleTestCase

from fairqueue.engine.ops import KeySpec, flow_cost
from fairqueue.jobs.admission import LiveSignals
from fairqueue.jobs.limits_plan import limits_plan
from fairqueue.simulation.calibration import Distribution, Latencies, latencies_measure
from fairqueue.simulation.engine_model import EngineModel
from fairqueue.simulation.records import Arrival, JobTiming
from fairqueue.simulation.scheduler import SimConfig, SimResult, percentile, simulate
from tenants.policy import ClassPolicy, PolicySnapshot, PoolPolicy, ShardPolicy, TenantPolicy
from tests.test_engine_model import Model

WEIGHTS = {"": 1.0, "x": 1.0, "y": 2.0, "z": 0.5}
KEYS = ["a", "b", "c", "d"]


def tenant(slug: str, **fields: object) -> TenantPolicy:
    return TenantPolicy.plain(slug, shard="s", **fields)


def policy(*tenants: TenantPolicy, capacity: int = 1000, **pool: object) -> PolicySnapshot:
    return PolicySnapshot(
        tenants={t.slug: t for t in tenants},
        shards={"s": ShardPolicy("s", capacity, 1)},
        classes={"default": ClassPolicy("default", 3600, 100, 1), "critical": ClassPolicy("critical", 60, 200, 1)},
        pool=replace(PoolPolicy(), **pool),  # type: ignore[arg-type]
    )


def starts(arrivals: list[Arrival], result: SimResult) -> list[tuple[float, float, Arrival]]:
    """(start, end, arrival) of every job that started, by start time."""
    out = [(a.at + w, a.at + w + a.duration, a) for a, w in zip(arrivals, result.job_waits, strict=True) if w == w]
    return sorted(out, key=lambda x: x[0])


# The intervals are rebuilt from arrival + wait (+ duration), which rounds differently from
# the model's own clock: a job that starts the instant another ends can come out a few ulps
# before it. Ends this close to a start count as before it.
SAME_INSTANT = 1e-9


def peak(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(s, 1) for s, _ in intervals] + [(e - SAME_INSTANT, -1) for _, e in intervals])
    best = running = 0
    for _, step in edges:
        running += step
        best = max(best, running)
    return best


def random_guards(rnd: random.Random, keys: list[str]) -> dict[str, tuple[str, int]]:
    """Guards on some of the keys after a job's first: an earlier key and a guarantee."""
    ordered = sorted(keys)
    return {k: (rnd.choice(ordered[:i]), rnd.randint(0, 3)) for i, k in enumerate(ordered) if i and rnd.random() < 0.5}


class EngineModelAgrees(SimpleTestCase):
    """The fast model (heaps, lazy withdrawal) against the reference model (lists), on
    random admits in random flows and priorities, with random reserves and guards,
    releases, cancels and limit and reserve changes: same admissions, same woken jobs in
    the same order, same queues, counts, limits, reserves and flow records after every
    step."""

    def test_random_operations(self) -> None:
        floor_parks = floor_served = 0
        for trial in range(400):
            rnd = random.Random(trial)
            ref, fast = Model(), EngineModel()
            next_id = 0
            for step in range(50):
                where = f"trial {trial} step {step}"
                op = rnd.random()
                if op < 0.5:
                    next_id += 1
                    keys = rnd.sample(KEYS, rnd.randint(1, 3))
                    limits = {
                        k: ref.limits[k] if k in ref.limits and rnd.random() < 0.8 else rnd.randint(0, 3) for k in keys
                    }
                    flows = {k: rnd.choice(sorted(WEIGHTS)) for k in keys}
                    reserves = {k: rnd.randint(0, 3) for k in keys if rnd.random() < 0.4}
                    guards = random_guards(rnd, keys)
                    priority = rnd.choice([0, 0, 1, 5, 250])
                    flow_weights = {k: (f, WEIGHTS[f]) for k, f in flows.items()}
                    want = ref.admit(str(next_id), limits, priority, "", flow_weights, reserves, guards)
                    woken: list[int] = []
                    specs = sorted(
                        KeySpec(
                            k,
                            limits[k],
                            flows[k],
                            flow_cost(WEIGHTS[flows[k]]),
                            min(reserves.get(k, 0), limits[k]),
                            *guards.get(k, (None, 0)),
                        )
                        for k in keys
                    )
                    self.assertEqual(fast.admit(next_id, specs, priority, woken), want.admitted, where)
                    self.assertEqual(woken, [int(j) for j, _ in want.woken], where)
                elif op < 0.8 and ref.jobs:
                    job = rnd.choice(sorted(ref.jobs))
                    woken = []
                    self.assertTrue(fast.release(int(job), woken))
                    self.assertEqual(woken, [int(j) for j, _ in ref.release(job).woken], where)
                elif op < 0.9 and ref.jobs:
                    job = rnd.choice(sorted(ref.jobs))
                    woken = []
                    got = fast.cancel(int(job), woken)
                    want = ref.cancel(job)
                    self.assertEqual(got, want.found, where)
                    self.assertEqual(woken, [int(j) for j, _ in want.woken], where)
                else:
                    limits = {k: rnd.randint(0, 3) for k in rnd.sample(KEYS, rnd.randint(1, 4))}
                    reserves = {k: rnd.randint(0, 3) for k in limits if rnd.random() < 0.5}
                    woken = []
                    fast.set_limits(limits, woken, reserves)
                    self.assertEqual(woken, [int(j) for j, _ in ref.set_limits(limits, reserves)], where)
                for key in KEYS:
                    self.assertEqual(fast.waiting_order(key), [int(j) for j in ref.waiting_order(key)], where)
                    self.assertEqual(fast.count(key), len(ref.holders.get(key, ())), where)
                    self.assertEqual(fast.limits.get(key), ref.limits.get(key), where)
                    self.assertEqual(fast.reserves.get(key), ref.reserves.get(key), where)
                self.assertEqual(fast.flows, ref.flow_records, where)
            floor_parks += sum(1 for event, _, p, _ in ref.log if event == "park" and p < 0)
            floor_served += sum(1 for event, _, p, _ in ref.log if event == "serve" and p < 0)
        # The runs exercise the floor band, not only the general one (several hundred of each).
        self.assertGreater(floor_parks, 300)
        self.assertGreater(floor_served, 100)


class SchedulerScenarios(SimpleTestCase):
    def run_sim(self, arrivals: list[Arrival], snapshot: PolicySnapshot, *, slots: int, **config: object) -> SimResult:
        return simulate(arrivals, policy=snapshot, shard="s", config=SimConfig(slots=slots, **config))  # type: ignore[arg-type]

    def test_fifo_within_a_tenant_and_waits_add_up(self) -> None:
        arrivals = [Arrival(at=100.0 + i * 0.1, tenant="a", duration=1.0) for i in range(4)]
        result = self.run_sim(arrivals, policy(tenant("a")), slots=1)
        self.assertEqual([s[2] for s in starts(arrivals, result)], arrivals)  # in submission order
        for i, wait in enumerate(result.job_waits):
            self.assertAlmostEqual(wait, i * 1.0 - i * 0.1, places=6)  # each starts when the last ends
        self.assertEqual(result.stranded, 0)
        self.assertAlmostEqual(result.busy_seconds, 4.0)

    def test_priority_first_on_a_full_key(self) -> None:
        # Hard max 1: one runs, the rest park on the tenant key; the critical job submitted
        # last is served before the earlier default ones.
        arrivals = [Arrival(at=10.0 + i * 0.01, tenant="a", duration=1.0, priority=100) for i in range(4)]
        arrivals.append(Arrival(at=10.5, tenant="a", duration=1.0, priority=200, latency_class="critical"))
        result = self.run_sim(arrivals, policy(tenant("a", max_concurrency=1, floor=1)), slots=8)
        order = [s[2] for s in starts(arrivals, result)]
        self.assertEqual(order[0], arrivals[0])
        self.assertEqual(order[1], arrivals[4])
        self.assertEqual(order[2:], arrivals[1:4])

    def test_fair_order_across_tenants_at_a_busy_shard(self) -> None:
        # The shard key (capacity 2) binds: a flood of 40 from "big" then 5 from "small" a
        # moment later. Fair order serves small's jobs between big's, not after all 40.
        big = [Arrival(at=50.0, tenant="big", duration=1.0) for _ in range(40)]
        small = [Arrival(at=50.05 + i * 0.001, tenant="small", duration=1.0) for i in range(5)]
        arrivals = big + small
        snapshot = policy(tenant("big"), tenant("small"), capacity=2)
        result = self.run_sim(arrivals, snapshot, slots=8)
        order = [s[2].tenant for s in starts(arrivals, result)]
        self.assertEqual(order.count("small"), 5)
        self.assertLessEqual(max(i for i, t in enumerate(order) if t == "small"), 14, order)
        self.assertLess(percentile(result.waits["small"], 99) or 0, percentile(result.waits["big"], 50) or 0)
        # The shard's capacity is never passed.
        self.assertLessEqual(peak([(s, e) for s, e, _ in starts(arrivals, result)]), 2)

    def test_limits_and_slots_are_never_exceeded(self) -> None:
        rnd = random.Random(3)
        arrivals = sorted(
            (
                Arrival(at=rnd.uniform(0, 60), tenant=rnd.choice(["a", "b", "c"]), duration=rnd.uniform(0.1, 3))
                for _ in range(600)
            ),
            key=lambda a: a.at,
        )
        snapshot = policy(tenant("a", max_concurrency=3, floor=1), tenant("b"), tenant("c"), capacity=10)
        for slots in (4, 16):
            result = self.run_sim(
                arrivals, snapshot, slots=slots, latencies=Latencies(turnaround=Distribution.flat((0.01, 0.05)))
            )
            done = starts(arrivals, result)
            self.assertEqual(len(done), len(arrivals), "every job runs")
            self.assertLessEqual(peak([(s, e) for s, e, _ in done]), min(slots, 10))
            self.assertLessEqual(peak([(s, e) for s, e, a in done if a.tenant == "a"]), 3)

    def test_a_limit_of_zero_strands_jobs_and_says_so(self) -> None:
        arrivals = [Arrival(at=1.0, tenant="a", duration=1.0), Arrival(at=1.0, tenant="b", duration=1.0)]
        result = self.run_sim(arrivals, policy(tenant("a", max_concurrency=1), tenant("b")), slots=0)
        self.assertEqual(result.stranded, 2)
        self.assertEqual(result.waits, {"a": [], "b": []})

    def test_a_higher_floor_is_what_a_squeezed_tenant_needed(self) -> None:
        # A full pool: "hog" keeps 40 jobs waiting, "steady" sends one job a second (about two
        # running at once). With floor headroom, the slots kept go to jobs below their
        # tenant's floor: with floor 1 only one of steady's jobs is, and the other waits for a
        # slot to free; with floor 6 both are, and they hardly wait.
        arrivals = sorted(
            [Arrival(at=float(i) * 0.05, tenant="hog", duration=2.0) for i in range(400)]
            + [Arrival(at=float(i), tenant="steady", duration=2.0) for i in range(20)],
            key=lambda a: a.at,
        )
        kept = {"f_min": 0.1, "floor_headroom": 3}
        low = policy(tenant("hog"), tenant("steady", floor=1, burst_floor=0, burst_pct=0.0), **kept)
        high = policy(tenant("hog"), tenant("steady", floor=6, burst_floor=0, burst_pct=0.0), **kept)
        before = self.run_sim(arrivals, low, slots=8)
        after = self.run_sim(arrivals, high, slots=8)
        self.assertLess(percentile(after.waits["steady"], 50) or 0, (percentile(before.waits["steady"], 50) or 0) / 2)

    def test_admission_and_the_tick_use_the_fleet_formula(self) -> None:
        # At submit a lone tenant's limit is its ceiling 4 x f_max 4 = 16 (the formula, as
        # limits_plan says too); the 14 others wait for the next duty tick (0.25-0.75 s
        # later), whose idle share lets them all run on the 32 slots.
        snapshot = policy(tenant("a"))
        plan = limits_plan(
            policy=snapshot, signals={"a": LiveSignals(pool_slots=32)}, held={"a": 0}, slots=32, in_flight=0
        )
        self.assertEqual(plan.limit("a"), 16)
        arrivals = [Arrival(at=0.0, tenant="a", duration=5.0) for _ in range(30)]
        result = self.run_sim(arrivals, snapshot, slots=32)
        self.assertEqual(sum(1 for w in result.job_waits if w == 0), 16)
        self.assertTrue(all(0.25 <= w <= 0.75 for w in result.job_waits if w > 0), result.job_waits)


class LatencyCalibration(SimpleTestCase):
    def test_latencies_are_drawn_at_the_activity_they_were_measured_at(self) -> None:
        # 60 quick samples while idle, 60 slow ones while busy: three levels of activity.
        samples = [(0.1, 0.01)] * 60 + [(3.0, 0.5)] * 60
        dist = Distribution.of(samples)
        self.assertEqual(len(dist.levels), 3)
        self.assertEqual(dist.draw(0.5, 0.0), 0.01)
        self.assertEqual(dist.draw(0.5, 5.0), 0.5)
        self.assertEqual(len(Distribution.of(samples[:30] + samples[-6:]).levels), 3)
        self.assertEqual(Distribution.of(samples[:20]).levels, ((0.01,) * 20,))  # too few: one level
        self.assertEqual(Distribution().draw(0.5, 1.0), 0.0)

    def test_measures_each_latency_where_it_applies(self) -> None:
        jobs = [
            # admitted at submit into an idle pool: admit 0.002, dispatch 0.010
            JobTiming(submitted=0.0, admitted=0.002, started=0.012, finished=1.0, worker="w1"),
            # parked, woken by that finish (not an admit or dispatch sample); its slot was
            # the one that freed at 1.0, but it was not ready before: no turnaround either
            JobTiming(submitted=0.5, admitted=1.0, started=1.03, finished=2.0, worker="w1"),
            # admitted at submit while w1's one slot was busy, started 0.05 after it freed
            JobTiming(submitted=1.5, admitted=1.5, started=2.05, finished=3.0, worker="w1"),
        ]
        lat = latencies_measure(jobs, slots=1)
        self.assertEqual(lat.admit.values(), [0.0, 0.002])
        self.assertEqual(lat.dispatch.values(), [0.010])
        self.assertEqual(len(lat.turnaround.values()), 1)
        self.assertAlmostEqual(lat.turnaround.values()[0], 0.05)

    def test_a_slot_that_waited_picks_up_a_message_later_one_that_did_not_at_once(self) -> None:
        # One slot. Job 1 finds it idle: starts a dispatch (0.1) after its admit (0.01).
        # Job 2 waits in the broker for it: starts a turnaround (0.3) after job 1 ends.
        arrivals = [Arrival(at=0.0, tenant="a", duration=1.0), Arrival(at=0.2, tenant="a", duration=1.0)]
        lat = Latencies(
            admit=Distribution.flat((0.01,)), dispatch=Distribution.flat((0.1,)), turnaround=Distribution.flat((0.3,))
        )
        result = simulate(arrivals, policy=policy(tenant("a")), shard="s", config=SimConfig(slots=1, latencies=lat))
        self.assertAlmostEqual(result.job_waits[0], 0.11)
        self.assertAlmostEqual(result.job_waits[1], 0.11 + 1.0 + 0.3 - 0.2)
