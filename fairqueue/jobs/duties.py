"""The periodic duties of the fleet: reclaim expired holds, push limits, promote batch
jobs before their objective, admit due delayed and retrying jobs, admit what never reached
the engine, rebuild lost state.

Every duty is atomic where it touches the engine and conditional where it touches the
database, so running it from several processes at once is safe.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from django.utils import timezone

from fairqueue.engine import KeyLimit, KeysArg
from fairqueue.jobs import cells, fanout, live
from fairqueue.jobs.admission import (
    BATCH_KEY,
    QUARANTINE_KEY,
    SHARD_KEY,
    job_placement,
    known_resources,
    lane_limits,
    shard_reserve,
    shard_tag,
    tenant_key,
)
from fairqueue.jobs.capacity import capacity_step
from fairqueue.jobs.database import connections_heal
from fairqueue.jobs.dispatch import jobs_admit, outcomes_handle
from fairqueue.jobs.due import jobs_promote_due
from fairqueue.jobs.failure_log import FailureLog
from fairqueue.jobs.limits_plan import LimitsPlan, limits_plan
from fairqueue.jobs.memory_guard import memory_guard_step
from fairqueue.jobs.models import BATCH_DUE, KEY_SEPARATOR, WAITING_SINCE, Job, JobStatus
from fairqueue.jobs.moves import moves_track
from fairqueue.jobs.recovery import broker_watch, jobs_admit_pending, reconcile, releases_pending, state_ensure
from fairqueue.jobs.resource_keys import resource_limits_refresh
from fairqueue.jobs.retention import retention_due_prune
from fairqueue.jobs.runtime import engine
from tenants.limits import shard_caps
from tenants.policy import PolicySnapshot, policy_snapshot
from webhooks.sender import webhooks_send_due

log = logging.getLogger("fairqueue.jobs.duties")
duty_failures = FailureLog(log, "periodic duty")

BATCH_PROMOTE_AT = 0.75  # share of the batch objective after which a waiting batch job is promoted
SWEEP_JOBS_PER_TAG = 100
RETENTION_EVERY_SECONDS = 60.0
# The joins a crash left undone (fairqueue.jobs.fanout.joins_sweep) wait at most this long.
JOINS_SWEEP_EVERY_SECONDS = 5.0


def sweep_once(extra_tags: list[str] | tuple[str, ...] = ()) -> int:
    """Reclaim expired leases on every shard's tag (and `extra_tags`: places tenants were
    moved away from); returns how many jobs were reclaimed."""
    total = 0
    tags = sorted({shard_tag(s) for s in policy_snapshot().shards} | set(extra_tags))
    for result in engine().sweep(tags, max_jobs_per_tag=SWEEP_JOBS_PER_TAG).values():
        if result.reclaimed or result.woken:
            outcomes_handle(woken=result.woken, reclaimed=result.reclaimed)
        total += len(result.reclaimed)
    return total


_retention_last = 0.0


def retention_step() -> None:
    """Automatic retention, a bounded step at most every RETENTION_EVERY_SECONDS."""
    global _retention_last
    if time.monotonic() - _retention_last < RETENTION_EVERY_SECONDS:
        return
    _retention_last = time.monotonic()
    retention_due_prune()


_joins_last = 0.0


def joins_step() -> None:
    """Join the parents whose last child's join check was lost, at most every so often."""
    global _joins_last
    if time.monotonic() - _joins_last < JOINS_SWEEP_EVERY_SECONDS:
        return
    _joins_last = time.monotonic()
    fanout.joins_sweep()
    fanout.documents_prune()


def cells_step() -> None:
    """Build the cells if Redis has none, else check their oldest jobs (those due a check)."""
    if cells.cells_ensure() < 0:
        cells.cells_audit(incremental=True)


def scheduler_tick() -> None:
    """The periodic duties any worker may perform; all are atomic and safe to overlap.
    Each runs on its own: one failing (say, the database) does not stop the others."""
    old_tags: list[str] = []

    def track_moves() -> None:
        old_tags.extend(moves_track(policy_snapshot()))

    def sweep() -> None:
        sweep_once(old_tags)

    duties: list[Callable[[], object]] = [
        state_ensure,
        track_moves,
        jobs_promote_due,  # early: a due job should start within a second of its time
        sweep,
        limits_refresh,
        resource_limits_refresh,
        batch_promote_due,
        jobs_admit_pending,
        broker_watch,
        releases_pending,
        reconcile,
        retention_step,
        joins_step,
        capacity_step,
        webhooks_send_due,
        cells_step,
        memory_guard_step,
    ]
    for duty in duties:
        name = getattr(duty, "__name__", repr(duty))
        try:
            duty()
        except Exception as exc:
            duty_failures.failed(name, exc)
            # A database that went away leaves this thread's connection broken: heal it,
            # so the next duty (or tick) opens a live one once the server is back.
            connections_heal()
        else:
            duty_failures.succeeded(name)


