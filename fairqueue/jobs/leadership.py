"""One fleet, one duty: the worker that holds the duty lease runs the periodic duties.

The lease is a Redis key with an expiry, taken or extended in one atomic call; whoever
holds it ticks, everyone else only tries to take it. A leader that dies stops extending
it, and another worker takes it within one lease. Each new holder gets a fencing epoch
(a counter bumped on every takeover), so a leader that stalled past its lease learns on
its next call that it lost it and stops. A follower told how long the holder's lease still
runs tries again only once it may have ended: at fifty workers the followers' tries were
most of the Redis commands the duties cost, and a dead leader is still replaced within
one lease (plus a tick) of its last extension. The duties are safe to overlap anyway (atomic in
the engine, compare-and-set in the database): the lease is about not repeating work on
every worker, not about correctness.
"""

from __future__ import annotations

import contextlib
import time
import uuid

import redis

from fairqueue.jobs.runtime import redis_client

# One hash tag: the script touches both keys, which must share a Redis Cluster slot.
LEADER_KEY = "fq:{duties}:leader"
EPOCH_KEY = "fq:{duties}:epoch"
LEASE_MS = 2000

# Take the lease if free, extend it if ours; reply with our epoch, or, if another holds
# it, minus the milliseconds its lease still runs (at least 1).
_HOLD = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if holder then return -math.max(redis.call('PTTL', KEYS[1]), 1) end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
"""
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class DutyLease:
    """This process's claim on the fleet's periodic duties."""

    def __init__(self, hostname: str) -> None:
        self.token = f"{hostname}|{uuid.uuid4().hex[:8]}"
        self.epoch = 0
        self._quiet_until = 0.0  # monotonic: another's lease runs at least until then

    def hold(self) -> bool:
        """Take or extend the lease (one round trip; none while another's lease is known
        to run on); True while this process holds it. A follower whose quiet period ended
        asks the lease's remaining time first (one command, where the script runs three):
        most of the time the leader has renewed it, and the follower goes quiet again."""
        now = time.monotonic()
        if now < self._quiet_until:
            self.epoch = 0
            return False
        client = redis_client()
        try:
            if self._quiet_until:  # it followed last time: the lease was another's
                left = int(client.pttl(LEADER_KEY))
                if left > 0:
                    self._quiet_until = now + left / 1000
                    self.epoch = 0
                    return False
            reply = int(client.eval(_HOLD, 2, LEADER_KEY, EPOCH_KEY, self.token, LEASE_MS))
        except redis.RedisError:
            reply = 0  # cannot tell: do nothing this tick rather than duplicate the work
        if reply < 0:
            self._quiet_until = now - reply / 1000
        elif reply > 0:
            self._quiet_until = 0.0
        self.epoch = max(reply, 0)
        return reply > 0

    def release(self) -> None:
        """Hand the duties on at once (a clean shutdown) instead of after the lease."""
        with contextlib.suppress(redis.RedisError):  # else it expires within one lease
            redis_client().eval(_RELEASE, 1, LEADER_KEY, self.token)
        self.epoch = 0


def duty_leader() -> str | None:
    """The hostname whose worker runs the duties now, if any (dashboards, tests)."""
    holder = redis_client().get(LEADER_KEY)
    return str(holder).split("|", 1)[0] if holder else None
