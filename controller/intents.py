"""The REST intents' actions: what the HA loop does for a switchover, a forced failover, a drain, a promotion, an
engine added or deleted, a cache daemon restarted, and a rollout or model update.

``Ha`` queues each intent and runs its action here, one at a time per group, in its group's executor; the
actions use the loop's own failover, promotion and slot restarts, which the loop hands over as ``LoopSteps``
(no reference back to the loop). Each returns the loop's sentence and the JSON the request answers with, or
raises a ``Refused`` whose class gives the HTTP status.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from hotweights.contract import Endpoint, Role
from hotweights.controller.checks import arena_bytes
from hotweights.controller.cluster import Cluster
from hotweights.controller.config import load_config, rollout_changes
from hotweights.controller.decide import FailoverResult, Footprint, Promotion, SlotRestarts, room_refusal
from hotweights.controller.devices import free_bytes
from hotweights.controller.engineapi import EngineApi, EngineUnreachable
from hotweights.controller.events import EventLog
from hotweights.controller.metrics import ControllerMetrics
from hotweights.controller.rollout import Rollout, RolloutProgress, StepFailed
from hotweights.controller.snapshot import UNKNOWN_STATE, MemberView, Snapshot
from hotweights.engines import Engine
from hotweights.errors import ConfigError, HotweightsError
from hotweights.eventkinds import EventKind, FailoverKind
from hotweights.proctree import device_bytes_of, tree_rss_bytes
from hotweights.stats import ms
from hotweights.tokenizer import load_tokenizer, stop_token_ids

POST_MARGIN_S = 10.0  # an engine's answer to a role change may come this long after the wait it was given


class Refused(Exception):
    """A request the loop will not carry out; the message says why and what to do instead."""


class NotFound(Refused):
    """No such engine or group."""


class NotPossible(Refused):
    """The cluster is not in a state that allows it (e.g. the candidate is not a ready standby)."""


class Conflict(Refused):
    """It clashes with the current roles, or an engine refused the role change."""


class Unavailable(Refused):
    """An engine did not answer, or the loop did not finish in time."""


def member_of(snap: Snapshot, member_id: str) -> MemberView:
    member = snap.member(member_id)
    if member is None:
        known = ", ".join(m.id for m in snap.members)
        raise NotFound(f"no engine {member_id!r}; known: {known}")
    return member


def check_group(snap: Snapshot, group: int) -> None:
    if not 0 <= group < snap.groups:
        raise NotFound(f"no group {group}; this cluster has groups 0..{snap.groups - 1}")


def ready_standby(snap: Snapshot, member_id: str) -> MemberView:
    member = member_of(snap, member_id)
    if not member.is_ready_standby:
        ready = [m.id for m in snap.group(member.group) if m.is_ready_standby]
        raise NotPossible(
            f"{member.id} is not a ready standby (role {member.role}, state {member.state or UNKNOWN_STATE}, status "
            f"{member.status}); ready standbys of group {member.group}: {', '.join(ready) or 'none'}"
        )
    return member


@dataclass(frozen=True)
class LoopSteps:
    """What the intents' actions use of the HA loop, handed over by the loop: its steps, and the state of its
    own they change (the loop owns both; the actions hold no reference back to it)."""

    best_standby: Callable[[Snapshot, int], MemberView | None]
    promote: Callable[[MemberView], Awaitable[Promotion]]
    failover: Callable[..., Awaitable[FailoverResult]]
    answering_primary: Callable[[Snapshot, int], Awaitable[list[str]]]
    restart_slot: Callable[[Snapshot, str], Awaitable[str]]
    keep_service: Callable[[str], Awaitable[None]]  # a cache daemon's keeper: respawned with backoff until it serves
    retire: Callable[[int], Awaitable[str]]  # a model update's old weight generation, once no engine uses it
    is_failed: Callable[[MemberView], str | None]
    restarts: dict[str, SlotRestarts]  # the start backoff of each engine slot
    rollouts: dict[int, RolloutProgress]  # per group: the rollout queued or running


class Actions:
    """The intents' actions, on the loop's cluster, events, metrics and engine API, with its ``LoopSteps``."""

    def __init__(
        self, cluster: Cluster, events: EventLog, metrics: ControllerMetrics, engines: EngineApi, loop: LoopSteps
    ) -> None:
        self.cluster = cluster
        self.events = events
        self.metrics = metrics
        self.engines = engines
        self.loop = loop

    async def _resume(self, old: MemberView, drain_s: float) -> str:
        """Undo a drain of ``old`` (a drained primary resumes serving); says what happened."""
        try:
            status, body = await self._post(old, Endpoint.PROMOTE, drain_s)
        except Unavailable as exc:
            status, body = 0, {"message": str(exc)}
        if status == 200:
            self.cluster.set_role(old.id, Role.PRIMARY)
            return f"{old.id} resumed serving"
        return (
            f"{old.id} did not resume ({body.get('message')}) and may stay drained: "
            f"POST /engines/{old.id}/promote resumes it"
        )

    async def do_switchover(
        self, snap: Snapshot, group: int | None = None, candidate: str | None = None, drain_s: float | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Planned: drain the primary (for ``drain_s``, default the engines' drain timeout), promote the candidate,
        demote the old primary to standby (the group's batch engine yields first). The streams the gateway cuts from
        the draining primary go on on the new one from the old one's KV cache, which its demote hands over
        (``standby.kvshare``), as after a failover."""
        if candidate is not None:
            new = ready_standby(snap, candidate)
            if group is not None and group != new.group:
                raise NotPossible(f"candidate {new.id} is in group {new.group}, not {group}")
            group = new.group
        group = 0 if group is None else group
        check_group(snap, group)
        old = next((p for p in snap.primaries(group) if p.is_serving_primary), None)
        if old is None:
            raise NotPossible(f"group {group} has no serving primary to switch over from; use POST /failover")
        if candidate is None:
            new = self.loop.best_standby(snap, group)
            if new is None:
                raise NotPossible(f"group {group} has no ready standby to switch over to")
        # The new primary's KV cache is allocated while the old one still holds its own.
        await self.cluster.batch.make_room(group, f"a switchover from {old.id} to {new.id}")
        drain_s = self.drain_timeout_s() if drain_s is None else drain_s
        start = time.monotonic()
        try:
            status, body = await self._post(old, Endpoint.DRAIN, drain_s, {"timeout_s": drain_s})
        except Unavailable as exc:  # it may have drained part way: undo that too
            raise Unavailable(f"{exc}; {await self._resume(old, drain_s)}") from None
        drain_ms = ms(time.monotonic() - start)
        if status != 200:
            raise Conflict(f"{old.id} refused to drain: {body.get('message')}; {await self._resume(old, drain_s)}")
        promoted, promote_ms, message = await self.loop.promote(new)
        if not promoted:
            # The candidate may have taken the role unseen: resume the old primary only once it is gone.
            if not await self.cluster.fence(new.id):
                raise Conflict(
                    f"promoting {new.id} failed ({message}) and it is still alive after SIGKILL; {old.id} stays "
                    f"drained so that the two never both serve: POST /engines/{old.id}/promote resumes it"
                )
            raise Conflict(f"promoting {new.id} failed ({message}); {await self._resume(old, drain_s)}")
        demote_start = time.monotonic()
        try:
            status, body = await self._post(old, Endpoint.DEMOTE, drain_s, {"timeout_s": drain_s})
        except Unavailable as exc:
            status, body = 0, {"message": str(exc)}
        if status == 200:
            self.cluster.set_role(old.id, Role.STANDBY)
        else:  # still a (drained) primary: fence it rather than keep two primaries around
            await self.cluster.fence(old.id)
        handed_over = body.get("kv_slots_handed_over", 0) if status == 200 else 0
        timings = {
            "drain_ms": drain_ms,
            "promote_ms": promote_ms,
            "demote_ms": ms(time.monotonic() - demote_start),
            "total_ms": ms(time.monotonic() - start),
        }
        self.metrics.failovers.labels(str(group), FailoverKind.SWITCHOVER).inc()
        self.metrics.failover_duration.labels(FailoverKind.SWITCHOVER).observe(timings["total_ms"] / 1000)
        sentence = (
            f"switched over group {group} from {old.id} to {new.id} in {timings['total_ms']} ms "
            f"(drain {drain_ms} ms, promote {promote_ms} ms); {old.id} "
            + ("is a standby" if status == 200 else f"refused to demote ({body.get('message')}) and was fenced")
            + (f", having handed the KV cache of {handed_over} cut request(s) over" if handed_over else "")
        )
        details = {"group": group, "old_primary": old.id, "new_primary": new.id, "kv_slots_handed_over": handed_over}
        self.events.record(
            EventKind.SWITCHOVER,
            sentence,
            group=group,
            old=old.id,
            new=new.id,
            kv_slots_handed_over=handed_over,
            **timings,
        )
        return sentence, details | timings

    async def do_failover(self, snap: Snapshot, candidate: str) -> tuple[str, dict[str, Any]]:
        """Forced: fence the primary whatever its state, promote ``candidate``."""
        new = ready_standby(snap, candidate)
        primaries = snap.primaries(new.group)
        result = await self.loop.failover(
            snap, new.group, primaries[0] if primaries else None, "failover requested", FailoverKind.FORCED, new
        )
        if not result.ok:
            raise Unavailable(result.sentence)
        return result.sentence, result.to_json()

    async def do_drain(self, snap: Snapshot, engine_id: str, timeout_s: float | None = None) -> tuple[str, dict]:
        member = member_of(snap, engine_id)
        wait_s = self.drain_timeout_s() if timeout_s is None else timeout_s
        status, body = await self._post(member, Endpoint.DRAIN, wait_s, {"timeout_s": wait_s})
        if status != 200:
            raise Conflict(f"{member.id} refused to drain: {body.get('message')}")
        sentence = f"drained {member.id}: {body.get('message')}"
        self.events.record(
            EventKind.DRAIN, sentence, member=member.id, group=member.group, duration_ms=body.get("duration_ms")
        )
        return sentence, body | {"message": sentence}  # the engine's own message does not name it

    async def do_promote(self, snap: Snapshot, engine_id: str) -> tuple[str, dict]:
        """A primary: resume (if drained); a standby: only when its group has no live primary."""
        member = member_of(snap, engine_id)
        if member.role == Role.PRIMARY:
            status, body = await self._post(member, Endpoint.PROMOTE, self.drain_timeout_s())
            if status != 200:
                raise Conflict(f"{member.id} refused: {body.get('message')}")
            return f"{member.id}: {body.get('message')}", body
        live = [p.id for p in snap.primaries(member.group) if p.alive]
        if live:
            raise Conflict(f"group {member.group} already has primary {live[0]}; use POST /switchover to move the role")
        member = ready_standby(snap, engine_id)
        if serving := await self.loop.answering_primary(snap, member.group):  # a primary our checks have not seen
            raise Conflict(f"{serving} answer /primary 200 in group {member.group}; use POST /switchover")
        promoted, promote_ms, message = await self.loop.promote(member)
        if not promoted:
            raise Unavailable(f"promoting {member.id} failed: {message}")
        return f"promoted {member.id} on request in {promote_ms} ms", {"member": member.id, "promote_ms": promote_ms}

    async def do_add(self, snap: Snapshot, group: int = 0) -> tuple[str, dict]:
        check_group(snap, group)
        limit = self.cluster.config.groups[group].max_engines
        if len(snap.group(group)) >= limit:
            raise Conflict(f"group {group} has {len(snap.group(group))} engines, its max_engines is {limit}")
        if refusal := await asyncio.to_thread(self.room_refusal, snap, group):
            raise Conflict(refusal)
        member = self.cluster.add_engine(group)
        started = await self.loop.restart_slot(snap, member.spec.id)
        sentence = f"added standby {member.spec.id} on port {member.spec.port}: {started}"
        self.events.record(EventKind.ADD, sentence, member=member.spec.id, group=group)
        return sentence, {"id": member.spec.id, "group": group, "port": member.spec.port, "url": member.spec.url}

    def room_refusal(self, snap: Snapshot, group: int) -> str | None:
        """Why one more engine does not fit beside the group's running ones (``decide.room_refusal``)."""
        pids = [m.pid for m in snap.group(group) if m.alive and m.pid is not None]
        hosts = [b for b in map(tree_rss_bytes, pids) if b is not None]
        device = self.cluster.config.groups[group].device
        on_gpu = device.startswith("cuda")
        need = Footprint(max(hosts, default=None), device_bytes_of(pids) if on_gpu else None)
        return room_refusal(group, device, need, free_bytes("cpu"), free_bytes(device) if on_gpu else None)

    async def do_delete(self, snap: Snapshot, engine_id: str) -> tuple[str, dict]:
        member = member_of(snap, engine_id)
        if member.role == Role.PRIMARY and member.alive:
            raise Conflict(f"{member.id} is the primary of group {member.group}; switch over first")
        how = await self.cluster.stop_engine(member.id)
        process = self.cluster.members[member.id].process
        if process is not None and process.alive:  # forgetting the slot would leave it running unsupervised
            raise Unavailable(f"{member.id} (pid {process.pid}) {how}; its slot is kept")
        self.cluster.remove_engine(member.id)
        self.loop.restarts.pop(member.id, None)
        sentence = f"removed {member.id}: {how}"
        self.events.record(EventKind.DELETE, sentence, member=member.id, group=member.group)
        return sentence, {"id": member.id}

    async def do_restart_cache(self, snap: Snapshot, group: int) -> tuple[str, dict]:
        """Stop the daemon gracefully and respawn it (re-adopting the arena from an engine, else a snapshot, else
        the disk); engines keep their mappings."""
        check_group(snap, group)
        sentences = []
        for service_id in snap.daemon_ids(group):  # one per rank in a tensor-parallel group
            how = await self.cluster.stop_service(service_id)
            self.cluster.respawn(service_id, partial(self.loop.keep_service, service_id))
            sentences.append(f"restarting cache daemon {service_id}: old one {how}; engines keep serving")
            self.events.record(EventKind.CACHE_RESTART, sentences[-1], service=service_id, group=group)
        return "; ".join(sentences), {"service": snap.daemon(group).id}

    async def do_rollout(self, snap: Snapshot, group: int, model: str | None = None) -> tuple[str, dict[str, Any]]:
        """Restart every engine of ``group`` one at a time with cluster.toml's current engine settings (see
        ``controller.rollout``), onto ``model``'s weights if given. NotPossible before anything restarts: no
        serving primary, no ready standby, a cluster.toml that is invalid or changes more than engine settings,
        or a ``model`` that is invalid or does not fit; Unavailable: a step failed."""
        progress = self.loop.rollouts.setdefault(group, RolloutProgress(group))
        progress.started = True
        try:
            new_model = await asyncio.to_thread(self._model_preconditions, group, model) if model else None
            primary, changed = self._rollout_preconditions(snap, group)
            standbys = [m for m in snap.group(group) if m.id != primary.id]
            rollout = Rollout(
                self.cluster, self.events, progress, self.loop.is_failed, partial(self._rollout_switch, group),
                partial(self.loop.retire, group),
            )  # fmt: skip
            try:
                sentence, steps = await rollout.run(primary, standbys, new_model)
            except StepFailed as exc:
                raise Unavailable(f"{exc}; the group keeps serving") from None
        finally:
            if self.loop.rollouts.get(group) is progress:
                del self.loop.rollouts[group]
        applied = f"; applied {', '.join(changed)}" if changed else ""
        return sentence + applied, {"group": group, "steps": steps, "changed": changed}

    def _model_preconditions(self, group: int, model: str) -> Path:
        """``model`` as the group's next weight generation: a valid checkpoint for the group's load settings, with a
        tokenizer the engines can read, not the one it runs, whose arena fits in the device's free memory beside the
        current one. NotPossible naming the reason (the numbers, for memory), before anything starts. It waits for a
        checking process (``controller.checks``): run it off the event loop, as ``do_rollout`` does."""
        section, current = self.cluster.config.groups[group], self.cluster.weights[group].current
        if section.engine == Engine.VLLM or section.tp_size != 1:
            raise NotPossible(
                f"group {group}: a model update needs reference or SGLang engines with tp_size 1, found engine "
                f"{section.engine!r} with tp_size {section.tp_size}; nothing restarted"
            )
        path = Path(model).expanduser().resolve()
        try:
            need = arena_bytes(path, self.cluster.layout.load_spec(group))
            load_tokenizer(path)  # what every engine reads beside the weights: a bad one would fail every start
            stop_token_ids(path)
        except HotweightsError as exc:
            raise NotPossible(f"model {model}: {exc}; nothing restarted") from None
        if path == current.model_dir:
            raise NotPossible(f"group {group} runs {path} already (generation {current.number}); nothing restarted")
        free = free_bytes(section.device)
        if free is not None and need > free:
            raise NotPossible(
                f"group {group}: the new generation's arena needs {need} bytes on {section.device}, beside the current "
                f"one's, and {free} are free; stop standbys first to free their memory (DELETE /engines/<id>) and "
                "roll with fewer, or free the device; nothing restarted"
            )
        return path

    def _rollout_preconditions(self, snap: Snapshot, group: int) -> tuple[MemberView, list[str]]:
        """The serving primary and the engine settings that changed; cluster.toml's settings are taken on.
        NotPossible (nothing restarted) when a precondition does not hold."""
        try:
            config = load_config(self.cluster.layout.config_path)
            changed = rollout_changes(self.cluster.config, config)
        except ConfigError as exc:
            raise NotPossible(f"{exc}; nothing restarted") from None
        primary = next((p for p in snap.primaries(group) if p.is_serving_primary), None)
        if primary is None:
            raise NotPossible(f"group {group} has no serving primary; nothing restarted")
        if self.loop.best_standby(snap, group) is None:
            raise NotPossible(f"group {group} has no ready standby to switch over to; nothing restarted")
        self.cluster.reconfigure(config)
        return primary, changed

    async def _rollout_switch(self, group: int) -> str:
        """A rollout's switchover (the planned one): the new primary's id, or StepFailed with the refusal."""
        try:
            _, result = await self.do_switchover(self.cluster.snapshot(), group)
        except Refused as exc:
            raise StepFailed(str(exc)) from None
        return result["new_primary"]

    def drain_timeout_s(self) -> float:
        """The engines' drain timeout now; an action reads it once, at its start, so a rollout that changes it
        (``Cluster.reconfigure``) never changes an action of another group in flight."""
        return self.cluster.config.engine.drain_timeout_s

    async def _post(
        self, member: MemberView, path: str, wait_s: float, body: dict | None = None
    ) -> tuple[int, dict[str, Any]]:
        """POST to an engine that may take ``wait_s`` to answer (a drain's); Unavailable when it does not answer."""
        try:
            return await self.engines.post(member.url, path, body, timeout=wait_s + POST_MARGIN_S)
        except EngineUnreachable as exc:
            raise Unavailable(str(exc)) from None
