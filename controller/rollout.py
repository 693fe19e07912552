"""Rolling restart of one failover group (``POST /rollout``): every engine restarted once, the group serving throughout.

The standbys first, one at a time: SIGTERM (in-flight requests finish), start again with the cluster's
current engine settings, wait until it is a ready standby (for at most the group's start timeout).
Then a switchover to a restarted standby, then the old primary, a standby by now, the same way. The
primary is never stopped before a switchover away from it succeeded. The first failed step aborts the
rollout with a ``rollout`` event naming the step and the reason; the group keeps its serving primary
and the HA loop tends what is left (a standby that did not come back is restarted as usual). While a
standby restarts, a primary that fails aborts the rollout too, so the loop can fail over at once.

A model update (``--model NEW``) is a rollout with a first and a last step: the group's next weight
generation gets a daemon of its own that loads NEW while the old one serves, and engines started from then
on map NEW; the standbys are restarted onto it, the switchover makes one of them the primary (clients'
answers change there, once), and the old primary is restarted onto it too. Last, the old generation's
daemon is stopped: no engine maps its arena any more, so the memory is freed. A load that fails aborts
before anything restarted. A later step that fails before any engine of NEW has been primary reverts the
group: engines start on the old generation again, NEW's standbys are stopped (the loop restarts them on the
old weights) and NEW's daemon is retired once none maps it, so a NEW that no engine can start on never
leaves the group without standbys. After the switchover, an abort leaves the group serving on NEW (answers
never switch back), and engines (re)started from then on map NEW.

Mechanism only: the HA loop checks the preconditions, and runs a ``Rollout`` as one action on the
group's executor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hotweights.contract import Role
from hotweights.controller.cluster import Cluster, ServiceFailed, filled
from hotweights.controller.events import EventLog
from hotweights.controller.snapshot import MemberView
from hotweights.controller.stack import Generation
from hotweights.controller.supervisor import FENCE_TIMEOUT_S, STOP_TIMEOUT_S
from hotweights.eventkinds import EventKind
from hotweights.stats import ms

log = logging.getLogger(__name__)

READY_POLL_S = 0.05  # how often a restarting engine's health record is read


class StepFailed(Exception):
    """A step did not complete; the message says why."""


def rollout_wait_s(members: list[MemberView], switchover_wait_s: float) -> float:
    """The longest a rollout of ``members`` may take: each one's stop and start, plus one switchover."""
    return sum(STOP_TIMEOUT_S + FENCE_TIMEOUT_S + m.start_timeout_s for m in members) + switchover_wait_s


@dataclass
class RolloutProgress:
    """What ``GET /cluster`` shows of a group's rollout: queued (step 0), then step ``step`` of ``plan``."""

    group: int
    started_at: float = field(default_factory=time.time)
    plan: list[str] = field(default_factory=list)
    step: int = 0
    started: bool = False  # its action began (until then, a requester that gives up withdraws it)

    def describe(self) -> str:
        if not self.step:
            return "queued"
        return f"step {self.step} of {len(self.plan)}: {self.plan[self.step - 1]}"

    def to_json(self) -> dict[str, Any]:
        started = datetime.fromtimestamp(self.started_at, UTC).isoformat(timespec="milliseconds")
        current = self.plan[self.step - 1] if self.step else None
        return {"group": self.group, "step": self.step, "steps": len(self.plan), "current": current, "started": started}