def batch_promote_due(*, limit: int = 200) -> int:
    """Move batch jobs out of the idle-capacity lane before their objective would be missed.

    A job is promoted once it has waited BATCH_PROMOTE_AT of the batch objective; from then
    on it is admitted like any job of its latency class.
    """
    policy = policy_snapshot()
    cutoff = timezone.now() - timedelta(seconds=policy.pool.batch_objective_seconds * BATCH_PROMOTE_AT)
    due = list(
        Job.objects.select_related("tenant__shard")
        .filter(BATCH_DUE)
        # A delayed or retried job has waited since it became due, not since its submit.
        .alias(waiting_since=WAITING_SINCE)
        .filter(waiting_since__lte=cutoff)
        .order_by("waiting_since")[:limit]
    )
    promoted = [job for job in due if batch_promote(job, policy=policy)]
    # From the batch lane's cells to its class's, in the admission's round trip.
    jobs_admit(promoted, policy=policy, enter_cells=True)
    return len(promoted)


def batch_promote(job: Job, *, policy: PolicySnapshot) -> bool:
    """Take one parked batch job out of the batch lane (the caller admits it again, into
    its class's cells: `jobs_admit(enter_cells=True)`).

    Safe against every other transition: the engine's cancel is atomic (of two promoters
    one wins; a job woken meanwhile stays where it is), and the row changes only if it is
    still this generation, parked and unpromoted (a job cancelled meanwhile stays cancelled).
    """
    result = engine().cancel(tag=job.engine_tag, job_id=job.engine_id)
    if not result.cancelled:
        return False
    outcomes_handle(woken=result.woken, reclaimed=result.reclaimed)
    tenant = policy.tenants.get(job.tenant.slug)
    promoted_at = timezone.now()
    fields = {"promoted_at": promoted_at, "generation": job.generation + 1, "status": JobStatus.QUEUED}
    if tenant is not None:
        tag, names = job_placement(
            tenant=tenant,
            sub_tenant=job.sub_tenant,
            batch=False,
            resources=known_resources(policy, job.resource_names),
            document=job.document,
            quarantined=job.quarantined,
        )
        fields.update(engine_tag=tag, engine_keys=KEY_SEPARATOR.join(names))
    won = Job.objects.filter(
        id=job.id, generation=job.generation, status=JobStatus.PARKED, promoted_at__isnull=True
    ).update(**fields)
    if not won:
        return False
    for name, value in fields.items():
        setattr(job, name, value)
    return True


@dataclasses.dataclass
class _Pushed:
    """The limits this process last sent the engine, per tag, to send only changes."""

    limits: dict[str, dict[str, int | KeyLimit]] = dataclasses.field(default_factory=dict)  # tag -> key -> limit
    turn: int = 0  # which tag gets all its limits sent this tick (see limits_refresh)


_pushed = _Pushed()


@dataclasses.dataclass
class _Planned:
    """The last tick's plan, what it was computed from and what was derived from it. A tick
    whose inputs all equal the last one's (the steady state of a large fleet: most tenants
    idle, nothing moving) reuses them rather than run the formula over every tenant again;
    a shard at capacity (whose waiters the caps read) always recomputes."""

    inputs: tuple[object, ...] | None = None
    plan: LimitsPlan | None = None
    published: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    wanted: dict[str, dict[str, int | KeyLimit]] = dataclasses.field(default_factory=dict)
    # The signals view's read this plan (or its last reuse) went with: the view reports
    # changes since its previous read, which must be this one.
    signals_read: int = -1


_planned = _Planned()

# How far back a shard remembers what a tenant held, for the room it keeps free for it
# (tenants.limits.shard_caps `recent`): long enough to span the gaps between a steady
# tenant's jobs, short enough that a tenant gone quiet stops holding room within seconds.
RECENT_USE_SECONDS = 5.0
# Below this a tenant's recent use is forgotten (keeps the map to tenants that ran lately).
RECENT_USE_FORGOTTEN = 0.01
# A mean this close to what its tenant holds has reached it (see RecentUse.settled).
RECENT_USE_SETTLED = 0.001


