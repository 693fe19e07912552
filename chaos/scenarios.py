"""The faults a drill injects, one class each: what to hurt, how, and what to undo afterwards.

A round is: the cluster is whole -> ``inject`` -> ``settle`` (the part of the fault that takes time:
holding a process stopped, restarting what the drill itself runs) -> the drill waits until the
cluster is whole again -> ``cleanup`` (always, also when the round failed or was interrupted) ->
``verify`` (a scenario's own pass condition). Every target is picked from ``GET /cluster`` at the
start of the round and hit through a pidfd checked against its start time.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import httpx

from hotweights.chaos.faults import Target, descendant_titled, is_alive, netem_unavailable, send
from hotweights.chaos.load import BatchClient
from hotweights.contract import Endpoint, State
from hotweights.engines import KINDS, Engine
from hotweights.standby.progress import FREEZE_SIGNAL

if TYPE_CHECKING:
    from hotweights.chaos.clusterview import ClusterView, ControlApi
    from hotweights.chaos.stack import DrillStack

HANG_S = 2.0  # how long hang-daemon keeps the daemon stopped
SLOW_DELAY_S = 0.5  # slow-primary's added latency each way: twice the default health timeout
FENCE_WAIT_S = 15.0
FLAP_KILLS = 3
STORM_FAULTS = 10  # storm's faults per round
STORM_INTERVAL_S = 3.0  # between a storm's faults: it does not wait for the group to recover in between
STORM_SIGNALS = (signal.SIGKILL, signal.SIGSTOP)  # a storm's faults cycle through these


@dataclass
class Round:
    """What a scenario acts on and what it leaves for the measurements."""

    stack: DrillStack
    api: ControlApi
    view: ClusterView  # the cluster just before the fault
    fault_at: float = 0.0  # time.time() of the first injected fault
    later_faults: list[float] = field(default_factory=list)  # time.time() of every fault after the first
    targets: list[Target] = field(default_factory=list)
    problem: str = ""  # set when the fault did not go as the scenario promises (fails the round)

    def hit(self, target: Target | None, sig: signal.Signals) -> Target:
        if target is None:
            raise RuntimeError("the process to hurt was not found in GET /cluster")
        if not self.fault_at:
            self.fault_at = time.time()
        else:
            self.later_faults.append(time.time())
        send(target, sig)
        self.targets.append(target)
        return target

    def primary(self) -> Target | None:
        primaries = self.view.primaries()
        return self.view.target(primaries[0]["id"]) if primaries else None

    def standby(self) -> Target | None:
        standbys = self.view.ready_standbys()
        return self.view.target(standbys[0]["id"]) if standbys else None


async def wait_dead(target: Target, timeout_s: float = FENCE_WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while is_alive(target):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


class Scenario:
    name: ClassVar[str]
    measures: ClassVar[str]  # one line for the report
    needs_proxy: ClassVar[bool] = False
    needs_batch: ClassVar[bool] = False  # the drill's own stack then gets a co-located batch engine
    client_errors_expected: ClassVar[bool] = False  # the fault takes the load balancer itself down
    # the faults hit a re-sent request on engine after engine, as a request of death would: the gateway may
    # refuse it as suspect (gateway.suspect_after), which the drill counts apart and accepts
    suspects_expected: ClassVar[bool] = False
    respawns_daemon: ClassVar[bool] = False

    def skip_reason(self, stack: DrillStack) -> str | None:
        return None

    async def inject(self, r: Round) -> None:
        raise NotImplementedError

    async def settle(self, r: Round) -> None:
        """The fault's own duration; by default the fault is instant."""

    async def cleanup(self, r: Round) -> None:
        """Undo what the drill did (resume a stopped process, clear a delay); runs however the round ended."""

    def verify(self, r: Round, after: ClusterView) -> str | None:
        """None, or why the scenario's own promise was broken."""
        return None


class SignalPrimary(Scenario):
    sig: ClassVar[signal.Signals]

    async def inject(self, r: Round) -> None:
        r.hit(r.primary(), self.sig)


class KillPrimary(SignalPrimary):
    name = "kill-primary"
    measures = "SIGKILL the primary: exit detection (pidfd), fence, promotion, LB convergence"
    sig = signal.SIGKILL