class Rollout:
    """Runs the steps of one group's rollout, reporting each to ``progress`` and as a ``rollout`` event.

    ``is_failed`` is the HA loop's verdict on an engine (None: fine); ``switchover`` moves the group's
    primary to its best ready standby and returns the new primary's id, raising StepFailed if it did not;
    ``retire`` stops the daemons of older generations that no engine maps any more and says what it did."""

    def __init__(
        self,
        cluster: Cluster,
        events: EventLog,
        progress: RolloutProgress,
        is_failed: Callable[[MemberView], str | None],
        switchover: Callable[[], Awaitable[str]],
        retire: Callable[[], Awaitable[str]],
    ) -> None:
        self.cluster = cluster
        self.events = events
        self.progress = progress
        self.is_failed = is_failed
        self.switchover = switchover
        self.retire = retire
        self.steps: list[dict[str, Any]] = []

    async def run(
        self, primary: MemberView, standbys: list[MemberView], model: Path | None = None
    ) -> tuple[str, list[dict[str, Any]]]:
        """Every step in order (with ``model``, a model update's first and last ones too); returns the sentence
        and each step's report. Raises StepFailed at the first failed step (after recording it)."""
        group, start = self.progress.group, time.monotonic()
        self.progress.plan = [f"load {model} as the next weight generation"] if model else []
        self.progress.plan += [f"restart {m.id}" for m in standbys] + [f"switchover from {primary.id}"]
        self.progress.plan.append(f"restart {primary.id}")
        self.progress.plan += ["retire the old generation's daemon"] if model else []
        if model is None:
            new = await self._roll(primary, standbys)
        else:
            previous = self.cluster.weights[group].current
            await self._step(self._load(model, primary.id), member=primary.id)
            try:
                new = await self._roll(primary, standbys)
            except StepFailed as exc:
                if self.cluster.weights[group].served:  # the answers switched: they never switch back
                    raise
                raise StepFailed(f"{exc}; {await self._revert(previous)}") from None
            await self._step(self._retire(new), member=new)
        total_ms = ms(time.monotonic() - start)
        sentence = (
            f"rolled out group {group}: restarted {len(standbys) + 1} engine(s) one at a time in {total_ms} ms; "
            f"{new} is the primary"
        )
        self.events.record(EventKind.ROLLOUT, sentence, group=group, step="done", primary=new, total_ms=total_ms)
        return sentence, self.steps

    async def _roll(self, primary: MemberView, standbys: list[MemberView]) -> str:
        """The standbys, the switchover, the old primary; the new primary's id."""
        for standby in standbys:
            await self._step(self._restart(standby.id, primary.id), member=standby.id)
        new = await self._step(self._switch(), member=primary.id)
        await self._step(self._restart(primary.id, new), member=primary.id)
        return new

    async def _revert(self, previous: Generation) -> str:
        """A model update failed before any engine of the new generation served: engines start on ``previous``
        again, the new generation's standbys are stopped (the loop restarts them on it) and its daemon is retired
        once no engine maps it. What was done."""
        group = self.progress.group
        abandoned = self.cluster.weights[group].current.number
        self.cluster.revert_generation(group, previous)
        moved = [m.spec.id for m in self.cluster.members.values()
                 if m.spec.group == group and m.generation == abandoned and m.process and m.process.alive]  # fmt: skip
        for member_id in moved:
            await self.cluster.stop_engine(member_id)
        stopped = f"stopped {', '.join(moved)} to restart on it" if moved else "no engine ran it"
        message = (
            f"reverted group {group} to generation {previous.number} ({previous.model_dir}): no engine of generation "
            f"{abandoned} had served; {stopped}"
        )
        self.events.record(EventKind.ROLLOUT, message, group=group, step="reverted", generation=previous.number)
        return message

    async def _step(self, action: Awaitable[tuple[str, str, dict[str, Any]]], member: str) -> str:
        """Advance the progress, run ``action`` (which returns the next primary's id, a sentence and its
        timings), record it; a failure is recorded as the abort and raised again."""
        self.progress.step += 1
        where = f"step {self.progress.step} of {len(self.progress.plan)} ({self.progress.plan[self.progress.step - 1]})"
        started = time.monotonic()
        try:
            primary, sentence, timings = await action
        except StepFailed as exc:
            message = f"rollout of group {self.progress.group} aborted at {where}: {exc}"
            self.events.record(
                EventKind.ROLLOUT, message, group=self.progress.group, member=member, step="aborted",
                index=self.progress.step, of=len(self.progress.plan), total_ms=ms(time.monotonic() - started),
            )  # fmt: skip
            raise StepFailed(message) from None
        log.info("group %d: rollout %s: %s", self.progress.group, where, sentence)
        report = {"step": self.progress.plan[self.progress.step - 1], "member": member, "message": sentence} | timings
        self.steps.append(report)
        self.events.record(
            EventKind.ROLLOUT, f"{where}: {sentence}", group=self.progress.group, member=member,
            step=report["step"].split()[0], index=self.progress.step, of=len(self.progress.plan), **timings,
        )  # fmt: skip
        return primary

    async def _restart(self, member_id: str, primary_id: str) -> tuple[str, str, dict[str, Any]]:
        """Stop the standby gracefully, start it again, wait until it is a ready standby."""
        start = time.monotonic()
        old = self.cluster.members[member_id].process
        how = await self.cluster.stop_engine(member_id)
        if old is not None and old.alive:
            raise StepFailed(f"{member_id} (pid {old.pid}) {how}")
        stop_ms = ms(time.monotonic() - start)
        process = await self.cluster.start_engine(member_id)
        await self._wait_ready(member_id, primary_id)
        ready_ms = ms(time.monotonic() - start) - stop_ms
        sentence = f"restarted {member_id} (pid {old.pid if old else None} -> {process.pid}), ready in {ready_ms} ms"
        timings = {"stop_ms": stop_ms, "ready_ms": ready_ms, "total_ms": ms(time.monotonic() - start)}
        return primary_id, sentence, timings

    async def _wait_ready(self, member_id: str, primary_id: str) -> None:
        """Until ``member_id`` is a ready standby; StepFailed when it exits, when its start timeout passes, or
        when the primary fails meanwhile (the loop must be free to fail over)."""
        timeout = self.cluster.members[member_id].start_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            snap = self.cluster.snapshot()
            view, primary = snap.member(member_id), snap.member(primary_id)
            if view is None or primary is None:
                raise StepFailed(f"{member_id if view is None else primary_id} was removed meanwhile")
            if view.is_ready_standby:
                return
            if not view.alive:
                raise StepFailed(f"{member_id} (pid {view.pid}) {view.exit_reason} before it was ready")
            if primary.role != Role.PRIMARY or (reason := self.is_failed(primary)):
                why = "is no longer the primary" if primary.role != Role.PRIMARY else reason
                raise StepFailed(f"primary {primary_id} {why} while {member_id} restarted")
            if time.monotonic() > deadline:
                raise StepFailed(f"{member_id} was not a ready standby within its start timeout ({timeout:g} s)")
            await asyncio.sleep(READY_POLL_S)

    async def _load(self, model: Path, primary_id: str) -> tuple[str, str, dict[str, Any]]:
        """Start the next generation's daemon on ``model`` and wait until it serves; then engines start on it.
        A daemon that does not serve is stopped and forgotten (nothing restarted yet)."""
        start, group = time.monotonic(), self.progress.group
        service = self.cluster.add_generation(group, model)
        service.keeper = asyncio.create_task(self.cluster.start_service(service.id), name=f"start-{service.id}")
        try:
            await service.keeper
        except ServiceFailed as exc:
            await self.cluster.remove_service(service.id)
            raise StepFailed(f"the daemon for {model} did not serve: {exc}") from None
        assert service.generation is not None and service.process is not None
        self.cluster.switch_generation(group, service.generation)
        fill = await self.cluster.fill_report(service.id)
        sentence = f"{service.id} (pid {service.process.pid}) serves {model}{filled(fill)}"
        timings = {"total_ms": ms(time.monotonic() - start), "generation": service.generation.number}
        return primary_id, sentence, timings

    async def _retire(self, primary_id: str) -> tuple[str, str, dict[str, Any]]:
        start = time.monotonic()
        sentence = await self.retire() or "no daemon of an older generation was left"
        return primary_id, sentence, {"total_ms": ms(time.monotonic() - start)}

    async def _switch(self) -> tuple[str, str, dict[str, Any]]:
        start = time.monotonic()
        new = await self.switchover()
        return new, f"switched over to {new}", {"total_ms": ms(time.monotonic() - start)}