@dataclasses.dataclass
class RecentUse:
    """What each tenant held of late: an exponentially weighted mean of its key's holders
    as the ticks of this process saw them (a new duty holder starts from what they hold).
    `version` changes whenever a mean moves by a hundredth of a slot or more, so a tick can
    tell that the room it keeps moved though nothing else did."""

    held: dict[str, float] = dataclasses.field(default_factory=dict)
    at: float | None = None
    version: int = 0
    # The holders last observed, and whether every mean had reached them then (within
    # SETTLED): the same dict again (the tick's holders unchanged) leaves every mean where
    # it is, so a steady tick makes no pass over every tenant.
    last: dict[str, int] | None = None
    settled: bool = False

    def observe(self, held: dict[str, int], now: float) -> dict[str, float]:
        if held is self.last and self.settled:
            self.at = now
            return self.held
        weight = 1.0 if self.at is None else 1.0 - math.exp(-max(now - self.at, 0.0) / RECENT_USE_SECONDS)
        self.at = now
        self.last = held
        mean = self.held
        moved = False
        settled = True
        for slug, n in held.items():
            before = mean.get(slug)
            if before is None:
                if n:
                    mean[slug] = float(n)
                    moved = True
                continue
            after = before + weight * (n - before)
            if after < RECENT_USE_FORGOTTEN and not n:
                del mean[slug]
                moved = True
                continue
            mean[slug] = after
            moved = moved or round(after, 2) != round(before, 2)
            settled = settled and abs(after - n) < RECENT_USE_SETTLED
        if moved:
            self.version += 1
        self.settled = settled
        return mean


_recent_use = RecentUse()


@dataclasses.dataclass(frozen=True)
class _Roster:
    """What the tick derives from one policy snapshot alone: each shard's tenants and the
    engine keys whose holders it reads (a policy change makes a new one)."""

    policy: PolicySnapshot
    members_of: dict[str, list[str]]
    keys_of: dict[str, Sequence[str]]  # tag -> [SHARD_KEY, its tenants' keys]


_roster: _Roster | None = None
_signals_view = live.SignalsView()


def _roster_for(policy: PolicySnapshot) -> _Roster:
    global _roster
    if _roster is None or _roster.policy is not policy:
        members_of: dict[str, list[str]] = {name: [] for name in policy.shards}
        for tp in policy.tenants.values():
            if tp.shard in members_of:
                members_of[tp.shard].append(tp.slug)
        keys_of: dict[str, Sequence[str]] = {
            shard_tag(name): [SHARD_KEY, *map(tenant_key, members)] for name, members in members_of.items()
        }
        _roster = _Roster(policy=policy, members_of=members_of, keys_of=keys_of)
    return _roster


@dataclasses.dataclass
class _Holders:
    """The holders the tick last read, per tag as the engine returned them, and what was
    derived from them, reused while the engine's counts are equal."""

    roster: _Roster | None = None
    counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    held: dict[str, int] = dataclasses.field(default_factory=dict)
    shard_held: dict[str, int] = dataclasses.field(default_factory=dict)


_holders = _Holders()


def _holders_read(roster: _Roster) -> tuple[dict[str, int], dict[str, int]]:
    """Every tenant key's holders and every shard key's, in one pipelined read; the very
    dicts of the last call when nothing changed."""
    global _holders
    counts = engine().counts_many(roster.keys_of)
    last = _holders
    if last.roster is roster and last.counts == counts:
        return last.held, last.shard_held
    held: dict[str, int] = {}
    shard_held: dict[str, int] = {}
    for name, members in roster.members_of.items():
        shard_counts = counts[shard_tag(name)]
        shard_held[name] = shard_counts.get(SHARD_KEY, 0)
        held.update({slug: shard_counts.get(tenant_key(slug), 0) for slug in members})
    _holders = _Holders(roster=roster, counts=counts, held=held, shard_held=shard_held)
    return held, shard_held