class TermPrimary(SignalPrimary):
    name = "term-primary"
    measures = "SIGTERM the primary: it stops listening and exits cleanly; the same failover must follow"
    sig = signal.SIGTERM


class Stops(Scenario):
    """A scenario that SIGSTOPs its target: the round settles when the stopped process was fenced, and every
    target gets SIGCONT afterwards."""

    not_fenced = "the stopped process was not fenced"

    async def settle(self, r: Round) -> None:
        if not await wait_dead(r.targets[0]):
            r.problem = self.not_fenced

    async def cleanup(self, r: Round) -> None:
        for target in r.targets:
            send(target, signal.SIGCONT)


class HangPrimary(Stops):
    name = "hang-primary"
    measures = "SIGSTOP the primary: detection of a stopped process (50 ms stopped), fence of a stopped process"
    not_fenced = "the stopped primary was not fenced"

    async def inject(self, r: Round) -> None:
        r.hit(r.primary(), signal.SIGSTOP)


class StallPrimary(Scenario):
    name = "stall-primary"
    measures = (
        f"{FREEZE_SIGNAL.name} freezes the primary's inference thread (vLLM's or SGLang's engine core: SIGSTOP) while "
        "its HTTP server answers: its progress check reports it unhealthy, then failover (fence, promote; in-flight "
        "requests re-sent or continued)"
    )

    async def inject(self, r: Round) -> None:
        primary, engine = r.primary(), r.stack.config.groups[0].engine
        if engine == Engine.REFERENCE or primary is None:
            r.hit(primary, FREEZE_SIGNAL)
            return
        core = descendant_titled(primary.pid, KINDS[engine].core_title)  # under the agent, its guard, its engine
        r.hit(None if core is None else Target.of(primary.name, core), signal.SIGSTOP)

    async def settle(self, r: Round) -> None:
        if not await wait_dead(r.targets[0]):
            r.problem = "the stalled primary was not fenced"

    async def cleanup(self, r: Round) -> None:
        for target in r.targets:  # a frozen thread cannot be thawed: one left unfenced (or an engine core) ends here
            send(target, signal.SIGKILL)


class SlowPrimary(Scenario):
    name = "slow-primary"
    measures = f"+{SLOW_DELAY_S * 1000:g} ms each way through the fault proxy: timeouts detect it, then failover"
    needs_proxy = True

    def skip_reason(self, stack: DrillStack) -> str | None:
        return None if stack.proxy_map else "engines are not behind fault proxies (--attach-running)"

    async def inject(self, r: Round) -> None:
        primary = r.primary()
        if primary is None:
            raise RuntimeError("no primary in GET /cluster")
        self.port = next(m["port"] for m in r.view.members if m["id"] == primary.name)
        r.fault_at = time.time()
        r.targets.append(primary)
        r.stack.set_delay(self.port, SLOW_DELAY_S)

    async def settle(self, r: Round) -> None:
        if not await wait_dead(r.targets[0]):
            r.problem = "the slow primary was not fenced"
        r.stack.set_delay(self.port, 0.0)  # its replacement standby must start on a healthy port

    async def cleanup(self, r: Round) -> None:
        if r.targets:
            r.stack.set_delay(self.port, 0.0)


class SlowPrimaryNetem(Scenario):
    name = "slow-primary-netem"
    measures = "packet delay with tc netem on the primary's traffic"

    def skip_reason(self, stack: DrillStack) -> str | None:
        if reason := netem_unavailable():
            return f"tc netem is not available here: {reason}"
        return (
            "netem works here, but the controller starts engines in the host network namespace: delaying "
            "their loopback traffic would delay every program on lo (the fault proxy variant runs instead)"
        )


class KillStandby(Scenario):
    name = "kill-standby"
    measures = "SIGKILL a standby: serving must not notice; the controller restarts the slot"

    async def inject(self, r: Round) -> None:
        r.hit(r.standby(), signal.SIGKILL)


