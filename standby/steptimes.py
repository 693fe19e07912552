"""How slow the engine's decode steps are now against its own best: the slowness the controller compares.

A device that throttles, or a host whose engine lost its share of it, makes every step slower while the engine
goes on answering. The controller switches such a primary over (``controller.graywatch``) when it is several times
slower than it was, and than a standby is. What it reads is ``slowness``, measured per step of the device (the
decode step: a token for every active sequence; the time of the step alone, never a request's, so a queue under
overload adds nothing; and its device time: on a GPU the step's wall time, the host waiting for the device without
the GIL, on the CPU the inference thread's CPU time, so that the time a step waits for the interpreter or for a core,
as under overload of a shared host, is not counted as the device's):

- each decode step's shape (rows run, KV positions read) has a baseline: the least time a step of that shape took
  in this engine (warm-up's steps included where they ran eagerly), so a longer KV or a larger batch, as a long
  prompt or overload brings, is compared with itself. A shape's first step is not its own baseline where a shape
  known already bounds it (``bound``: one of as many rows or more and as many KV positions or more took less, or one
  of fewer rows, scaled up by the rows), so that a device slowed before the shapes its queue then brings were ever
  seen (a slowed primary's requests pile up into larger batches) is still measured against its speed;
- ``slowness`` is, over the steps of the last WINDOW_S (at least the last MIN_STEPS, so that steps slower than the
  window still count), their time divided by the time their baselines add up to:
  1.0 at the engine's best, 20 when every step takes 20 times its best, weighted by time (a step 20 times slower
  counts 20 times longer), so that a slowdown shows within a fraction of a second, and a single late step (a
  collection, a preempted thread) moves it little.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from hotweights.standby.drillfaults import DrillFaults

WINDOW_S = 1.0  # the recent steps ``slowness`` is measured over
MIN_STEPS = 3  # fewer steps than this in WINDOW_S: the last ones of IDLE_S instead (each slower than the window)
IDLE_S = 10.0  # an engine whose last step ended longer ago than this is idle: its speed is unknown
MAX_STEPS = 4096  # the most steps the window keeps (the oldest go first)

Shape = tuple[int, int]  # a decode step's (rows, KV positions)


@dataclass(frozen=True)
class Slowness:
    """The steps of a window: their count, their time and their baselines' time."""

    steps: int
    seconds: float
    baseline_s: float

    @property
    def ratio(self) -> float:
        return self.seconds / self.baseline_s if self.baseline_s > 0 else 1.0

    def to_json(self) -> dict[str, float]:
        """What ``/health/ready`` and a canary's reply carry (``controller.graywatch`` reads it)."""
        per_step = 1000 / self.steps if self.steps else 0.0
        return {
            "ratio": round(self.ratio, 3),
            "steps": self.steps,
            "step_ms": round(self.seconds * per_step, 3),
            "baseline_ms": round(self.baseline_s * per_step, 3),
        }


def window(steps: list[tuple[float, float, float]]) -> Slowness:
    """The ``Slowness`` of ``steps``, each (end, seconds, baseline seconds)."""
    return Slowness(len(steps), sum(s for _, s, _ in steps), sum(b for _, _, b in steps))


def bound(baselines: dict[Shape, float], shape: Shape) -> float:
    """The most a step of ``shape`` can take at its best, from the ``baselines`` of the shapes known (inf: none
    bounds it): a step's time grows with its rows and its KV positions, by a cost per row over a fixed cost, so one
    of as many KV positions or more bounds it, at its time where it had as many rows or more, at its time times the
    rows' ratio where it had fewer."""
    rows, positions = shape
    return min(
        (best * max(rows / known_rows, 1.0) for (known_rows, known), best in baselines.items() if known >= positions),
        default=float("inf"),
    )


class StepTimes:
    """Every decode step's time by shape (``stepped``, from the thread that steps), read from any thread."""

    def __init__(self) -> None:
        self.baselines: dict[Shape, float] = {}  # the least time of a step of each shape
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=MAX_STEPS)  # (end, seconds, baseline)
        self._lock = threading.Lock()

    def stepped(self, shape: Shape, seconds: float, end: float | None = None) -> None:
        """A step of ``shape`` took ``seconds`` and ended at ``end`` (time.monotonic(), default now)."""
        known = self.baselines.get(shape)
        baseline = min(seconds, bound(self.baselines, shape)) if known is None else min(known, seconds)
        self.baselines[shape] = baseline
        with self._lock:
            self._recent.append((time.monotonic() if end is None else end, seconds, baseline))

    def since(self, start: float) -> Slowness:
        """The steps that ended at or after ``start`` (time.monotonic())."""
        with self._lock:
            return window([step for step in self._recent if step[0] >= start])

    def recent(self) -> Slowness | None:
        """The last WINDOW_S's steps, or the last MIN_STEPS of IDLE_S where fewer ended in WINDOW_S (steps slower
        than the window); None when none ended in IDLE_S (an idle engine says nothing of its speed)."""
        now = time.monotonic()
        with self._lock:
            steps = [step for step in self._recent if step[0] >= now - IDLE_S]
        latest = [step for step in steps if step[0] >= now - WINDOW_S]
        chosen = latest if len(latest) >= MIN_STEPS else steps[-MIN_STEPS:]
        return window(chosen) if chosen else None


@dataclass(frozen=True)
class Clock:
    """A step's start: the monotonic clock and the thread's CPU time."""

    wall: float
    cpu: float

    @classmethod
    def now(cls) -> Clock:
        return cls(time.monotonic(), time.thread_time())


class StepWatch:
    """What every ``Decoder`` of an engine reports its decode steps to (``times``) and takes its drill faults from
    (``faults``, ``standby.drillfaults``)."""

    def __init__(self, times: StepTimes, faults: DrillFaults) -> None:
        self.times = times
        self.faults = faults

    def stepped(self, shape: Shape, started: Clock, on_cpu: bool) -> None:
        """A decode step of ``shape`` that started at ``started`` has its results on the host: slowed while the
        drill says so, then timed by its device time (module docstring; ``on_cpu``: the model's device is the CPU)."""
        own = time.thread_time() - started.cpu if on_cpu else time.monotonic() - started.wall
        own += self.faults.stepped(own)
        self.times.stepped(shape, own, time.monotonic())


WATCH = StepWatch(StepTimes(), DrillFaults())  # the engine process's: its serving decoders report here
