"""The demand forecast: an hour-of-week profile of busy slots, smoothed over weeks.

Plain arithmetic on numbers (no Django, no Redis), shared by the live signal
(fairqueue.jobs.capacity) and the replay (`manage.py forecast`), so what the replay
measures is what production publishes.

Demand is the mean number of busy slots in an hour (job-seconds run in the hour / 3600),
per latency class, outside the batch lane. Hours are counted from the Unix epoch, in UTC;
the hour of the week counts from Monday 00:00 UTC. The profile value for an hour of the
week is a weighted mean of that hour's demand in the last `weeks` weeks, the latest with
weight 1, the one before with `decay`, then `decay`², ...: a recent change of level shows
within a week or two, and one odd day is damped. Weeks before the history starts are left
out (not counted as idle), so a fleet a few days old forecasts from the days it has.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

SECONDS_PER_HOUR = 3600
HOURS_PER_WEEK = 7 * 24
# 1970-01-01 was a Thursday: the epoch's hour 0 is hour 72 of its week (Monday 00:00 = 0).
EPOCH_HOUR_OF_WEEK = 3 * 24
DEFAULT_WEEKS = 4
DEFAULT_DECAY = 0.5
PEAK_STEP_SECONDS = 60  # resolution of the look-ahead
DEFAULT_SPREAD_SIGMAS = 1.0  # see with_spread

Profile = list[float]  # HOURS_PER_WEEK mean busy slots, indexed by hour of the week


def hour_index(ts: float) -> int:
    """Hours since the Unix epoch (UTC) of a timestamp."""
    return math.floor(ts / SECONDS_PER_HOUR)


def hour_of_week(hour: int) -> int:
    return (hour + EPOCH_HOUR_OF_WEEK) % HOURS_PER_WEEK


def profile_build(
    hourly: Mapping[int, float],
    *,
    now_hour: int,
    history_start_hour: int,
    weeks: int = DEFAULT_WEEKS,
    decay: float = DEFAULT_DECAY,
) -> Profile:
    """The profile from per-hour demand (`hourly`: hour index -> mean busy slots; hours
    missing from it were idle), using only complete hours before `now_hour` and none
    before `history_start_hour`."""
    profile = [0.0] * HOURS_PER_WEEK
    last_complete = now_hour - 1
    for offset in range(HOURS_PER_WEEK):
        latest = last_complete - offset  # the most recent complete occurrence of this hour of the week
        total = weights = 0.0
        for k in range(weeks):
            hour = latest - k * HOURS_PER_WEEK
            if hour < history_start_hour:
                break
            weight = decay**k
            total += weight * hourly.get(hour, 0.0)
            weights += weight
        if weights:
            profile[hour_of_week(latest)] = total / weights
    return profile


def profile_at(profile: Sequence[float], ts: float) -> float:
    """Expected busy slots at `ts`: linear between hour centres (an hour's mean sits at
    its middle), so the forecast rises smoothly into a busy hour."""
    position = ts / SECONDS_PER_HOUR - 0.5
    hour = math.floor(position)
    frac = position - hour
    here, there = profile[hour_of_week(hour)], profile[hour_of_week(hour + 1)]
    return here + (there - here) * frac


def profiles_at(profiles: Mapping[str, Sequence[float]], ts: float) -> float:
    """The fleet's expected busy slots at `ts`: the classes' profiles added up."""
    return sum(profile_at(p, ts) for p in profiles.values())


def with_spread(mean_busy: float, sigmas: float = DEFAULT_SPREAD_SIGMAS) -> float:
    """Busy slots that a mean of `mean_busy` stays under nearly all the time.

    The profile holds hourly means, but jobs arrive at random: the number running at once
    around a mean m spreads like a Poisson count (m arrivals per mean duration, each
    running independently), standard deviation √m. Capacity must cover some of the
    spread, as utilisation (which sees each burst) makes it do: m + sigmas * √m. More
    sigmas ask earlier and keep more idle (figures in docs/observability.md)."""
    return mean_busy + sigmas * math.sqrt(mean_busy) if mean_busy > 0 else 0.0


def forecast_peak(
    profiles: Mapping[str, Sequence[float]],
    *,
    start: float,
    horizon_seconds: float,
    spread_sigmas: float = DEFAULT_SPREAD_SIGMAS,
    step: float = PEAK_STEP_SECONDS,
) -> float:
    """The most busy slots expected at any time in [start, start + horizon], spread
    included: capacity asked for now is ready by then, so it must already cover that window."""
    steps = max(1, math.ceil(horizon_seconds / step))
    peak = max(profiles_at(profiles, start + i * horizon_seconds / steps) for i in range(steps + 1))
    return with_spread(peak, spread_sigmas)


def slots_for(busy: float, target_utilisation: float) -> int:
    """Slots that run `busy` slots' worth of work at the target utilisation."""
    if busy <= 0:
        return 0
    # A hair under an integer is that integer: float noise must not ask for a whole slot more.
    return math.ceil(busy / target_utilisation - 1e-9)


def slots_desired(*, busy_now: float, forecast_busy: float, target_utilisation: float) -> dict[str, int]:
    """What the fleet should have: the larger of the need now and the forecast's."""
    needed = slots_for(busy_now, target_utilisation)
    ahead = slots_for(forecast_busy, target_utilisation)
    return {"needed_now": needed, "forecast": ahead, "desired": max(needed, ahead)}
