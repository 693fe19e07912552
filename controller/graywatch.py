"""Gray failures in the controller: each engine's canary asked and judged, slow primaries switched over.

``GrayWatch`` runs beside the HA loop. Every ``health.canary_interval_ms`` (and every second while a primary looks
slow) it sends ``POST /canary`` to every healthy engine of the groups that have it (reference engines of one rank)
at the same time (``standby.canary``: a few greedy tokens of a fixed prompt, computed off the engine's inference
thread) and keeps each engine's latest answer. The answers are judged by ``controller.graydecide.judge_canaries``;
an engine found wrong is recorded (event ``wrong_output``, the metric, the reason) and, through the
``wrong_output`` policy the loop adds to its verdict of failure, fenced: a primary is failed over from, a standby
fenced and started again. The content of its group's weight arena is then checked against the hash recorded at
load (``hotweights cache verify`` in a process of its own, so the controller never maps an arena), and the verdict
recorded (event ``arena_verified``).

Each cycle the loop asks ``degraded`` for every group (``graydecide.degraded_primary`` over the primary's
``/health/ready`` slowness and the standbys' canaries, asked at once while the primary looks slow); a switchover it
returns is made by ``switch_over``: the planned switchover of ``POST /switchover``, drained at once (its streams go
on on the new primary from its KV cache), recorded as event ``degraded`` with the reason, counted in
``hotweights_controller_gray_failures``.

On GPUs, NVML's word feeds the same decisions (``controller.gpuwatch``, looked at every second beside the canary
rounds): a primary on a faulty GPU is fenced through the same policy, where a standby can take over on a sound GPU,
and its arena verified; a primary whose GPU the hardware slowed is switched over by ``degraded`` as a slow one is,
under the same rate bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from prometheus_client import Counter, Gauge

from hotweights.contract import Endpoint
from hotweights.controller.cluster import Cluster
from hotweights.controller.config import HealthSection
from hotweights.controller.engineapi import EngineApi, EngineUnreachable
from hotweights.controller.events import EventLog
from hotweights.controller.executor import Outcome
from hotweights.controller.gpuwatch import LOOK_S, GpuWatch
from hotweights.controller.graydecide import (
    Answer,
    CanaryReading,
    DegradePolicy,
    SlowSpell,
    SwitchAway,
    degraded_primary,
    judge_canaries,
)
from hotweights.controller.health import Policy
from hotweights.controller.intents import Refused
from hotweights.controller.metrics import ControllerMetrics
from hotweights.controller.snapshot import MemberView, Snapshot
from hotweights.engines import Engine
from hotweights.eventkinds import EventKind
from hotweights.spawn import hotweights_command

log = logging.getLogger(__name__)

CANARY_TIMEOUT_S = 2.0  # an engine that has not answered the canary by then is asked again next round
DEGRADED_DRAIN_S = 0.0  # a slow primary's switchover cuts its streams at once: they go on on the new primary
ASK_EVERY_S = 1.0  # while a primary looks slow and no standby confirms it, the canaries are asked this often
VERIFY_TIMEOUT_S = 300.0  # the arena check after a wrong answer (it reads every byte)

Switchover = Callable[..., Awaitable[tuple[str, dict[str, Any]]]]  # ``intents.Actions.do_switchover``


class GrayWatch:
    def __init__(
        self,
        cluster: Cluster,
        engines: EngineApi,
        events: EventLog,
        metrics: ControllerMetrics,
        wake: Callable[[], None],
        health: HealthSection,
    ) -> None:
        self.cluster = cluster
        self.engines = engines
        self.events = events
        self.wake = wake
        self.interval_s = health.canary_interval_ms / 1000
        self.policy = DegradePolicy(health.degraded_factor, health.degraded_for_s, health.degraded_every_s)
        self.readings: dict[str, CanaryReading] = {}  # each engine's latest canary, by id
        self.agreed: dict[str, Answer] = {}  # the canary's answer, by fingerprint
        self.wrong: dict[tuple[str, int], str] = {}  # (engine id, pid) -> why its answers are wrong
        self.spells: dict[int, SlowSpell] = {}  # per group
        self.ask_now = asyncio.Event()
        self.asked_at = 0.0  # time.monotonic() when a slow primary last had the canaries asked at once
        self.tasks: set[asyncio.Task] = set()
        self.failures = Counter(
            "hotweights_controller_gray_failures",
            "Gray failures, by group and kind (degraded: a slow primary switched over; wrong_output: an engine whose "
            "canary answer differs, fenced; gpu_fault, gpu_slowdown: NVML's word on a group's GPU, told)",
            ["group", "kind"],
            registry=metrics.registry,
        )
        self.slowness = Gauge(
            "hotweights_controller_engine_slowness",
            "Each engine's decode steps against their best (its canary's), as last seen",
            ["engine"],
            registry=metrics.registry,
        )
        self.gpus = GpuWatch(cluster.config, events, metrics.registry, self.failures, self.policy)

    # --- the canary rounds --------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn(self.run(), "canary")
        self._spawn(self.watch_gpus(), "gpu-health")

    async def stop(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _spawn(self, work: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self) -> None:
        while True:
            try:
                await self.round(self.cluster.snapshot())
            except Exception:
                log.exception("unexpected error in a canary round; report it as a BUG")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ask_now.wait(), self.interval_s)
            self.ask_now.clear()

    async def round(self, snap: Snapshot) -> None:
        """Ask every healthy engine for the canary at once, keep the answers, judge them."""
        asked = [m for m in snap.members if m.alive and m.health.ok and m.pid is not None and self.has_canary(m.group)]
        for reading in await asyncio.gather(*(self.ask(m) for m in asked)):
            if reading is not None:
                self.readings[reading.member] = reading
                if reading.slowness is not None:
                    self.slowness.labels(reading.member).set(reading.slowness)
        current = {(m.id, m.pid) for m in snap.members if m.alive}
        self.readings = {k: r for k, r in self.readings.items() if (k, r.pid) in current}
        self.wrong = {key: why for key, why in self.wrong.items() if key in current}
        self.judge(snap)

    async def watch_gpus(self) -> None:
        """NVML's looks at the groups' GPUs every LOOK_S and their verdicts (``controller.gpuwatch``); nothing where
        NVML cannot be read."""
        if not await self.gpus.open():
            return
        try:
            while True:
                try:
                    await self.look_at_gpus()
                except Exception:
                    log.exception("unexpected error in a GPU health look; report it as a BUG")
                await asyncio.sleep(LOOK_S)
        finally:
            self.gpus.close()

    async def look_at_gpus(self) -> None:
        await self.gpus.read(time.monotonic())
        fenced = set(self.gpus.fenced)
        switched = {group: spell.last_switch for group, spell in self.spells.items()}
        for member in self.gpus.judge(self.cluster.snapshot(), switched, time.monotonic()):
            self._spawn(self.verify_arena(member, "after a GPU fault"), f"verify-{member.id}")
        if set(self.gpus.fenced) - fenced:
            self.wake()

    def has_canary(self, group: int) -> bool:
        """Whether the group's engines answer the canary: reference engines of one rank."""
        spec = self.cluster.config.groups[group]
        return spec.engine == Engine.REFERENCE and spec.tp_size == 1

    async def ask(self, member: MemberView) -> CanaryReading | None:
        """``member``'s canary; None when it did not answer one (it is judged by its health checks, not here)."""
        at = time.monotonic()
        try:
            status, body = await self.engines.post(member.url, Endpoint.CANARY, timeout=CANARY_TIMEOUT_S)
        except EngineUnreachable:
            return None
        tokens, fingerprint = body.get("tokens"), body.get("fingerprint")
        if status != 200 or not isinstance(tokens, list) or not isinstance(fingerprint, str):
            return None
        slowness = body.get("slowness") if isinstance(body.get("slowness"), dict) else {}
        ratio = slowness.get("ratio") if slowness.get("steps") else None
        ratio = float(ratio) if isinstance(ratio, int | float) else None
        return CanaryReading(member.id, member.pid or 0, fingerprint, tuple(map(int, tokens)), ratio, at)

    def judge(self, snap: Snapshot) -> None:
        verdict = judge_canaries(list(self.readings.values()), self.agreed)
        for fingerprint in verdict.established:
            answer = list(verdict.agreed[fingerprint])
            self.events.record(EventKind.CANARY_AGREED, f"the canary's answer for weights {fingerprint} is {answer}")
        self.agreed = verdict.agreed
        for member_id, reason in verdict.wrong.items():
            key = (member_id, self.readings[member_id].pid)
            if key in self.wrong:
                continue
            self.wrong[key] = reason
            view = next(m for m in snap.members if m.id == member_id)
            log.error("engine %s (pid %d) %s", member_id, key[1], reason)
            self.events.record(
                EventKind.WRONG_OUTPUT, f"{member_id} {reason}", member=member_id, group=view.group, reason=reason
            )
            self.failures.labels(str(view.group), EventKind.WRONG_OUTPUT).inc()
            self._spawn(self.verify_arena(view, f"after {member_id}'s wrong answer"), f"verify-{member_id}")
            self.wake()

    def wrong_output(self) -> Policy:
        """The HA loop's policy: an engine whose canary answer was found wrong has failed (it is fenced)."""
        return wrong_output(self)

    async def verify_arena(self, member: MemberView, after: str) -> None:
        """Check the content of the arena ``member`` maps against its recorded hash (``hotweights cache verify``),
        in a process of its own; the verdict is event ``arena_verified`` (its message says ``after`` what)."""
        socket = self.cluster.layout.socket(member.group, 0, member.generation)
        process = await asyncio.create_subprocess_exec(
            *hotweights_command("cache", "verify", "--socket", str(socket)),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), VERIFY_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            output = f"no verdict within {VERIFY_TIMEOUT_S:g} s".encode()
        lines = output.decode(errors="replace").strip().splitlines()
        verdict = lines[-1] if lines else f"exit code {process.returncode}"
        ok = process.returncode == 0
        self.events.record(
            EventKind.ARENA_VERIFIED, f"the arena of group {member.group} {after}: {verdict}",
            group=member.group, member=member.id, ok=ok,
        )  # fmt: skip
        (log.info if ok else log.error)("arena of group %d: %s", member.group, verdict)

    # --- slow primaries -----------------------------------------------------------------------------

    def degraded(self, snap: Snapshot, group: int) -> SwitchAway | None:
        """The group's switchover away from a slow primary to make now (``graydecide.degraded_primary``, else
        ``GpuWatch.slowed``: its GPU slowed by the hardware); while its primary looks slow and no standby's canary
        confirms it yet, the canaries are asked every ASK_EVERY_S."""
        primary = next((p for p in snap.primaries(group) if p.alive), None)
        standbys = [m for m in snap.group(group) if m.is_ready_standby]
        before, now = self.spells.get(group, SlowSpell()), time.monotonic()
        switch, spell = degraded_primary(primary, standbys, self.readings, before, now, self.policy)
        if switch is None and (switch := self.gpus.slowed(primary, standbys, spell.last_switch, now)) is not None:
            spell = replace(spell, last_switch=now)
        if spell.slow_since is not None and spell.since is None and time.monotonic() - self.asked_at > ASK_EVERY_S:
            self.asked_at = time.monotonic()  # slow, not yet against a standby: ask the standbys now
            self.ask_now.set()
        self.spells[group] = spell
        return switch

    async def switch_over(self, snap: Snapshot, switch: SwitchAway, do_switchover: Switchover) -> Outcome:
        """The planned switchover away from a slow primary (module docstring)."""
        old, group = switch.old, switch.old.group
        self.events.record(EventKind.DEGRADED, f"primary {old.id} {switch.reason}", member=old.id, group=group,
                           reason=switch.reason)  # fmt: skip
        self.failures.labels(str(group), EventKind.DEGRADED).inc()
        try:
            sentence, _ = await do_switchover(snap, group=group, candidate=switch.new.id, drain_s=DEGRADED_DRAIN_S)
        except Refused as exc:
            return Outcome(f"not switching over from slow primary {old.id}: {exc}", False)
        return Outcome(f"primary {old.id} {switch.reason}: {sentence}")


class wrong_output(Policy):  # lower case, like the other policies (``controller.health``)
    """An engine whose canary answer ``GrayWatch`` found wrong (the process that gave it), or a primary to fence for
    its GPU's fault (``GpuWatch.fenced``)."""

    def __init__(self, watch: GrayWatch) -> None:
        self.watch = watch

    def __call__(self, member: MemberView) -> str | None:  # type: ignore[override]
        key = (member.id, member.pid or 0)
        return self.watch.wrong.get(key) or self.watch.gpus.fenced.get(key)