class KillDaemon(Scenario):
    name = "kill-daemon"
    measures = "SIGKILL the cache daemon: engines keep serving from the arena; the respawn re-adopts it from one"
    respawns_daemon = True

    async def inject(self, r: Round) -> None:
        r.hit(r.view.target(r.view.service("daemon")["id"]), signal.SIGKILL)


class HangDaemon(Scenario):
    name = "hang-daemon"
    measures = f"SIGSTOP the cache daemon for {HANG_S:g} s: serving must not notice"

    async def inject(self, r: Round) -> None:
        r.hit(r.view.target(r.view.service("daemon")["id"]), signal.SIGSTOP)

    async def settle(self, r: Round) -> None:
        await asyncio.sleep(HANG_S)
        send(r.targets[0], signal.SIGCONT)

    async def cleanup(self, r: Round) -> None:
        for target in r.targets:
            send(target, signal.SIGCONT)


class KillDaemonThenPrimary(Scenario):
    name = "kill-daemon-then-primary"
    measures = "SIGKILL the daemon, then the primary: promotion must not need the daemon"
    respawns_daemon = True

    async def inject(self, r: Round) -> None:
        primary = r.primary()
        r.hit(r.view.target(r.view.service("daemon")["id"]), signal.SIGKILL)
        r.hit(primary, signal.SIGKILL)


class RankScenario(Scenario):
    """A fault on the last rank of a tensor-parallel group (rank 0 is the engine itself: ``kill-primary``)."""

    def skip_reason(self, stack: DrillStack) -> str | None:
        return None if stack.config.groups[0].tp_size > 1 else "the stack's engines have one rank (tp_size = 1)"

    async def primary_rank(self, r: Round) -> Target | None:
        """The primary's last rank, from the rank pids its health page lists."""
        primaries = r.view.primaries()
        if not primaries:
            return None
        async with httpx.AsyncClient(timeout=2.0) as client:
            ranks = (await client.get(primaries[0]["url"] + Endpoint.LIVE)).json()["rank_pids"]
        return Target.of(primaries[0]["id"], ranks[-1])  # named as its group, whose events the controller records


class KillRank(RankScenario):
    name = "kill-rank"
    measures = "SIGKILL the last rank of the primary group: its rank 0 exits at once; the group fails over as one"

    async def inject(self, r: Round) -> None:
        r.hit(await self.primary_rank(r), signal.SIGKILL)


class HangRank(RankScenario, Stops):
    name = "hang-rank"
    measures = "SIGSTOP the last rank of the primary group: rank 0 reports it unready; every rank is fenced"
    not_fenced = "the stopped rank was not fenced with its group"

    async def inject(self, r: Round) -> None:
        r.hit(await self.primary_rank(r), signal.SIGSTOP)


class KillRankDaemon(RankScenario):
    name = "kill-rank-daemon"
    measures = "SIGKILL the last rank's cache daemon: every engine keeps serving; the respawn re-adopts that rank"
    respawns_daemon = True

    async def inject(self, r: Round) -> None:
        daemons = [s for s in r.view.services if s["kind"] == "daemon"]
        r.hit(r.view.target(max(daemons, key=lambda s: s["rank"])["id"]), signal.SIGKILL)


class KillController(Scenario):
    name = "kill-controller"
    measures = "SIGKILL the controller for 1 s: serving continues; the restarted controller re-adopts every process"

    async def inject(self, r: Round) -> None:
        r.hit(r.stack.controller_target(), signal.SIGKILL)

    async def settle(self, r: Round) -> None:
        await wait_dead(r.targets[0])
        await asyncio.sleep(1.0)
        r.stack.restart_controller()

    def verify(self, r: Round, after: ClusterView) -> str | None:
        before, now = r.view.engine_pids(), after.engine_pids()
        if before != now:
            return f"engines were restarted instead of adopted: {before} -> {now}"
        return None


class KillLoadBalancer(Scenario):
    name = "kill-gateway"
    measures = (
        "SIGKILL the load balancer (gateway: one worker; its peers keep accepting on the socket the controller "
        "holds, which restarts it): only requests in flight on it may fail"
    )
    client_errors_expected = True

    async def inject(self, r: Round) -> None:
        if r.stack.lb == "haproxy":
            r.hit(r.stack.haproxy_target(), signal.SIGKILL)
        else:
            r.hit(r.view.target(r.view.service("gateway")["id"]), signal.SIGKILL)

    async def settle(self, r: Round) -> None:
        if r.stack.lb == "haproxy":
            await wait_dead(r.targets[0])
            r.stack.start_haproxy()