def limits_refresh() -> int:
    """Push every tenant's current limit (and each shard's batch room) to the engine.

    Limits travel with each admit, but a tenant whose jobs are all parked submits nothing;
    this tick is what lets a raised limit (idle pool, admin edit) wake its waiters within a
    second. It also shares the pool's unheld slots among tenants at their limit (see
    tenants.limits.idle_shares), which is what keeps the pool full under one big backlog,
    computes every tenant's max-min fair share of the pool (tenants.limits.fair_shares),
    below which pressure never squeezes it, and, where a shard's capacity binds, caps the
    tenants that want more than their fair share of the shard (tenants.limits.shard_caps).

    In bulk, whatever the number of tenants: one pipelined read of every tenant's signals
    (live.signals_read_many), one of every shard's holders (one more per full shard for
    its waiters), one publication of what changed and one pipelined write of the limits
    that changed. An admit passes its own limit too, so the engine's may differ from what
    this process last sent (one that missed a publication): each tick also sends one tag's
    limits whole, in turn, which corrects any within a tag count of ticks.
    """
    global _planned
    policy = policy_snapshot()
    roster = _roster_for(policy)
    members_of = roster.members_of
    fleet = live.fleet_state(max_age=0.05)  # the idle share must see the pool as it is now
    lanes = _lane_limits(policy)
    # The tick decides afresh: what it published last time (shares, caps, its limits) is
    # not an input, except each tenant's previous cap (see _key_limit).
    signals, signals_changed = _signals_view.read(list(policy.tenants), fleet=fleet)
    held, shard_held = _holders_read(roster)
    previous_caps: dict[str, int | None] = dict(live.shard_caps_read())
    recent = _recent_use.observe(held, time.monotonic())
    capacities = {
        name: max(0, shard.capacity - fleet.held_elsewhere.get(f"s:{name}", 0)) for name, shard in policy.shards.items()
    }
    # The signals count as equal when the view says none changed (comparing ten thousand
    # of them by value cost more than the rest of a steady tick).
    inputs = (dataclasses.replace(fleet, at=0.0), held, shard_held, previous_caps, _recent_use.version)
    if (
        _planned.plan is not None
        and _planned.inputs is not None
        and _planned.inputs[0] is policy
        and signals_changed is not None
        and not signals_changed
        and _planned.signals_read == _signals_view.reads - 1
        and _planned.inputs[1:] == inputs
        and all(shard_held[name] < capacity for name, capacity in capacities.items())
    ):
        plan, published, wanted = _planned.plan, _planned.published, _planned.wanted
        _planned.signals_read = _signals_view.reads
        reused = True
    else:
        plan = limits_plan(
            policy=policy,
            signals=signals,
            held=held,
            slots=fleet.slots,
            in_flight=fleet.in_flight + fleet.batch_in_flight,
            caps_for=lambda formulas: _shard_caps(
                policy, fleet, members_of, formulas, held, shard_held, previous_caps, recent
            ),
        )
        # The limits this tick sets are published too: a process admitting a tenant's jobs
        # passes the tick's limit (fairqueue.jobs.admission.tenant_limit_for) rather than
        # one from its own view of the pool, up to a second older, which would pull an idle
        # share or a shard cap back between ticks (a burst's later chunks reset its limit to
        # the bare formula while the pool sat idle).
        limits_set = {slug: plan.limit(slug) for slug in plan.breakdowns}
        published = {slug: (limit, signals[slug].held_elsewhere) for slug, limit in limits_set.items()}
        wanted = {}
        for name in policy.shards:
            room = fleet.pool_room(name)  # the pool's live slots, over every shard's key
            shard_limit = capacities[name] if room is None else min(capacities[name], room)
            # The shard key's reserve (the pool's floor headroom) goes with its limit.
            shard = KeyLimit(SHARD_KEY, shard_limit, reserve=shard_reserve(policy))
            limits: dict[str, int | KeyLimit] = {
                SHARD_KEY: shard,
                BATCH_KEY: fleet.batch_limit(name),
                QUARANTINE_KEY: lanes[name],
            }
            limits.update({tenant_key(slug): limits_set[slug] for slug in members_of[name]})
            wanted[shard_tag(name)] = limits
        _planned = _Planned(
            inputs=(policy, *inputs), plan=plan, published=published, wanted=wanted, signals_read=_signals_view.reads
        )
        reused = False
    # The quarantine lane's slots are the pool's, their free ones one shard's a tick (its
    # turn rotates): decided afresh each tick, a reused plan or not. A reused plan's tag
    # whose lane limit moved gets limits of its own; the others keep the plan's.
    for name, lane in lanes.items():
        tag = shard_tag(name)
        if tag in wanted and wanted[tag].get(QUARANTINE_KEY) != lane:
            wanted = {**wanted, tag: {**wanted[tag], QUARANTINE_KEY: lane}}
    if live.shares_publish(plan.idle, plan.fair, plan.caps, published, unchanged=reused):
        # What this process remembers sending may not hold either (another process ticked
        # meanwhile, or Redis lost its data): send every limit this tick.
        _pushed.limits.clear()
    whole = sorted(wanted)[_pushed.turn % len(wanted)] if wanted else None
    _pushed.turn += 1
    sending: dict[str, KeysArg] = {}
    for tag, limits in wanted.items():
        before = {} if tag == whole else _pushed.limits.get(tag, {})
        if before is limits:
            continue  # the very limits sent last tick (a reused plan)
        changed = [
            limit if isinstance(limit, KeyLimit) else (key, limit)
            for key, limit in limits.items()
            if before.get(key) != limit
        ]
        if changed:
            sending[tag] = changed
    # An unready tag (state lost, rebuild pending) is left alone: the rebuild's admits
    # bring the limits, and waking waiters there could pass jobs the engine forgot. Its
    # limits are then not remembered as sent: all go with the next tick.
    results = engine().set_limits_many(sending, require_ready=True) if sending else {}
    ready = engine().ready_tags(list(results)) if results else set()
    for tag in sending:
        if tag in ready:
            _pushed.limits[tag] = wanted[tag]
        else:
            _pushed.limits.pop(tag, None)
    woken = 0
    for result in results.values():
        if result:
            outcomes_handle(woken=result, reclaimed=[])
            woken += len(result)
    return woken


