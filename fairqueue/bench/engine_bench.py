"""``python manage.py bench engine``: what one engine decision costs, against real Redis.

Server-side cost comes from ``INFO commandstats`` (the ``calls`` and ``usec`` totals of
``cmdstat_fcall`` for the engine's functions, ``cmdstat_evalsha`` for the trivial script,
read around each batch) with calls sent in pipelined batches, so the server runs them
back to back and the figure is the call's own cost. The trivial one-line script
(``return redis.call('incr', KEYS[1])``, sent by EVALSHA) is measured the same way,
in batches alternating with the measured ones, and the targets are ratios to it. The
same one-liner registered as a function is measured too, so the reader can see the
baseline does not flatter FCALL.
Throughput is measured with plain sequential round trips from one client and from
several processes. Uses its own Redis database (default db 12): refuses a non-empty one
and flushes it afterwards.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from fairqueue.engine import KeyLimit, ops
from fairqueue.engine.engine import Engine, fcall_args
from fairqueue.engine.keys import LAYOUT
from fairqueue.engine.scripts import Library, library, loaded_libraries

TRIVIAL = "return redis.call('incr', KEYS[1])"
# The floor under a one-key release with handoff: the eight Redis commands it cannot do
# without (the clock's PTTL, HMGET of spec/due/count/limit, HDEL of the spec, ZREM of the
# lease, the queue head by ZRANGEBYLEX, its ZREM, the HINCRBY of the head's flow count, the
# woken job's ZADD), with no logic around them, replying like the engine. It reads the
# engine's key order and wait-entry layout (lua/_lib.lua: ENTRY_JOB 45, the flow's count
# field after the job id, then the spec less its 42 order bytes: the lease at bytes 3-12
# after the field) to find the woken job, its flow and lease.
TRIVIAL_LIBRARY_NAME = "fqbench_trivial"
TRIVIAL_LIBRARY = (
    f"#!lua name={TRIVIAL_LIBRARY_NAME}\n"
    + """
