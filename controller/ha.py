"""The HA loop (policy): every cycle decides from one snapshot and returns one sentence.

For each failover group, a cycle takes the first decision that applies, in the order and by the rules of
``controller.decide`` (the pure decision core): a failed primary, a queued REST intent, engine slots to fence or
(re)start, a group without a primary. This module carries the decisions out; a REST intent's action is in
``controller.intents``.

The decision's action runs in the background, one at a time per group (``GroupExecutor``): while a
group's action runs, the loop says so and leaves that group alone, but keeps deciding for the
others, so a long drain in one group never delays a failover in another. A failed action holds its
group back with exponential backoff (REST intents excepted: each is one request). Daemons and the
gateway are (re)started by their own background keepers (``controller.keepers``), with tenacity backoff.

Otherwise the sentence is "no action: ...". The loop logs a sentence when it differs from the
previous one. It sleeps ``health.interval_ms`` between cycles unless woken: by a supervised
process exiting (pidfd, immediate), by a health verdict changing, by a REST intent, or by an action
finishing. REST handlers never act: they queue an intent and wait for the loop's answer, so the
mutations of a group are serialised and never interleave with its failover. Failover fences the
old primary (SIGKILL, wait for its exit) before promoting, so two engines never answer 200 on
``/primary`` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hotweights.contract import Endpoint, Role
from hotweights.controller.cluster import SERVICE_START_TIMEOUT_S, Cluster
from hotweights.controller.dcs import Solo
from hotweights.controller.decide import (
    AskServing,
    AskStranger,
    Elect,
    FailOver,
    FailoverFacts,
    FailoverOutcome,
    FailoverResult,
    FenceOld,
    GiveUp,
    Intent,
    Promote,
    Promotion,
    ResolveSplitBrain,
    SlotRestarts,
    Stop,
    TendSlots,
    Wait,
    best_standby,
    failed_at,
    failed_primary,
    failover_sentence,
    keep_in_split_brain,
    missing_primary,
    next_failover_step,
    plan_slots,
)
from hotweights.controller.engineapi import EngineApi, EngineUnreachable
from hotweights.controller.events import EventLog
from hotweights.controller.executor import GroupExecutor, Outcome
from hotweights.controller.graywatch import GrayWatch
from hotweights.controller.health import checks_failed, not_ready_within, process_exited, process_stopped
from hotweights.controller.intents import Actions, Conflict, LoopSteps, Refused, Unavailable, check_group, member_of
from hotweights.controller.keepers import ServiceKeepers
from hotweights.controller.metrics import ControllerMetrics
from hotweights.controller.redundancy import Tracker, assess
from hotweights.controller.rollout import RolloutProgress, rollout_wait_s
from hotweights.controller.snapshot import UNKNOWN_STATE, MemberView, Snapshot, Status
from hotweights.controller.spares import is_spare
from hotweights.controller.startfailures import StartFailures
from hotweights.controller.supervisor import FENCE_TIMEOUT_S, STOPPED_FOR_S
from hotweights.eventkinds import EventKind, FailoverKind
from hotweights.stats import ms

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0  # how long stop() lets a cycle in progress finish


@dataclass
class Queued:
    """A REST intent waiting for the loop, and the future its requester awaits."""

    intent: Intent
    group: int
    params: dict[str, Any]
    future: asyncio.Future


class Ha:
    def __init__(
        self,
        cluster: Cluster,
        engines: EngineApi,
        events: EventLog,
        metrics: ControllerMetrics,
        wake: asyncio.Event,
        on_ready: Callable[[Snapshot], None],
        leadership: Solo | None = None,
        on_give_up: Callable[[GiveUp], None] | None = None,
    ) -> None:
        """``on_give_up``: what ends the stack when a slot keeps failing to start the same way
        (``controller.startfailures``; None: retry for ever)."""
        health = cluster.config.health
        self.leadership = leadership or Solo()  # who may promote: this loop alone, or the holder of a leader key
        self.cluster = cluster
        self.engines = engines
        self.events = events
        self.metrics = metrics
        self.wake = wake
        self.on_ready = on_ready
        self.interval_s = health.interval_ms / 1000
        self.check_timeout_s = health.timeout_ms / 1000
        self.gray = GrayWatch(cluster, engines, events, metrics, self.wakeup, health)  # canaries, slow primaries
        failed = process_exited() | process_stopped(STOPPED_FOR_S) | checks_failed(health.failure_threshold)
        failed |= not_ready_within()
        self.is_failed = failed | self.gray.wrong_output()
        self.executor = GroupExecutor(self.wakeup)
        self.intents: deque[Queued] = deque()
        self.rollouts: dict[int, RolloutProgress] = {}  # per group: the rollout queued or running
        self.restarts: dict[str, SlotRestarts] = {}  # the start backoff of each engine slot
        self.heartbeat = time.monotonic()
        self.redundancy = Tracker(health.redundancy_alert_s)
        self.announced = False
        self.stopping = False
        self.task: asyncio.Task | None = None
        self.failures = StartFailures(cluster, events, on_give_up)
        self.keepers = ServiceKeepers(cluster, events, metrics, self.wakeup, lambda: self.stopping, self.failures)
        steps = LoopSteps(
            self.best_standby, self.promote, self.failover, self.answering_primary, self.restart_slot,
            self.keepers.keep, self.retire, self.is_failed, self.restarts, self.rollouts,
        )  # fmt: skip
        actions = Actions(cluster, events, metrics, engines, steps)
        self.actions: dict[Intent, Callable[..., Awaitable[tuple[str, dict[str, Any]]]]] = {
            Intent.SWITCHOVER: actions.do_switchover,
            Intent.FAILOVER: actions.do_failover,
            Intent.DRAIN: actions.do_drain,
            Intent.PROMOTE: actions.do_promote,
            Intent.ADD: actions.do_add,
            Intent.DELETE: actions.do_delete,
            Intent.RESTART_CACHE: actions.do_restart_cache,
            Intent.ROLLOUT: actions.do_rollout,
        }

    # --- the loop -----------------------------------------------------------------------------

    def wakeup(self) -> None:
        self.wake.set()

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name="ha-loop")
        self.gray.start()

    async def stop(self) -> None:
        """Stop deciding; let the actions in progress finish (a failover half done is worse than a late
        exit) for up to STOP_TIMEOUT_S, then cancel the rest and the services' keepers."""
        self.stopping = True
        self.wakeup()
        if self.task is not None:
            await self.task
        await self.gray.stop()
        for what in await self.executor.stop(STOP_TIMEOUT_S):
            log.warning("cancelled %s: it did not finish within %g s of the stop", what, STOP_TIMEOUT_S)
        for intent in self.intents:
            if not intent.future.done():
                intent.future.set_exception(Unavailable("the controller is shutting down"))

    async def run(self) -> None:
        last = ""
        while not self.stopping:
            self.wake.clear()
            try:
                sentence = await self.run_cycle()
            except Exception:
                log.exception("unexpected error in the HA cycle")
                sentence = "caught an unexpected error in the HA cycle; report it as a BUG"
            self.heartbeat = time.monotonic()
            if sentence != last:
                log.info(sentence)
                last = sentence
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.interval_s)

    async def run_cycle(self) -> str:
        snap = self.cluster.snapshot()
        self._export_gauges(snap)
        self._observe_redundancy(snap)
        sentences = [sentence] if (sentence := self.keepers.process(snap)) else []
        steps = (
            self.process_failed_primary,
            self.process_intent,
            self.process_degraded,
            self.process_members,
            self.process_missing_primary,
            self.process_retiring,
        )
        busy = False
        for group in range(snap.groups):
            settled = False
            if what := self.executor.busy(group):
                sentences.append(f"group {group}: {what} in progress")
                busy = True
            else:
                for step in steps:
                    if sentence := await step(snap, group):
                        sentences.append(sentence)
                        break
                else:
                    if held := self.executor.backing_off(group):
                        sentences.append(f"group {group}: {held}")
                    self.cluster.tend_spare(snap, group)
                    self.cluster.tend_daemon_spare(group)
                    settled = self._is_settled(snap, group)
            self.cluster.batch.tend(group, settled)
        if sentences:
            return "; ".join(sentences)
        if not busy and not self.announced and self._is_complete(snap):
            self.announced = True
            self.on_ready(snap)
        return "no action: " + "; ".join(self._describe(snap, group) for group in range(snap.groups))

    # --- 1. failed primaries --------------------------------------------------------------------

    async def process_failed_primary(self, snap: Snapshot, group: int) -> str | None:
        decision = failed_primary(snap.primaries(group), self.is_failed)
        for stale in decision.stale:  # the live one serves, the dead one restarts as a standby
            self.cluster.set_role(stale, Role.STANDBY)
        match decision.action:
            case ResolveSplitBrain(live):
                what = f"resolving {len(live)} primaries"
                return self.executor.run(group, what, self.resolve_split_brain(group, live))
            case FailOver(old, reason) if not self.executor.backing_off(group, EventKind.FAILOVER):
                what = f"failing over from {old.id} ({reason})"
                return self.executor.run(group, what, self._failover(snap, group, old, reason), kind=EventKind.FAILOVER)
        return None

    async def _failover(self, snap: Snapshot, group: int, old: MemberView, reason: str) -> Outcome:
        result = await self.failover(snap, group, old, reason, FailoverKind.AUTOMATIC)
        return Outcome(result.sentence, result.ok)

    async def failover(
        self,
        snap: Snapshot,
        group: int,
        old: MemberView | None,
        reason: str,
        kind: FailoverKind,
        candidate: MemberView | None = None,
    ) -> FailoverResult:
        """Fail over from ``old`` to ``candidate`` (or the best ready standby) one step at a time, each step
        ``decide.next_failover_step``'s (fence, ask, promote), until it stops; then restart ``old``'s slot.

        Durations run from the failure (``decide.failed_at``): the exit (pidfd) or the first failed health check;
        for a forced failover, from the request."""
        now = time.monotonic()
        started = failed_at(old, kind, now)
        timings = {"detect_ms": ms(now - started), "fence_ms": 0.0}
        if old is not None:
            self.events.record(EventKind.DETECT, f"primary {old.id} {reason}", member=old.id, group=group, **timings)
            self.cluster.wake_gateways()  # they stop sending it requests before their next probe
        facts = FailoverFacts(group, old, candidate or self.best_standby(snap, group))
        while not isinstance(step := next_failover_step(facts), Stop):
            facts = await self._failover_step(snap, step, facts, timings)
        if step.release:  # no standby here: another host's may take over now
            self.events.record(EventKind.NO_STANDBY, f"group {group} has no ready standby to promote", group=group)
            await self.leadership.release(group)
        new = facts.candidate.id if facts.candidate and step.outcome == FailoverOutcome.PROMOTED else None
        if new is not None:
            timings["total_ms"] = ms(time.monotonic() - started)
            self.metrics.failovers.labels(str(group), kind).inc()
            self.metrics.failover_duration.labels(kind).observe(timings["total_ms"] / 1000)
        sentence = failover_sentence(step.outcome, facts, reason, timings, FENCE_TIMEOUT_S)
        old_id = old.id if old else None
        if new is not None:
            self.events.record(EventKind.FAILOVER, sentence, group=group, mode=kind, old=old_id, new=new, **timings)
        if step.restart_old and old is not None:
            sentence += f"; {await self.restart_slot(snap, old.id)}"
        return FailoverResult(sentence, step.outcome, group, kind, old_id, new, timings if new else {})

    async def _failover_step(
        self, snap: Snapshot, step: FenceOld | AskStranger | AskServing | Promote, facts: FailoverFacts, timings: dict
    ) -> FailoverFacts:
        """Carry out one step of a failover, record it, and return the facts with what it found."""
        match step:
            case FenceOld(old):
                fence_start = time.monotonic()
                if not await self.cluster.fence(old.id, until_exit=False):
                    failed = f"{old.id} still alive after SIGKILL"
                    self.events.record(EventKind.FENCE_FAILED, failed, member=old.id, group=facts.group)
                    return replace(facts, fenced=False)
                timings["fence_ms"] = ms(time.monotonic() - fence_start)
                fenced = f"fenced {old.id} (pid {old.pid})"
                self.events.record(EventKind.FENCE, fenced, member=old.id, group=facts.group, **timings)
                return replace(facts, fenced=True)
            case AskStranger(old):
                if stranger := await self._stranger_answers(old):
                    unknown = f"{old.url} answers /primary 200 from a process we do not supervise"
                    self.events.record(EventKind.STRANGER, unknown, member=old.id, group=facts.group)
                return replace(facts, stranger=stranger)
            case AskServing(group):
                return replace(facts, serving=tuple(await self.answering_primary(snap, group)))
            case _:
                promotion = await self.promote(step.candidate)
                timings["promote_ms"] = promotion.ms
                return replace(facts, promotion=promotion)

    async def resolve_split_brain(self, group: int, live: Sequence[MemberView]) -> Outcome:
        """Keep one (``keep_in_split_brain``); fence the others (they restart as standbys)."""
        keep = keep_in_split_brain(live)
        fenced = [m.id for m in live if m is not keep]
        for member_id in fenced:
            await self.cluster.fence(member_id)
        message = f"group {group} had {len(live)} primaries; kept {keep.id}, fenced {', '.join(fenced)}"
        self.events.record(EventKind.SPLIT_BRAIN, message, group=group, kept=keep.id, fenced=fenced)
        return Outcome(message)

    def best_standby(self, snap: Snapshot, group: int) -> MemberView | None:
        """``decide.best_standby`` of the group, by its weight generations."""
        weights = self.cluster.weights[group]
        return best_standby(snap.group(group), weights.current.number, weights.served)

    async def promote(self, candidate: MemberView) -> Promotion:
        """POST /promote, then confirm /primary answers 200; returns the ``Promotion``."""
        start = time.monotonic()
        claim, refusal = await self.leadership.claim(candidate.group, candidate.id, candidate.url)
        if refusal is not None:
            return Promotion(False, ms(time.monotonic() - start), refusal)
        try:
            status, body = await self.engines.post(candidate.url, Endpoint.PROMOTE, claim)
        except EngineUnreachable as exc:
            return Promotion(False, ms(time.monotonic() - start), await self._fence_unconfirmed(candidate, str(exc)))
        message = str(body.get("message", ""))
        if status != 200:
            return Promotion(False, ms(time.monotonic() - start), f"{status}: {message}")
        # Where a promotion's time goes: the POST as we saw it, the engine's own part of it, the confirmation.
        parts = {"post_ms": ms(time.monotonic() - start), "engine_ms": body.get("duration_ms")}
        if not await self.engines.is_primary(candidate.url):
            failed = "promoted, but /primary does not answer 200"
            return Promotion(False, ms(time.monotonic() - start), await self._fence_unconfirmed(candidate, failed))
        self.cluster.set_role(candidate.id, Role.PRIMARY)
        self.cluster.mark_served(candidate.group, candidate.id)
        # Failovers that failed before (no standby to promote, say) were about an earlier primary: this one's
        # failure is a new one, to be failed over at once, not after their backoff.
        self.executor.clear(candidate.group, EventKind.FAILOVER)
        self.cluster.wake_gateways()
        promote_ms = ms(time.monotonic() - start)
        self.events.record(
            EventKind.PROMOTE, f"promoted {candidate.id}: {message}", member=candidate.id, group=candidate.group,
            promote_ms=promote_ms, **parts,
        )  # fmt: skip
        return Promotion(True, promote_ms, message)

    async def _fence_unconfirmed(self, candidate: MemberView, failure: str) -> str:
        """A promotion we could not confirm may still take effect (or already has, unseen): fence the
        candidate, so that promoting another engine, or resuming the old primary, never makes two."""
        if await self.cluster.fence(candidate.id):
            self.events.record(
                EventKind.FENCE, f"{candidate.id}: {failure}", member=candidate.id, group=candidate.group
            )
            return f"{failure}; fenced {candidate.id}"
        return f"{failure}; {candidate.id} is still alive after SIGKILL"

    async def _stranger_answers(self, old: MemberView) -> bool:
        """After ``old`` was fenced: does a process we do not supervise answer /primary on its port? While
        ``old`` is still exiting it may hold the port, and a request there would wait for its exit:
        then any other process listening on the port counts."""
        process = self.cluster.members[old.id].process
        if process is not None and process.alive:
            return await self.cluster.others_listen(old.id)
        return await self.engines.is_primary(old.url, self.check_timeout_s)

    async def answering_primary(self, snap: Snapshot, group: int) -> list[str]:
        """Members of ``group`` (absent ones too: a stranger may hold a slot's port) answering /primary 200."""
        return [m.id for m in snap.group(group) if await self.engines.is_primary(m.url, self.check_timeout_s)]

    async def restart_slot(self, snap: Snapshot, member_id: str) -> str:
        group = self.cluster.members[member_id].spec.group
        if not snap.daemons_serve(group):
            return f"{member_id} restarts once the cache daemons of group {group} serve"
        return f"started replacement standby {await self._start_standby(member_id)}"

    async def _start_standby(self, member_id: str) -> str:
        """Start the slot's engine (from the group's spare when it waits for this slot), record it; "ID (pid N)"."""
        process = await self.cluster.start_engine(member_id)
        spare = is_spare(process)
        started = f"{member_id} (pid {process.pid}{', its spare' if spare else ''})"
        self.events.record(EventKind.ENGINE_START, f"started standby {started}", member=member_id, spare=spare)
        return started

    # --- 2. REST intents ------------------------------------------------------------------------

    async def request(self, intent: Intent, timeout: float, **params: Any) -> dict[str, Any]:
        """Queue an intent for the loop and wait for its outcome (raises Refused: NotFound at once for an
        unknown engine or group)."""
        group = self._intent_group(self.cluster.snapshot(), params)
        future = asyncio.get_running_loop().create_future()
        self.intents.append(Queued(intent, group, params, future))
        self.wakeup()
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise Unavailable(f"the controller did not finish {intent} within {timeout:g} s; see GET /events") from None

    def _intent_group(self, snap: Snapshot, params: dict[str, Any]) -> int:
        """The group an intent acts on: its engine's (``engine_id``, ``candidate``), else ``group`` (default 0)."""
        member_id = params.get("engine_id") or params.get("candidate")
        if member_id is not None:
            return member_of(snap, member_id).group
        group = params.get("group")
        group = 0 if group is None else group
        check_group(snap, group)
        return group

    async def process_intent(self, snap: Snapshot, group: int) -> str | None:
        """Start the group's oldest queued intent (one its requester still waits for) in the background."""
        for queued in list(self.intents):
            if queued.future.done():  # the requester gave up before we got to it
                self.intents.remove(queued)
            elif queued.group == group:
                self.intents.remove(queued)
                return self.executor.run(group, f"{queued.intent} (requested)", self._carry_out(snap, queued))
        return None

    async def _carry_out(self, snap: Snapshot, queued: Queued) -> Outcome:
        future = queued.future
        try:
            sentence, result = await self.actions[queued.intent](snap, **queued.params)
        except Refused as exc:
            if not future.done():
                future.set_exception(exc)
            return Outcome(f"refused {queued.intent}: {exc}")
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            raise
        if not future.done():
            future.set_result({"message": sentence} | result)
        return Outcome(sentence)

    async def rollout(self, group: int | None, switchover_wait_s: float, model: str | None = None) -> dict[str, Any]:
        """POST /rollout: Conflict while a rollout of the group is queued or runs, else queued as an intent and
        awaited for as long as restarting every engine of the group may take (NotFound: unknown group). With
        ``model``, a model update (``controller.rollout``), awaited for a daemon's start longer."""
        snap = self.cluster.snapshot()
        group = 0 if group is None else group
        check_group(snap, group)
        if running := self.rollouts.get(group):
            raise Conflict(f"a rollout of group {group} is already running ({running.describe()}); see GET /cluster")
        progress = self.rollouts[group] = RolloutProgress(group)
        try:
            wait_s = rollout_wait_s(snap.group(group), switchover_wait_s) + (SERVICE_START_TIMEOUT_S if model else 0)
            return await self.request(Intent.ROLLOUT, wait_s, group=group, model=model)
        finally:
            if not progress.started:  # withdrawn before it began; once begun, do_rollout ends it
                self.rollouts.pop(group, None)

    async def process_degraded(self, snap: Snapshot, group: int) -> str | None:
        """A primary much slower than its best and than a standby (``controller.graywatch``): a planned switchover."""
        if self.executor.backing_off(group, EventKind.DEGRADED) or (switch := self.gray.degraded(snap, group)) is None:
            return None
        what = f"switching over from slow primary {switch.old.id} to {switch.new.id}"
        done = self.gray.switch_over(snap, switch, self.actions[Intent.SWITCHOVER])
        return self.executor.run(group, what, done, kind=EventKind.DEGRADED)

    # --- 3. engine slots -----------------------------------------------------------------------

    async def process_members(self, snap: Snapshot, group: int) -> str | None:
        """``decide.plan_slots`` for the group: record the exits it saw first, keep the backoffs, tend the slots."""
        plan = plan_slots(snap.group(group), self.restarts, time.monotonic(), snap.daemons_serve(group), self.is_failed)
        self.restarts.update(plan.restarts)
        for view in snap.group(group):
            if view.status == Status.HEALTHY:
                self.failures.started(view.id)
        for seen in plan.exits:
            view = seen.member
            self.events.record(
                EventKind.EXIT, f"standby {view.id} {view.exit_reason}; restarting in {seen.delay_s:.1f} s",
                member=view.id, group=view.group,
            )  # fmt: skip
            if not view.health.ever_ok:  # it never started: a start that failed (``controller.startfailures``)
                spec = self.cluster.members[view.id].spec
                self.failures.engine_exited(view, spec.host, spec.listen_port)
        tend = plan.tend
        if tend is None or self.executor.backing_off(group, "members"):
            return None
        fence = [f"fencing standby {v.id} ({why})" for v, why in tend.fence]
        what = ", ".join(fence + [f"starting {v.id}" for v in tend.start])
        return self.executor.run(group, what, self._tend(tend), kind="members")

    async def _tend(self, tend: TendSlots) -> Outcome:
        done, ok = [], True
        for view, reason in tend.fence:
            if not view.health.ever_ok:  # alike at every start without its last check's error (refused, timed out, 503)
                self.failures.fenced(view.id, reason.removesuffix(f" ({view.health.error})"))
            if await self.cluster.fence(view.id):
                self.events.record(EventKind.FENCE, f"standby {view.id} {reason}", member=view.id, group=view.group)
                done.append(f"fenced standby {view.id} ({reason})")
            else:
                done.append(f"standby {view.id} ({reason}) is still alive {FENCE_TIMEOUT_S:g} s after SIGKILL")
                ok = False
        for view in tend.start:
            done.append(f"started standby {await self._start_standby(view.id)}")
        return Outcome("; ".join(done), ok)

    # --- 4. a group without a primary -------------------------------------------------------------

    async def process_missing_primary(self, snap: Snapshot, group: int) -> str | None:
        members = snap.group(group)
        refusal = self.leadership.refusal(group)
        match missing_primary(group, members, refusal, self.best_standby(snap, group)):
            case Wait(sentence):
                return sentence
            case Elect(candidate) if not self.executor.backing_off(group, EventKind.ELECT):
                what = f"electing {candidate.id}"
                return self.executor.run(group, what, self._elect(snap, group, candidate), kind=EventKind.ELECT)
        return None

    async def _elect(self, snap: Snapshot, group: int, candidate: MemberView) -> Outcome:
        # a primary our checks have not seen (yet): never add a second one
        if serving := await self.answering_primary(snap, group):
            return Outcome(f"group {group}: {serving} answer /primary 200; waiting for their health checks", False)
        promoted, promote_ms, message = await self.promote(candidate)
        if not promoted:
            return Outcome(f"group {group} has no primary: promoting {candidate.id} failed ({message})", False)
        self.events.record(EventKind.ELECT, f"group {group} had no primary: promoted {candidate.id}", group=group)
        return Outcome(f"group {group} had no primary: promoted ready standby {candidate.id} in {promote_ms} ms")

    # --- 5. daemons of an older weight generation --------------------------------------------------

    async def process_retiring(self, snap: Snapshot, group: int) -> str | None:
        """Stop the daemon of an older generation once no engine maps its arena (a model update's leftovers)."""
        if not self.cluster.retiring_daemons(group):
            return None
        return self.executor.run(group, "retiring an older weight generation", self._retire_outcome(group))

    async def _retire_outcome(self, group: int) -> Outcome:
        return Outcome(await self.retire(group) or "nothing to retire")

    async def retire(self, group: int) -> str:
        """Stop and forget every daemon of the group that ``Cluster.retiring_daemons`` names; the sentence."""
        done = []
        for service_id in self.cluster.retiring_daemons(group):
            self.keepers.forget(service_id)
            how = await self.cluster.remove_service(service_id)
            message = f"{service_id}: no engine maps its generation any more; {how}"
            self.events.record(EventKind.RETIRE, message, service=service_id, group=group)
            done.append(f"retired {service_id} ({how})")
        return "; ".join(done)

    # --- reporting -----------------------------------------------------------------------------

    def _describe(self, snap: Snapshot, group: int) -> str:
        primary = next(iter(snap.primaries(group)), None)
        standbys = sum(m.is_ready_standby for m in snap.group(group))
        if primary is None:
            return f"group {group} has no primary"
        what = "healthy" if primary.is_serving_primary else f"{primary.state or UNKNOWN_STATE} ({primary.status})"
        return f"primary {primary.id} {what}, {standbys} standby(s) ready"

    def _is_settled(self, snap: Snapshot, group: int) -> bool:
        """Whether ``group`` needs nothing now (its batch engine may serve): whole, its daemons serving, no
        rollout queued, and no spare engine still preparing (a warming-up spare allocates device memory)."""
        settled = group not in self.rollouts and snap.daemons_serve(group) and snap.is_whole(group)
        return settled and not self.cluster.spares.preparing(group)

    def _is_complete(self, snap: Snapshot) -> bool:
        return all(s.serving for s in snap.services) and all(snap.is_whole(g) for g in range(snap.groups))

    def _observe_redundancy(self, snap: Snapshot) -> None:
        """Assess every group's redundancy (``controller.redundancy``); record what changed, export the gauges."""
        spares = self.cluster.spares
        states = [
            assess(snap, g, self.cluster.spares_wanted(g), spares.ready_count(g), spares.failure(g))
            for g in range(snap.groups)
        ]
        for change in self.redundancy.observe(snap.taken_at, states):
            restored = change.kind == EventKind.REDUNDANCY_RESTORED
            log.log(logging.INFO if restored else logging.WARNING, "%s", change.message)
            self.events.record(
                change.kind, change.message, group=change.group, degraded_ms=ms(change.degraded_s), **change.details
            )
            if restored:
                self.metrics.time_to_redundancy.observe(change.degraded_s)
        for state in states:
            self.metrics.export_redundancy(
                state, self.redundancy.degraded(state.group), self.redundancy.alerting(state.group)
            )

    def _export_gauges(self, snap: Snapshot) -> None:
        counts = {Role.PRIMARY: 0, Role.STANDBY: 0, "none": 0}
        for member in snap.members:
            counts[member.role if member.alive else "none"] += 1
        for role, count in counts.items():
            self.metrics.members.labels(role).set(count)
