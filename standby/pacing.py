"""How a spare engine's preparation yields to the engines that serve beside it.

A spare warms up (every shape run once, CUDA graphs captured) on the device and the CPUs that the primary
serves from. Run flat out, that work competes with the primary for both and slows it for as long as it lasts; a
spare is prepared ahead of need, so its warm-up can take longer instead. Two measures, both undone as soon as
the spare is needed:

- ``Pacer``: after each unit of warm-up work (one shape, one capture) the spare sleeps, so that it keeps the
  device busy at most a ``duty`` share of the time; a start message waiting on its pipe (the slot needs it now)
  ends the pauses.
- ``CpuShare``: while it prepares and waits, the spare's threads run on a quarter of the CPUs the process may
  use (at least one), the last ones, leaving the rest to the serving engines; at its start every thread gets the
  whole set back (changing one's own affinity needs no privilege, unlike raising one's priority again). A vLLM or
  SGLang spare's agent (``standby.agentspare``) narrows itself before it starts its server, which inherits the set,
  and at its start gives the server's every process and thread the whole set back.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from hotweights.proctree import descendants

log = logging.getLogger(__name__)

CPU_SHARE = 4  # a preparing spare runs on 1/CPU_SHARE of the CPUs


class Pacer:
    """Keeps a job's busy share of wall time at most ``duty`` (0 < duty <= 1): call ``step()`` after each unit of
    work. ``sync`` waits for the work a unit queued (the device's), so that it counts as busy; ``urgent()`` true:
    stop pausing for good (the work is needed now)."""

    def __init__(
        self,
        duty: float,
        urgent: Callable[[], bool] = lambda: False,
        sync: Callable[[], object] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        if not 0 < duty <= 1:
            raise ValueError(f"duty must be in (0, 1], found {duty}")
        self.duty, self.urgent, self.sync, self.clock, self.sleep = duty, urgent, sync, clock, sleep
        self.mark = clock()
        self.paused_s = 0.0  # slept so far

    def step(self) -> None:
        """One unit of work is done: pause for (1 - duty) / duty of the time it took, unless urgent."""
        if self.duty < 1 and self.urgent():
            log.info("spare: needed now, warming up without pauses")
            self.duty = 1.0
        if self.duty < 1:
            self.sync()
            pause = (self.clock() - self.mark) * (1 - self.duty) / self.duty
            self.sleep(pause)
            self.paused_s += pause
        self.mark = self.clock()


def narrowed(allowed: set[int], share: int = CPU_SHARE) -> set[int]:
    """The last ``len(allowed) // share`` CPUs of ``allowed`` (at least one)."""
    ordered = sorted(allowed)
    return set(ordered[-max(1, len(ordered) // share) :])


class CpuShare:
    """The process's CPU set, narrowed (``narrowed``) for every thread until ``restore``; processes it starts
    meanwhile inherit the narrowed set."""

    def __init__(self) -> None:
        self.allowed = os.sched_getaffinity(0)
        self.narrow = narrowed(self.allowed)
        _apply(Path("/proc/self/task"), self.narrow)

    def restore(self, tree: int | None = None) -> None:
        """Every thread of this process back on the whole set; with ``tree`` (a process it started meanwhile, a
        vLLM or SGLang server's), also every thread of that process and its descendants still on the narrowed set
        (one that set its own keeps it)."""
        _apply(Path("/proc/self/task"), self.allowed)
        if tree is not None:
            for pid in (tree, *descendants(tree)):
                _apply(Path(f"/proc/{pid}/task"), self.allowed, only=self.narrow)


def _apply(tasks: Path, cpus: set[int], only: set[int] | None = None) -> None:
    """``cpus`` for every thread under ``tasks`` (a process's /proc task folder; with ``only``, each whose set is
    that), threads made later inherit their maker's set. A thread or process that ends meanwhile is skipped."""
    try:
        names = [task.name for task in tasks.iterdir()]
    except OSError:  # the process ended
        return
    for name in names:
        try:
            if only is None or os.sched_getaffinity(int(name)) == only:
                os.sched_setaffinity(int(name), cpus)
        except (ProcessLookupError, PermissionError) as exc:  # a thread that just ended; a cgroup's refusal
            log.debug("thread %s keeps its CPU set: %s", name, exc)
