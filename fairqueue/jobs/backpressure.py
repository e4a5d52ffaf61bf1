"""Resource backpressure: a worker offers fewer slots while its memory, CPU or pressure
stalls are over their thresholds, and grows back, one slot at a time, once they are calm.

The slots a worker *offers* are what it takes messages for and what it publishes to the
fleet registry (fairqueue.jobs.fleet), so the pool target, the pressure factor of the
limit formula and the autoscaling signal all see the capacity the fleet really has.

How a withdrawn slot takes no job: a FairQueue worker acknowledges a delivery when its
task ends (acks_late) and prefetches one message per slot, so the broker channel's
prefetch count is exactly the number of messages the worker may hold at once, running
ones included. Lowering it to `offered x prefetch multiplier` stops the worker reading
the queue until its running jobs fall below that; raising it takes work again. Celery's
own autoscaler moves the same knob (`Consumer._update_prefetch_count`), through kombu's
thread-safe `QoS.increment_eventually` / `decrement_eventually`, which the consumer's
event loop applies on its next turn. Running jobs are never touched. kombu's QoS floor
is one message, so a worker always offers at least one slot (`min_slots`).

Hysteresis: every signal has a high and a low mark. Over a high mark the worker shrinks
at once to what it is running (less one, never under `min_slots`), then one slot less per
`step_seconds` while the pressure lasts; between the marks it holds; only after all
signals have stayed under their low marks for `recover_seconds` does it offer one more
slot, and so on, so a worker does not flap around a threshold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fairqueue.conf import fq_settings
from fairqueue.jobs.resources import ResourceSample, ResourceSampler

log = logging.getLogger("fairqueue.jobs.backpressure")

REASON_NONE = ""
GIB = 1024**3


@dataclass(frozen=True)
class Mark:
    """High and low marks of one signal (shares, 0..1); high 0 turns the signal off."""

    high: float
    low: float

    @property
    def enabled(self) -> bool:
        return self.high > 0


@dataclass(frozen=True)
class Thresholds:
    memory: Mark
    cpu: Mark
    pressure: dict[str, Mark]  # cpu, memory, io -> marks on the "some avg10" share
    min_slots: int = 1
    step_seconds: float = 1.0
    recover_seconds: float = 10.0

    @classmethod
    def from_settings(cls) -> Thresholds:
        conf = fq_settings().BACKPRESSURE
        return cls(
            memory=Mark(conf.MEMORY_HIGH, conf.MEMORY_LOW),
            cpu=Mark(conf.CPU_HIGH, conf.CPU_LOW),
            pressure={
                "cpu": Mark(conf.PSI_CPU_HIGH, conf.PSI_CPU_LOW),
                "memory": Mark(conf.PSI_MEMORY_HIGH, conf.PSI_MEMORY_LOW),
                "io": Mark(conf.PSI_IO_HIGH, conf.PSI_IO_LOW),
            },
            min_slots=max(1, int(conf.MIN_SLOTS)),
            step_seconds=float(conf.STEP_SECONDS),
            recover_seconds=float(conf.RECOVER_SECONDS),
        )

    def readings(self, sample: ResourceSample) -> list[tuple[str, float, Mark, str]]:
        """(signal, value, marks, label) of every enabled signal the sample has."""
        out: list[tuple[str, float, Mark, str]] = []
        if self.memory.enabled:
            label = f"memory ({sample.memory_source}, {sample.memory_used_bytes / GIB:.2f} GiB of "
            label += f"{sample.memory_limit_bytes / GIB:.2f})"
            out.append(("memory", sample.memory, self.memory, label))
        if self.cpu.enabled and sample.cpu is not None:
            out.append(("cpu", sample.cpu, self.cpu, "cpu"))
        for resource, mark in self.pressure.items():
            if mark.enabled and resource in sample.pressure:
                out.append((f"pressure_{resource}", sample.pressure[resource], mark, f"{resource} pressure stall"))
        return out


class SlotController:
    """The hysteresis of the offered slots: pure logic, fed one sample at a time."""

    def __init__(self, *, capacity: int, thresholds: Thresholds) -> None:
        self.capacity = capacity
        self.thresholds = thresholds
        self.offered = capacity
        self.reason = REASON_NONE  # a sentence for people (dashboard)
        self.signal = REASON_NONE  # the signal's name (a bounded metric label)
        self._last_shrink = float("-inf")
        self._calm_since: float | None = None

    def update(self, sample: ResourceSample, *, running: int, now: float) -> int:
        t = self.thresholds
        floor = min(t.min_slots, self.capacity)
        over: tuple[str, float, Mark, str] | None = None
        calm = True
        for reading in t.readings(sample):
            _, value, mark, _ = reading
            if value >= mark.high and over is None:
                over = reading
            if value > mark.low:
                calm = False
        if over is not None:
            signal, value, mark, label = over
            self._calm_since = None
            self.signal = signal
            self.reason = f"{label} at {value:.0%} ≥ {mark.high:.0%}"
            if self.offered > floor and now - self._last_shrink >= t.step_seconds:
                self.offered = max(floor, min(self.offered - 1, running))
                self._last_shrink = now
                log.warning("offering %d of %d slots: %s", self.offered, self.capacity, self.reason)
        elif calm:
            if self.offered < self.capacity:
                if self._calm_since is None:
                    self._calm_since = now
                elif now - self._calm_since >= t.recover_seconds:
                    self.offered += 1
                    self._calm_since = now
                    log.info("offering %d of %d slots: pressure has eased", self.offered, self.capacity)
            if self.offered >= self.capacity:
                self.signal = self.reason = REASON_NONE
            elif self.signal:
                self.reason = f"recovering after {self.signal}: one slot back per {t.recover_seconds:g} s"
        else:
            self._calm_since = None  # between the marks: hold what is offered
        return self.offered


def prefetch_apply(consumer: Any, slots: int) -> None:
    """Set the consumer's prefetch to `slots` messages per the prefetch multiplier.

    Goes through kombu's thread-safe *eventually* calls, as Celery's autoscaler does; the
    consumer's loop sends the new value to the channel. After a broker reconnect Celery
    rebuilds the QoS at full size, so this is re-applied on every sample.
    """
    qos = getattr(consumer, "qos", None)
    if qos is None or not qos.value:  # not started yet, or prefetch disabled
        return
    want = max(1, slots * max(1, int(getattr(consumer, "prefetch_multiplier", 1) or 1)))
    delta = want - int(qos.value)
    if delta > 0:
        qos.increment_eventually(delta)
    elif delta < 0:
        qos.decrement_eventually(-delta)


class Backpressure:
    """The worker's sampling thread: reads resources, moves the offered slots, applies them."""

    def __init__(
        self,
        *,
        consumer: Any,
        capacity: int,
        running: Callable[[], int],
        thresholds: Thresholds | None = None,
        sampler: ResourceSampler | None = None,
    ) -> None:
        conf = fq_settings().BACKPRESSURE
        self.consumer = consumer
        self.running = running
        self.controller = SlotController(capacity=capacity, thresholds=thresholds or Thresholds.from_settings())
        self.sampler = sampler or ResourceSampler(memory_limit_bytes=int(conf.MEMORY_LIMIT_BYTES))
        self.interval = float(conf.SAMPLE_SECONDS)
        self.enabled = bool(conf.ENABLED)
        self.last_sample: ResourceSample | None = None
        self._stop = threading.Event()

    @property
    def offered(self) -> int:
        return self.controller.offered

    @property
    def reason(self) -> str:
        return self.controller.reason

    @property
    def signal(self) -> str:
        return self.controller.signal

    def step(self) -> None:
        sample = self.sampler.sample()
        self.last_sample = sample
        self.controller.update(sample, running=self.running(), now=time.monotonic())
        prefetch_apply(self.consumer, self.controller.offered)

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:
                log.exception("backpressure sample failed")
            self._stop.wait(self.interval)

    def start(self) -> None:
        if self.enabled:
            threading.Thread(target=self.run, name="fairqueue-backpressure", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