redis.register_function('fq_bench_trivial', function(KEYS, ARGV) return redis.call('incr', KEYS[1]) end)
redis.register_function('fq_bench_release_floor', function(KEYS, ARGV)
  local job, key = ARGV[1], ARGV[2]
  local now = 1e15 - redis.call('PTTL', KEYS[4])
  local jf = '\\2' .. job
  redis.call('HMGET', KEYS[1], jf, '\\1due', key, '\\0' .. key)
  redis.call('HDEL', KEYS[1], jf)
  redis.call('ZREM', KEYS[3], job)
  local head = redis.call('ZRANGEBYLEX', KEYS[2], '[' .. key .. '\\0', '(' .. key .. '\\1', 'LIMIT', '0', '1')[1]
  redis.call('ZREM', KEYS[2], head)
  local j = #key + 45
  local z = string.find(head, '\\0', j, true)
  local y = string.find(head, '\\0', z + 1, true)
  redis.call('HINCRBY', KEYS[1], string.sub(head, z + 1, y - 1), -1)
  local woken = string.sub(head, j, z - 1)
  redis.call('ZADD', KEYS[3], string.format('%d', now + string.sub(head, y + 3, y + 12)), woken)
  return woken .. '\\0'
end)
"""
)
TAG = "bench"
BIG = 1_000_000_000  # a limit nobody reaches
TARGETS = {"admit_ratio": 8.0, "release_ratio": 9.0, "admit3_ratio": 20.0, "scaling_spread": 1.5, "pairs_ratio": 0.4}
FLOWS = 1_000  # the flows of the many-flows case, all on one key


AB_OPERATIONS = ("release", "release_flows", "release3", "admit", "park", "park_flows")
CHUNK = 200  # calls per measured batch; a trivial batch of the same size runs before each


@dataclass
class Sizes:
    """How much work each phase does (``--quick`` shrinks everything for the smoke test)."""

    server_calls: int = 20_000
    seq_seconds: float = 3.0
    processes: int = 4
    scaling_calls: int = 5_000
    scaling_points: tuple[tuple[int, int], ...] = (
        (10, 0),
        (1_000, 0),
        (10_000, 0),
        (10_000, 10_000),
        (10_000, 100_000),
    )

    @classmethod
    def quick(cls) -> Sizes:
        return cls(400, 0.2, 2, 400, scaling_points=((10, 0), (100, 0), (100, 500)))


class Bench:
    def __init__(self, url: str, sizes: Sizes, log: Callable[[str], None]) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url)
        self.engine = Engine(self.client)
        self.sizes = sizes
        self.log = log
        self.trivial_sha = self.client.script_load(TRIVIAL)
        self.client.function_load(TRIVIAL_LIBRARY, replace=True)
        self.serial = 0
        self.warnings: list[str] = []
        # Every library in the Functions VM is marked by each Lua GC cycle, which every
        # FCALL pays for: three stale versions made the trivial function 0.3x dearer.
        self.stale_libraries = [name for name in loaded_libraries(self.client) if name != library().name]
        if self.stale_libraries:
            self.warnings.append(
                f"{len(self.stale_libraries)} other engine library versions are loaded and slow every FCALL;"
                " `python manage.py engine_libraries --prune` deletes them"
            )

    # --- helpers ------------------------------------------------------------------
    def job_id(self) -> str:
        self.serial += 1
        return f"b{self.serial}"

    def pipelined(self, commands: Iterable[tuple[Any, ...]], batch: int = 200) -> None:
        pipe = self.client.pipeline(transaction=False)
        pending = 0
        for args in commands:
            pipe.execute_command(*args)
            pending += 1
            if pending == batch:
                pipe.execute()
                pending = 0
        if pending:
            pipe.execute()

    def call_args(self, call: ops.Call[Any]) -> tuple[Any, ...]:
        return ("FCALL", *fcall_args(call))

    def trivial_args(self) -> tuple[Any, ...]:
        return ("EVALSHA", self.trivial_sha, 1, "bench:trivial")

    def admit_args(self, keys: dict[str, int] | list[KeyLimit], priority: int = 0) -> tuple[Any, ...]:
        return self.call_args(
            ops.admit("fq", tag=TAG, job_id=self.job_id(), keys=keys, priority=priority, lease_seconds=600, data="")
        )

    def commandstats(self, verb: str) -> tuple[int, int]:
        """(calls, total µs) of one command so far, for deltas around a batch."""
        stats = self.client.info("commandstats").get(f"cmdstat_{verb}", {})
        return int(stats.get("calls", 0)), int(stats.get("usec", 0))

    def batch_us(self, commands: list[tuple[Any, ...]]) -> float:
        """Run pre-built calls (all of one verb) pipelined; their server µs per call."""
        verb = str(commands[0][0]).lower()
        calls0, usec0 = self.commandstats(verb)
        self.pipelined(commands, batch=len(commands))
        calls1, usec1 = self.commandstats(verb)
        if calls1 - calls0 != len(commands):
            self.warnings.append(f"{calls1 - calls0} {verb} calls seen for {len(commands)} sent (shared server?)")
        return (usec1 - usec0) / max(calls1 - calls0, 1)

    def ensure_library(self) -> None:
        self.client.function_load(library().source, replace=True)

    # --- phases ---------------------------------------------------------------------
    # This machine is shared: the cost of the same call drifts by 2x within minutes (other
    # tenants of the host). So every batch of CHUNK measured calls follows a batch of CHUNK
    # trivial calls, and the figure is the median over the batches of the ratio of the two:
    # both sides of each ratio saw the same weather.
    def measured(self, name: str, commands: list[tuple[Any, ...]]) -> dict[str, float]:
        """Median µs per call, trivial µs beside it and their ratio, over CHUNK-call batches."""
        self.pipelined(commands[:1])  # make sure the function is loaded and warm
        self.pipelined([self.trivial_args()])
        trivial = [self.trivial_args()] * CHUNK
        runs = []
        for i in range(1, len(commands), CHUNK):
            base = self.batch_us(trivial)
            runs.append((self.batch_us(commands[i : i + CHUNK]), base))
        us = statistics.median(r[0] for r in runs)
        base = statistics.median(r[1] for r in runs)
        ratio = statistics.median(r[0] / max(r[1], 1e-9) for r in runs)
        self.log(f"  {name:<38} {us:8.2f} µs/call server-side = {ratio:5.2f}x trivial beside it ({base:.2f} µs)")
        return {"us": us, "trivial_us": base, "ratio": ratio}

    def server_costs(self) -> dict[str, Any]:
        n = self.sizes.server_calls
        self.ensure_library()
        admit = self.measured("one-key admit", [self.admit_args({f"a{i % 10}": BIG}) for i in range(n)])
        admit3 = self.measured(
            "three-key admit",
            [self.admit_args({f"x{i % 10}": BIG, f"y{i % 10}": BIG, f"z{i % 10}": BIG}) for i in range(n)],
        )
        release = self.release_cost("one-key release with handoff", hint=True, park=True)
        park = release.pop("park")
        release_nohint = self.release_cost("  the same without the keys hint", hint=False)
        release_floor = self.release_cost("  its 8 Redis commands alone (floor)", hint=True, floor=True)
        release_reserve = self.release_cost("  the same at a key with a reserve", hint=True, reserve=True)
        flows = self.flows_cost()
        trivial_fcall = self.measured(
            "trivial one-liner as a function", [("FCALL", "fq_bench_trivial", 1, "bench:trivial")] * n
        )
        return {
            "trivial_server_us": statistics.median([admit["trivial_us"], admit3["trivial_us"], release["trivial_us"]]),
            "trivial_fcall_server_us": trivial_fcall["us"],
            # The VM drifts: each figure's own baseline (median of the batches beside it).
            "trivial_beside_us": {
                "admit": admit["trivial_us"],
                "admit3": admit3["trivial_us"],
                "release": release["trivial_us"],
                "release_nohint": release_nohint["trivial_us"],
                "release_floor": release_floor["trivial_us"],
                "release_reserve": release_reserve["trivial_us"],
                "trivial_fcall": trivial_fcall["trivial_us"],
                "park": park["trivial_us"],
                **{f"flows_{name}": row["trivial_us"] for name, row in flows.items()},
            },
            "park_server_us": park["us"],
            "park_ratio": park["ratio"],
            "flows": FLOWS,
            **{f"flows_{name}_server_us": row["us"] for name, row in flows.items()},
            **{f"flows_{name}_ratio": row["ratio"] for name, row in flows.items()},
            "admit_server_us": admit["us"],
            "admit3_server_us": admit3["us"],
            "release_server_us": release["us"],
            "release_nohint_server_us": release_nohint["us"],
            "release_floor_server_us": release_floor["us"],
            "release_reserve_server_us": release_reserve["us"],
            "admit_ratio": admit["ratio"],
            "admit3_ratio": admit3["ratio"],
            "release_ratio": release["ratio"],
            "release_nohint_ratio": release_nohint["ratio"],
            "release_floor_ratio": release_floor["ratio"],
            "release_reserve_ratio": release_reserve["ratio"],
        }

    def release_cost(
        self, name: str, hint: bool, floor: bool = False, park: bool = False, reserve: bool = False
    ) -> dict[str, Any]:
        """One holder and n parked waiters on a limit-1 key: each release hands the slot on.
        With ``hint`` the release names the job's keys, as FairQueue's workers do; with
        ``floor`` the same data is released by the bare commands of TRIVIAL_LIBRARY. With
        ``park`` the n admits that park (one flow: the default) are measured too. With
        ``reserve`` the key has limit 2 and reserve 1 instead (one-key jobs are never within
        a guarantee, so they stop at 1 holder the same way): such a key's release takes the
        general path, whatever the hint."""
        self.client.flushdb()
        n = self.sizes.server_calls
        first = self.serial + 1
        job_keys: dict[str, int] | list[KeyLimit] = [KeyLimit("h", 2, reserve=1)] if reserve else {"h": 1}
        parks = [self.admit_args(job_keys) for _ in range(n + 1)]
        self.pipelined(parks[:1])
        parked = self.measured("one-key admit that parks (one flow)", parks[1:]) if park else None
        if not park:
            self.pipelined(parks[1:])
        keys = ["h"] if hint else None
        calls = [self.call_args(ops.release("fq", tag=TAG, job_id=f"b{first + i}", keys=keys)) for i in range(n)]
        if floor:
            # FCALL, the engine's function, numkeys, KEYS..., job_id, hint -> the floor's
            calls = [("FCALL", "fq_bench_release_floor", *c[2 : 4 + c[2]], "h") for c in calls]
        out: dict[str, Any] = dict(self.measured(name, calls))
        if parked:
            out["park"] = parked
        self.client.flushdb()
        return out

    def flows_cost(self) -> dict[str, dict[str, float]]:
        """FLOWS flows on one limit-1 key: n admits park there round-robin across the flows
        (weight 1 each), then n hinted releases hand the slot on across them. Measured in
        four parts: a park that starts its flow's backlog (it reads the key's head) and one
        that joins it (the flow's records only); a handoff to a flow that keeps waiters and
        one to a flow's last waiter (its records go). Parked round-robin at equal weights,
        the fair order serves them in the order they parked, so the releases run in order."""
        self.client.flushdb()
        n = self.sizes.server_calls
        flows = min(FLOWS, n // 4)
        first = self.serial + 1
        parks = [self.admit_args([KeyLimit("f", 1, f"tenant:{i % flows}", 1.0)]) for i in range(n + 1)]
        self.pipelined(parks[:1])  # the holder; then every admit parks
        out = {
            "park_new": self.measured(f"park, starting one of {flows} flows", parks[1 : flows + 1]),
            "park": self.measured(f"park, joining one of {flows} flows", parks[flows + 1 :]),
        }
        calls = [self.call_args(ops.release("fq", tag=TAG, job_id=f"b{first + i}", keys=["f"])) for i in range(n)]
        out["release"] = self.measured(f"release, handing on across {flows} flows", calls[: n - flows])
        out["release_last"] = self.measured("release, handing on to a flow's last", calls[n - flows :])
        state = self.client.hkeys(f"fq:{{{TAG}}}:v{LAYOUT}:state")
        if any(f[:1] in (b"\4", b"\5") for f in state):  # nobody waits: no flow records may be left
            self.warnings.append("flow records left after the flows case")
        self.client.flushdb()
        return out

    def throughput(self) -> dict[str, float]:
        """Sequential round trips, one client and several processes. Each loop alternates
        one trivial call and one admit+release pair, timing each: on this VM a round trip
        drifts between 50 and 170 µs within seconds, and interleaving makes the two rates
        see the same conditions (alternating whole loops of half a second gave ratios from
        0.14 to 0.49; interleaved calls give the same ratio to 1%)."""
        secs, procs = self.sizes.seq_seconds, self.sizes.processes
        rounds, trivial_s, pairs_s = run_loop(self.url, secs, 0)
        out = {
            "trivial_calls_per_s_one_client": rounds / trivial_s,
            "pairs_per_s_one_client": rounds / pairs_s,
        }
        out["pairs_ratio_one_client"] = out["pairs_per_s_one_client"] / out["trivial_calls_per_s_one_client"]
        self.log(f"  trivial calls/s, one client         {out['trivial_calls_per_s_one_client']:10.0f}")
        self.log(f"  admit+release pairs/s, one client   {out['pairs_per_s_one_client']:10.0f}")
        self.client.flushdb()
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(procs) as pool:
            results = pool.starmap(run_loop, [(self.url, secs, i) for i in range(procs)])
        # Each process's rate of each kind, summed: what the processes would do together
        # if they all ran that kind.
        out["trivial_calls_per_s_concurrent"] = sum(n / trivial_s for n, trivial_s, _ in results)
        out["pairs_per_s_concurrent"] = sum(n / pairs_s for n, _, pairs_s in results)
        for kind, key in (("trivial", "trivial_calls_per_s_concurrent"), ("pairs", "pairs_per_s_concurrent")):
            self.log(f"  {kind} per s, {procs} processes{'':12} {out[key]:10.0f}")
        self.client.flushdb()
        out["concurrent_clients"] = procs
        return out

    def scaling(self) -> list[dict[str, float]]:
        """One-key admits at each size, twice: first right after the tag grew, then again.

        The first pass ("cold") can land in a rehash: Redis grows a hash object's table when
        it crosses a power of two and then moves one bucket per access, so for a while every
        lookup searches two tables. The second pass is the steady cost at that size, the
        figure the scaling target is about; both are reported."""
        rows: list[dict[str, float]] = []
        keys_now = waiters_now = 0
        for keys, waiters in self.sizes.scaling_points:
            # Grow the tag: `keys` keys each with one holder, `waiters` jobs parked on
            # ten limit-0 keys (parked jobs hold no lease and never expire).
            self.pipelined(self.admit_args({f"k{i}": BIG}) for i in range(keys_now, keys))
            self.pipelined(self.admit_args({f"w{i % 10}": 0}, priority=i % 3) for i in range(waiters_now, waiters))
            keys_now, waiters_now = max(keys, keys_now), max(waiters, waiters_now)
            name = f"one-key admit @ {keys} keys, {waiters} waiters"
            passes = [self.admit_pass(f"{name} (cold)", keys), self.admit_pass(name, keys)]
            rows.append(
                {
                    "keys": keys,
                    "waiters": waiters,
                    "admit_server_us": passes[1]["us"],
                    "ratio_to_trivial": passes[1]["ratio"],
                    "cold_ratio_to_trivial": passes[0]["ratio"],
                }
            )
        self.client.flushdb()
        return rows

    def admit_pass(self, name: str, keys: int) -> dict[str, float]:
        """Measure one-key admits on the tag's keys, then release them again (unmeasured)
        so the next pass or point sees just the tag's own size."""
        n = self.sizes.scaling_calls
        first = self.serial + 1
        point = self.measured(name, [self.admit_args({f"k{i % keys}": BIG}) for i in range(n)])
        self.pipelined(self.call_args(ops.release("fq", tag=TAG, job_id=f"b{first + i}")) for i in range(n))
        return point


def run_loop(url: str, seconds: float, worker: int) -> tuple[int, float, float]:
    """For ``seconds``: one trivial call, then one admit+release pair, and again; returns
    (rounds, seconds spent in the trivial calls, seconds spent in the pairs). Top level
    so 'spawn' processes can run it."""
    client = redis.Redis.from_url(url)
    engine = Engine(client)
    sha = client.script_load(TRIVIAL)
    key = f"bench:trivial:{worker}"
    client.evalsha(sha, 1, key)
    engine.release(tag=TAG, job_id="warm-up")
    keys = {f"p{worker}": BIG}
    names = list(keys)
    clock = time.perf_counter
    count = 0
    trivial_s = pairs_s = 0.0
    stop = clock() + seconds
    while True:
        for _ in range(25):
            job = f"p{worker}-{count}"
            t0 = clock()
            client.evalsha(sha, 1, key)
            t1 = clock()
            engine.admit(tag=TAG, job_id=job, keys=keys, lease_seconds=600)
            engine.release(tag=TAG, job_id=job, keys=names)
            t2 = clock()
            trivial_s += t1 - t0
            pairs_s += t2 - t1
            count += 1
        if clock() >= stop:
            break
    client.close()
    return count, trivial_s, pairs_s


def require_empty(url: str) -> None:
    """The benches flush their database afterwards: refuse one that holds anything."""
    with redis.Redis.from_url(url) as client:
        size = client.dbsize()
    if size:
        raise RuntimeError(f"Refusing to benchmark: Redis at {url} holds {size} keys; point --redis-url at an empty db")


def run(url: str, quick: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every phase; returns the figures (also the JSON written by the command)."""
    sizes = Sizes.quick() if quick else Sizes()
    require_empty(url)
    bench = Bench(url, sizes, log)
    try:
        log(f"FairQueue engine benchmark against {url}{' (quick)' if quick else ''}")
        log("Server-side cost (INFO commandstats, pipelined batches):")
        result: dict[str, Any] = bench.server_costs()
        log("Throughput (sequential round trips):")
        result.update(bench.throughput())
        log("Scaling of a one-key admit:")
        result["scaling"] = bench.scaling()
    finally:
        bench.client.flushdb()
        # Leave no library behind: every library in the Functions VM costs each FCALL.
        bench.client.function_delete(TRIVIAL_LIBRARY_NAME)
    # Scaling is compared on the local ratios too: µs alone would measure the VM's drift.
    scaling_ratios = [row["ratio_to_trivial"] for row in result["scaling"]]
    cold_ratios = [row["cold_ratio_to_trivial"] for row in result["scaling"]]
    result.update(
        scaling_spread=max(scaling_ratios) / max(min(scaling_ratios), 1e-9),
        scaling_spread_cold=max(cold_ratios) / max(min(scaling_ratios), 1e-9),
        pairs_ratio_concurrent=result["pairs_per_s_concurrent"] / result["trivial_calls_per_s_concurrent"],
        targets=TARGETS,
        warnings=bench.warnings,
        stale_libraries=bench.stale_libraries,
        quick=quick,
        redis_version=bench.client.info("server").get("redis_version"),
    )
    result["meets_targets"] = {
        "admit_ratio": result["admit_ratio"] <= TARGETS["admit_ratio"],
        "release_ratio": result["release_ratio"] <= TARGETS["release_ratio"],
        "flows_release_ratio": result["flows_release_ratio"] <= TARGETS["release_ratio"],
        "admit3_ratio": result["admit3_ratio"] <= TARGETS["admit3_ratio"],
        "scaling_spread": result["scaling_spread"] <= TARGETS["scaling_spread"],
        "pairs_ratio_one_client": result["pairs_ratio_one_client"] >= TARGETS["pairs_ratio"],
    }
    log("Ratios (targets in brackets):")
    log(f"  admit / trivial        {result['admit_ratio']:6.2f}x  [<= 8]")
    log(f"  release / trivial      {result['release_ratio']:6.2f}x  [<= 9]")
    log(f"  ... at a reserved key  {result['release_reserve_ratio']:6.2f}x         (the general path)")
    log(f"  ... across {result['flows']} flows {result['flows_release_ratio']:6.2f}x  [<= 9]")
    log(f"  park / trivial         {result['park_ratio']:6.2f}x         (one flow)")
    log(
        f"  ... across {result['flows']} flows {result['flows_park_ratio']:6.2f}x         (joining; starting one:"
        f" {result['flows_park_new_ratio']:.2f}x)"
    )
    log(f"  admit3 / trivial       {result['admit3_ratio']:6.2f}x  [<= 20]")
    log(f"  scaling max/min        {result['scaling_spread']:6.2f}x  [<= 1.5]")
    log(f"  ... cold max / min     {result['scaling_spread_cold']:6.2f}x         (first pass after the tag grew)")
    log(f"  pairs/s / trivial/s    {result['pairs_ratio_one_client']:6.2f}   [>= 0.4] (one client)")
    log(f"  pairs/s / trivial/s    {result['pairs_ratio_concurrent']:6.2f}          ({sizes.processes} processes)")
    for warning in bench.warnings:
        log(f"  warning: {warning}")
    return result


def ab_parks(bench: Bench, version: Library, n: int, operation: str, calls: int) -> list[tuple[Any, ...]]:
    """For ``engine-ab``: ``calls + 1`` admits, by ``version``'s own function, on a limit-1
    key of tag ``TAG<n>``: the first takes the key, the others park (``*_flows``:
    round-robin over FLOWS flows of weight 1; otherwise the default flow)."""
    tag, key = f"{TAG}{n}", "f" if operation.endswith("_flows") else "h"
    admit = version.function("admit_job")
    parks = []
    for i in range(calls + 1):
        keys = [KeyLimit(key, 1, f"tenant:{i % FLOWS}", 1.0)] if key == "f" else {key: 1}
        call = bench.call_args(
            ops.admit("fq", tag=tag, job_id=f"v{n}-{i}", keys=keys, priority=0, lease_seconds=600, data="")
        )
        parks.append(("FCALL", admit, *call[2:]))
    return parks


def ab_parked(bench: Bench, version: Library, n: int, operation: str, calls: int) -> list[tuple[Any, ...]]:
    """For ``engine-ab``: one holder and ``calls`` jobs parked (``ab_parks``, run here);
    returns the hinted releases, by that version's function, that hand the slot on through
    them in order."""
    tag, key = f"{TAG}{n}", "f" if operation.endswith("_flows") else "h"
    release = version.function("release_job")
    jobs = [f"v{n}-{i}" for i in range(calls + 1)]
    bench.pipelined(ab_parks(bench, version, n, operation, calls))
    return [
        ("FCALL", release, *bench.call_args(ops.release("fq", tag=tag, job_id=job, keys=[key]))[2:])
        for job in jobs[:calls]
    ]


def run_ab(
    url: str, lua_dirs: list[Path], operation: str = "release", calls: int = 40_000, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """A/B versions of the engine's Lua (``lua/`` directories) on the same workload.

    Engine changes worth a few percent drown in this VM's drift between two bench runs,
    so each version is loaded as its own library (a library is named by a hash of its
    source) and CHUNK-call batches of the versions alternate on one workload (the release
    cases on equal data of each version's own making, see ab_parked), each batch's cost
    taken as a ratio to the trivial batch just before it. ``release``: one
    holder and ``calls`` parked jobs on a limit-1 key, each hinted release handing the slot
    on; ``release_flows``: the same with the parked jobs spread round-robin over FLOWS flows
    (weight 1 each), so each handoff goes to another flow; ``release3``: hinted releases of
    three-key jobs on keys that never fill (the shape of FairQueue's own jobs: tenant,
    shard, sub-tenant); ``admit``: one-key admits on ten keys that never fill; ``park`` and
    ``park_flows``: the admits that park of ``release`` and ``release_flows``, measured
    themselves (each version parking on a tag of its own). Every loaded
    library costs each FCALL (the Lua GC marks it), so absolute ratios run higher than the main bench's;
    the differences between versions are the figure. Variant libraries are deleted after.
    """
    if operation not in AB_OPERATIONS:
        raise RuntimeError(f"unknown operation {operation!r}: one of {', '.join(AB_OPERATIONS)}")
    require_empty(url)
    bench = Bench(url, Sizes(), log)
    versions = [library(path.resolve()) for path in lua_dirs]
    if len({v.name for v in versions}) != len(versions):
        raise RuntimeError("two of the directories hold the same Lua: nothing to compare")
    current = library().name
    try:
        bench.ensure_library()
        for version in versions:
            bench.client.function_load(version.source, replace=True)
        ratios: dict[str, list[float]] = {v.name: [] for v in versions}
        trivial = [bench.trivial_args()] * CHUNK
        if operation in ("release", "release_flows", "park", "park_flows"):
            # Parked jobs are stored in the layout of the code that parked them, and two
            # versions may differ in it: each version parks its share on a tag of its own
            # with its own admit, and releases only those.
            share = calls // len(versions)
            if operation.startswith("park"):
                work_of = {}
                for n, v in enumerate(versions):
                    parks = ab_parks(bench, v, n, operation, share)
                    bench.pipelined(parks[:1])  # the holder: every admit after it parks
                    work_of[v.name] = parks[1:]
            else:
                work_of = {v.name: ab_parked(bench, v, n, operation, share) for n, v in enumerate(versions)}
            for start in range(0, calls // len(versions) - CHUNK + 1, CHUNK):
                for version in versions:
                    base = bench.batch_us(trivial)
                    batch = work_of[version.name][start : start + CHUNK]
                    ratios[version.name].append(bench.batch_us(batch) / max(base, 1e-9))
        else:
            if operation == "release3":
                first = bench.serial + 1
                keys = [{f"x{i % 10}": BIG, f"y{i % 10}": BIG, f"z{i % 10}": BIG} for i in range(calls)]
                bench.pipelined(bench.admit_args(k) for k in keys)
                work = [
                    bench.call_args(ops.release("fq", tag=TAG, job_id=f"b{first + i}", keys=sorted(keys[i])))
                    for i in range(calls)
                ]
            else:
                work = [bench.admit_args({f"a{i % 10}": BIG}) for i in range(calls)]
            done = 0
            while done + CHUNK * len(versions) <= len(work):
                for version in versions:
                    name = version.function("admit_job" if operation == "admit" else "release_job")
                    batch = [("FCALL", name, *call[2:]) for call in work[done : done + CHUNK]]
                    done += CHUNK
                    base = bench.batch_us(trivial)
                    ratios[version.name].append(bench.batch_us(batch) / max(base, 1e-9))
    finally:
        bench.client.flushdb()
        bench.client.function_delete(TRIVIAL_LIBRARY_NAME)
        for version in versions:
            if version.name != current:
                bench.client.function_delete(version.name)
    rows = [
        {
            "lua": str(path),
            "library": v.name,
            "ratio": statistics.median(ratios[v.name]),
            "batches": len(ratios[v.name]),
        }
        for path, v in zip(lua_dirs, versions, strict=True)
    ]
    log(f"{operation}, x trivial beside it (median over batches):")
    for row in rows:
        log(f"  {row['lua']:<40} {row['ratio']:6.2f}x  ({row['batches']} batches of {CHUNK})")
    return {"operation": operation, "versions": rows, "warnings": bench.warnings}