def _lane_limits(policy: PolicySnapshot) -> dict[str, int]:
    """The lane keys' limits this tick sets (fairqueue.jobs.admission.lane_limits), from
    their holders read now rather than from the fleet's cache: the leader, which admits
    the lane's jobs, admits them between ticks, and a limit from counts older than an
    admission would give its slot to a second shard."""
    held = live.lane_held_read(policy)
    return lane_limits(
        slots=policy.pool.quarantine_slots, held_by_shard=held, shards=list(policy.shards), turn=_pushed.turn
    )


def limits_pushed_forget() -> None:
    """Send every limit with the next tick, computed afresh (tests; a rebuilt tag)."""
    global _pushed, _planned, _signals_view, _holders, _recent_use
    _pushed = _Pushed()
    _planned = _Planned()
    _signals_view = live.SignalsView()
    _holders = _Holders()
    _recent_use = RecentUse()


def _key_limit(formula: int, cap: int | None) -> int:
    return formula if cap is None else min(formula, cap)


def _shard_caps(
    policy: PolicySnapshot,
    fleet: live.FleetState,
    members_of: dict[str, list[str]],
    formulas: dict[str, int],
    held: dict[str, int],
    shard_held: dict[str, int],
    previous: dict[str, int | None],
    recent: dict[str, float],
) -> dict[str, int]:
    """Caps for tenants that want more than their fair share of a shard whose capacity
    binds (tenants.limits.shard_caps). A tenant wants more when it holds as much as its key
    allows now: its formula, or the cap it was given last tick. An idle tenant whose
    formula would let a burst take more than the shard's room less what its shard-mates
    held of late is capped too (its first burst would fill the shard before a tick)."""
    caps: dict[str, int] = {}
    for shard_name, shard in policy.shards.items():
        members = [policy.tenants[slug] for slug in members_of[shard_name]]
        capacity = max(0, shard.capacity - fleet.held_elsewhere.get(f"s:{shard_name}", 0))
        wanting = {tp.slug for tp in members if held[tp.slug] >= _key_limit(formulas[tp.slug], previous.get(tp.slug))}
        holders = shard_held[shard_name]
        # At most the room an idle tenant would be capped at (what is kept is at most what
        # was held of late; waiters only exist at a full shard, where it is negative anyway):
        # an idle tenant whose formula is within it needs no cap, the common case.
        room_bound = capacity - holders - math.floor(sum(recent.get(tp.slug, 0.0) for tp in members) + 0.5)
        idle = {
            tp.slug
            for tp in members
            if not held[tp.slug] and tp.slug not in recent and formulas[tp.slug] > max(room_bound, tp.floor)
        }
        if not wanting and not idle:
            continue
        # Only a full key can have waiters: the read is needed only then.
        waiting = (
            engine().inspect_key(tag=shard_tag(shard_name), key=SHARD_KEY, holders=False).waiting
            if holders >= capacity
            else 0
        )
        caps.update(
            shard_caps(
                capacity=capacity,
                holders=holders,
                waiting=waiting,
                held={tp.slug: held[tp.slug] for tp in members},
                wanting=wanting,
                # As the shard key's fair order weighs them (fairqueue.jobs.admission).
                weight={tp.slug: float(max(tp.floor, 1)) for tp in members},
                floor={tp.slug: tp.floor for tp in members},
                recent={tp.slug: recent.get(tp.slug, 0.0) for tp in members},
                idle=idle,
            )
        )
    return caps
