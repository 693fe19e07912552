"""Gray faults: an engine that answers every health check but serves badly, slower or wrong (``standby.drillfaults``).

They need reference engines (the faults are their signals) and are run by name (``hotweights drill degrade-primary
wrong-output``), not by default. A round passes as every round does (no client error, no wrong output, no leak)
and when the controller acted as it promises:

- ``degrade-primary``: the primary's decode steps 20x slower: the group is switched over (planned) within
  ``SWITCH_WAIT_S``, not failed over; the slowed engine is a standby afterwards, its speed given back (on a loaded
  CPU a slowed step may outlast the progress check's 1 s, and the standby is then fenced as stalled);
- ``wrong-output``: a standby's outputs wrong (a standby, so that no client gets a wrong answer meanwhile, which
  would fail the round): its canary answer differs and it is fenced within ``FENCE_WAIT_S``, then started again,
  and the arena is verified (the round waits for the verdict, ``VERIFY_WAIT_S`` at most).

A group switches over from a slow primary once every ``health.degraded_every_s`` at most: a ``degrade-primary``
round sooner after the last is skipped with that reason.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import TYPE_CHECKING

from hotweights.chaos.faults import is_alive, send
from hotweights.chaos.scenarios import FENCE_WAIT_S, Round, Scenario, wait_dead
from hotweights.engines import Engine
from hotweights.eventkinds import EventField, EventKind
from hotweights.standby.drillfaults import SLOW_SIGNAL, SLOWDOWN, WRONG_SIGNAL

if TYPE_CHECKING:
    from hotweights.chaos.stack import DrillStack

SWITCH_WAIT_S = 15.0  # a slowed primary still primary this long after the fault fails the round
VERIFY_WAIT_S = 120.0  # the arena's check after a wrong answer (a process of its own that imports torch)


class GrayScenario(Scenario):
    def skip_reason(self, stack: DrillStack) -> str | None:
        engine = stack.config.groups[0].engine
        return None if engine == Engine.REFERENCE else f"needs reference engines (their drill signals), not {engine}"


class DegradePrimary(GrayScenario):
    name = "degrade-primary"
    measures = (
        f"{SLOW_SIGNAL.name} makes the primary's decode steps {SLOWDOWN:g}x slower while it answers every check: "
        "planned switchover to a standby, nothing fenced"
    )

    switched_at: float | None = None  # time.monotonic() of this drill's last switchover away from a slowed primary

    def skip_reason(self, stack: DrillStack) -> str | None:
        every = stack.config.health.degraded_every_s
        if self.switched_at is not None and (ago := time.monotonic() - self.switched_at) < every:
            return f"a group switches over from a slow primary once every {every:g} s at most, the last {ago:.0f} s ago"
        return super().skip_reason(stack)

    async def inject(self, r: Round) -> None:
        r.hit(r.primary(), SLOW_SIGNAL)

    async def settle(self, r: Round) -> None:
        deadline = time.monotonic() + SWITCH_WAIT_S
        while await self.still_primary(r):
            if time.monotonic() > deadline:
                r.problem = f"the slowed primary was still primary {SWITCH_WAIT_S:g} s later"
                return
            await asyncio.sleep(0.05)
        switched = [e for e in await r.api.events(r.fault_at) if e["kind"] == EventKind.SWITCHOVER]
        if not any(e.get(EventField.OLD) == r.targets[0].name for e in switched):
            r.problem = "the slowed primary was failed over from, not switched over"
        self.switched_at = time.monotonic()

    async def still_primary(self, r: Round) -> bool:
        view = await r.api.cluster()
        return view is None or any(m["id"] == r.targets[0].name for m in view.primaries())

    async def cleanup(self, r: Round) -> None:
        for target in r.targets:  # its speed back, a standby now
            if is_alive(target):
                send(target, SLOW_SIGNAL)


class WrongOutput(GrayScenario):
    name = "wrong-output"
    measures = (
        f"{WRONG_SIGNAL.name} makes a standby's outputs wrong while it answers every check: its canary answer "
        "differs from the others', it is fenced and started again"
    )

    async def inject(self, r: Round) -> None:
        r.hit(r.standby(), WRONG_SIGNAL)

    async def settle(self, r: Round) -> None:
        if not await wait_dead(r.targets[0], FENCE_WAIT_S):
            r.problem = f"the wrong standby was not fenced within {FENCE_WAIT_S:g} s"
            return
        deadline = time.monotonic() + VERIFY_WAIT_S
        while not (verified := [e for e in await r.api.events(r.fault_at) if e["kind"] == EventKind.ARENA_VERIFIED]):
            if time.monotonic() > deadline:
                r.problem = f"the arena was not verified within {VERIFY_WAIT_S:g} s of the fault"
                return
            await asyncio.sleep(0.2)
        if not verified[0].get("ok"):
            r.problem = f"the arena's verification failed: {verified[0]['message']}"

    async def cleanup(self, r: Round) -> None:
        for target in r.targets:  # one left unfenced is ended here: its outputs stay wrong
            send(target, signal.SIGKILL)


GRAY_SCENARIOS: dict[str, type[Scenario]] = {cls.name: cls for cls in (DegradePrimary, WrongOutput)}