class DoubleFailure(Scenario):
    name = "double-failure"
    measures = "SIGKILL the primary and a standby at once: the remaining standby is promoted"

    async def inject(self, r: Round) -> None:
        primary, standby = r.primary(), r.standby()
        r.hit(primary, signal.SIGKILL)
        r.hit(standby, signal.SIGKILL)


class Flapping(Scenario):
    name = "flapping"
    measures = f"{FLAP_KILLS} primary kills in quick succession, each as soon as a new primary serves"
    suspects_expected = True

    async def inject(self, r: Round) -> None:
        killed: set[str] = set()
        for _ in range(FLAP_KILLS):
            target = r.primary() if not killed else await serving_primary(r.api, killed)
            if target is None:
                r.problem = f"no new primary appeared after {len(killed)} kill(s)"
                return
            killed.add(f"{target.name}:{target.pid}")
            r.hit(target, signal.SIGKILL)


async def serving_primary(api: ControlApi, not_in: set[str], timeout_s: float = FENCE_WAIT_S) -> Target | None:
    """The serving primary (healthy and ready) once there is one that is none of ``not_in`` (``id:pid``), or None
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = await api.cluster()
        if view is not None:
            serving = [m for m in view.primaries() if m["status"] == "healthy" and m["state"] == State.READY]
            if serving and f"{serving[0]['id']}:{serving[0]['pid']}" not in not_in:
                target = view.target(serving[0]["id"])
                if target is not None:
                    return target
        await asyncio.sleep(0.01)
    return None


async def fault_storm(
    api: ControlApi,
    faults: int,
    interval_s: float,
    signals: tuple[signal.Signals, ...],
    hit: Callable[[Target, signal.Signals], object],
) -> str:
    """``faults`` faults of whichever engine serves as primary, ``interval_s`` apart on a fixed schedule (a fault
    whose primary is not serving yet waits for it), signals cycling through ``signals``; ``hit`` sends each. "" when
    every fault was sent, else why not."""
    hurt: set[str] = set()
    start = time.monotonic()
    for i in range(faults):
        await asyncio.sleep(max(0.0, start + i * interval_s - time.monotonic()))
        target = await serving_primary(api, hurt)
        if target is None:
            return f"no serving primary {FENCE_WAIT_S:g} s after fault {i} of {faults}"
        hurt.add(f"{target.name}:{target.pid}")
        hit(target, signals[i % len(signals)])
    return ""


class Storm(Scenario):
    name = "storm"
    measures = (
        f"{STORM_FAULTS} faults of the primary {STORM_INTERVAL_S:g} s apart (SIGKILL and SIGSTOP alternating) "
        "without waiting for recovery in between: every fault's outage, the time to full redundancy after the last"
    )

    def __init__(self, faults: int = STORM_FAULTS, interval_s: float = STORM_INTERVAL_S) -> None:
        self.faults, self.interval_s = faults, interval_s

    async def inject(self, r: Round) -> None:
        r.problem = await fault_storm(r.api, self.faults, self.interval_s, STORM_SIGNALS, r.hit)

    async def settle(self, r: Round) -> None:
        for target in r.targets:
            if not await wait_dead(target):
                r.problem = r.problem or f"the stopped primary {target.name} (pid {target.pid}) was not fenced"

    async def cleanup(self, r: Round) -> None:
        for target in r.targets:
            send(target, signal.SIGCONT)


class PreemptBatch(Scenario):
    """The primary of a group with a batch engine is killed: the batch engine must yield before the replacement
    standby starts and serve again once the group is settled. Its own client (a request at a time, none of the
    drill's load) must get answers or 503 with ``Retry-After`` throughout, never a hang or a refused connection."""

    name = "preempt-batch"
    measures = (
        "SIGKILL the primary beside a co-located batch engine: it yields for the replacement standby and is back "
        "once the group settled (batch_back); its clients get 503 with Retry-After meanwhile, never a hang"
    )
    needs_batch = True

    def __init__(self) -> None:
        self.client: BatchClient | None = None  # this round's
        self.asking = contextlib.AsyncExitStack()

    def skip_reason(self, stack: DrillStack) -> str | None:
        return None if stack.batch_url else "needs a group with a batch engine (the drill's own stack has one)"

    async def inject(self, r: Round) -> None:
        assert r.stack.batch_url is not None
        self.client = await self.asking.enter_async_context(BatchClient(r.stack.batch_url).running())
        r.hit(r.primary(), signal.SIGKILL)

    async def cleanup(self, r: Round) -> None:
        await self.asking.aclose()

    def verify(self, r: Round, after: ClusterView) -> str | None:
        before = {b["id"]: b["yields"] for b in r.view.batch}
        if not any(b["yields"] > before.get(b["id"], 0) for b in after.batch):
            return "the batch engine did not yield for the replacement standby"
        answers = self.client.answers if self.client else []
        if not any(a.status == 200 for a in answers):
            return "the batch engine's client got no answer in the round"
        bad = [a.status or a.error for a in answers if not a.ok]
        return f"{len(bad)} batch request(s) neither answered nor refused with Retry-After: {bad[:3]}" if bad else None


class Planned(Scenario):
    """A planned operation through the controller's API under load (``POST path``): no client may notice."""

    path: ClassVar[str]
    timeout_s: ClassVar[float]

    def body(self, r: Round) -> dict[str, object]:
        return {}

    async def inject(self, r: Round) -> None:
        r.fault_at = time.time()
        response = await r.api.post(self.path, self.timeout_s, self.body(r))
        if response.status_code != 200:
            r.problem = f"POST {self.path} answered {response.status_code}: {response.text[:200]}"


class Switchover(Planned):
    name = "switchover"
    measures = "POST /switchover under load: drain, promote, demote; no client may notice"
    path, timeout_s = "/switchover", 60.0


class RollingRestart(Planned):
    name = "rolling-restart"
    measures = "POST /rollout under load: every engine restarted one at a time, standbys first; no client may notice"
    path, timeout_s = Endpoint.ROLLOUT, 600.0


class ModelUpdate(Planned):
    """Rounds alternate the group between its model and the drill's other one (``DrillStack.models``); the load
    takes either model's greedy answer as correct."""

    name = "model-update"
    measures = "POST /rollout with the other model under load: a second weight generation; no client may notice"
    path, timeout_s = Endpoint.ROLLOUT, 900.0
    updates = 0

    def skip_reason(self, stack: DrillStack) -> str | None:
        group = stack.config.groups[0]
        if not stack.owned or group.tp_size > 1 or group.engine != Engine.REFERENCE:
            return "needs the drill's own stack of one-rank reference engines"
        return None if stack.models else "the drill made no second model"

    def body(self, r: Round) -> dict[str, object]:
        self.updates += 1
        return {"model": str(r.stack.models[self.updates % 2])}

    def verify(self, r: Round, after: ClusterView) -> str | None:
        """A batch engine maps the generation the group's primary serves (it restarted onto it)."""
        serving = {m["group"]: m["generation"] for m in after.primaries()}
        stale = [b["id"] for b in after.batch if b["generation"] != serving.get(b["group"])]
        return f"batch engine(s) {stale} still map an older weight generation" if stale else None


SCENARIOS: dict[str, type[Scenario]] = {
    cls.name: cls
    for cls in (
        KillPrimary,
        TermPrimary,
        HangPrimary,
        StallPrimary,
        SlowPrimary,
        SlowPrimaryNetem,
        KillStandby,
        KillDaemon,
        HangDaemon,
        KillDaemonThenPrimary,
        KillRank,
        HangRank,
        KillRankDaemon,
        KillController,
        KillLoadBalancer,
        DoubleFailure,
        Flapping,
        Storm,
        Switchover,
        RollingRestart,
        ModelUpdate,
        PreemptBatch,
    )
}
RANK_SCENARIOS = frozenset(name for name, cls in SCENARIOS.items() if issubclass(cls, RankScenario))  # tp_size > 1
