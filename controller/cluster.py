"""The stack the controller keeps: engine slots, cache daemons and the gateway, their processes and state.

Mechanism only: start, adopt, fence, stop, persist, and one immutable ``Snapshot`` for the HA loop
to decide from. An engine slot (``Member``) keeps its id, group and port for life; the process
behind it comes and goes. ``state.json`` is rewritten after every change, so a restarted controller
adopts the running processes and starts only what is missing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from hotweights.cache.connection import AttachRefused, DaemonUnavailable, hello, request
from hotweights.contract import Role
from hotweights.controller.batch import BatchEngines
from hotweights.controller.config import ClusterConfig, EngineSpec, batch_spec
from hotweights.controller.engineapi import EngineApi
from hotweights.controller.events import EventLog
from hotweights.controller.gatewayworkers import GatewayWorkers
from hotweights.controller.health import HealthChecker
from hotweights.controller.ids import daemon_id, engine_id, engine_slot, spare_engine_id, spare_key
from hotweights.controller.records import read_recorded, state_of
from hotweights.controller.slots import Member, Service, Weights, member_view, service_view, slot_order
from hotweights.controller.snapshot import Snapshot
from hotweights.controller.sockets import remove_dead_offers, remove_dead_sockets, run_dir
from hotweights.controller.spares import Spares
from hotweights.controller.stack import Generation, Layout
from hotweights.controller.statedir import StateWriter
from hotweights.controller.supervisor import (
    Process,
    Supervisor,
    evict_orphans,
    inheritors,
    stack_marker,
    stop_recorded,
)
from hotweights.engines import Engine
from hotweights.ports import is_free
from hotweights.standby.serving import PortUnavailable
from hotweights.state import ServiceKind

log = logging.getLogger(__name__)

SERVICE_START_TIMEOUT_S = 600.0  # a daemon loads the whole model from disk before it serves
PROBE_INTERVAL_S = 0.05
PROBE_TIMEOUT_S = 1.0  # a daemon's hello or the gateway's health page


class ServiceFailed(Exception):
    """A daemon or gateway exited, or never served, after being started."""


class Cluster:
    def __init__(
        self, layout: Layout, checker: HealthChecker, wake: Callable[[], None], engines: EngineApi, events: EventLog
    ) -> None:
        self.layout = layout
        self.config = layout.config
        self.checker = checker
        self.wake = wake
        launcher_dir = run_dir(layout.state_dir) if self.config.cluster.launcher else None  # engines forked there
        self.supervisor = Supervisor(
            layout.log_dir, self.handle_exit, stack_marker(layout.state_dir), launcher_dir, lambda _: self.wake()
        )
        self.state_file = StateWriter(layout.state_file, events.health)  # never raises: kept and retried
        self.run_dir = run_dir(layout.state_dir)  # its sockets
        self.spares = Spares(self.supervisor, wake)
        self.daemon_spares = Spares(self.supervisor, wake)  # one per group, for its current daemon
        self.batch = BatchEngines(
            self.supervisor, engines, events, self._batch_command, self._environment, self._generation_number, self.save
        )
        for group, section in enumerate(self.config.groups):
            if spec := batch_spec(group, section):
                self.batch.add(spec, section.start_timeout(), section.batch_yield_timeout_s)
        self.weights = {group: Weights(layout.first_generation) for group in range(len(self.config.groups))}
        self.members: dict[str, Member] = {}
        self.services: dict[str, Service] = {}
        self.removed: set[str] = set()  # configured engines deleted through the API
        self.gateways = GatewayWorkers(self.config, layout, PROBE_TIMEOUT_S)

    # --- load and persist ---------------------------------------------------------------------

    def load(self, with_gateway: bool) -> list[str]:
        """Build the desired stack from the config and state.json; adopt the recorded processes that
        still run (same pid, start time and command line). Returns one line per adopted process, and
        one per leftover of a corrupt state file that was stopped.

        A role belongs to a process: a slot whose process is gone (a clean stop, a crash of the whole
        stack, a reboot) starts as a standby, so a second start is a start-up, not a failover."""
        state, notes = read_recorded(self.layout)
        self.removed = set(state.removed)
        specs = {spec.id: spec for spec in self.config.engines() if spec.id not in self.removed}
        for member_id, row in state.members.items():
            if row.added and member_id not in self.removed:  # engines added through the API
                specs[member_id] = EngineSpec(member_id, row.group, row.device, row.port, host=self.config.dcs.address)
            elif member_id not in specs and row.process:
                log.warning("%s (pid %s) is no longer in the config: left alone", member_id, row.process.pid)
        for spec in specs.values():
            self.members[spec.id] = Member(spec, start_timeout_s=self.config.groups[spec.group].start_timeout())
        for group, section in enumerate(self.config.groups):
            if (record := state.groups.get(str(group))) and record.generation:
                self.weights[group] = Weights(Generation(record.generation, Path(record.model)), record.served)
            generation = self.weights[group].current
            for rank in range(section.tp_size):
                service_id = daemon_id(group, rank, generation.number)
                self.services[service_id] = Service(service_id, ServiceKind.DAEMON, group, rank, generation=generation)
        recorded_gateways = [name for name, row in state.services.items() if row.kind == ServiceKind.GATEWAY]
        if with_gateway or recorded_gateways:
            for worker_id in dict.fromkeys([*self.config.gateway.worker_ids(), *recorded_gateways]):
                self.services[worker_id] = Service(worker_id, ServiceKind.GATEWAY)
        adopted = []
        for member in self.members.values():
            row = state.members.get(member.spec.id)
            if row and row.process and (process := self.supervisor.adopt(member.spec.id, row.process)):
                self._attach(member, process, row.generation)
                member.role = row.role
                self.supervisor.watch_exiting(process, member.role == Role.PRIMARY)
                # A primary served before we started: judge it by failed checks at once, not by the start-up
                # allowance a fresh engine gets, or an adopted hung primary would hold its group for minutes.
                member.health.ever_ok = member.role == Role.PRIMARY
                adopted.append(f"{member.spec.id} ({member.role}, pid {process.pid})")
        for service in self.services.values():
            row = state.services.get(service.id)
            if row and row.process and (process := self.supervisor.adopt(service.id, row.process)):
                service.process = process
                adopted.append(f"{service.id} (pid {process.pid})")
        batch_ids = {batch.spec.id: group for group, batch in self.batch.batches.items()}
        for name, row in state.services.items():
            if row.kind != ServiceKind.BATCH or name not in batch_ids or not row.process:
                continue
            if process := self.supervisor.adopt(name, row.process):
                self.batch.adopt(batch_ids[name], process, self.weights[batch_ids[name]].current.number)
                adopted.append(f"{name} (pid {process.pid})")
        for service in list(self.services.values()):
            if service.kind == ServiceKind.GATEWAY and not with_gateway and service.process is None:
                del self.services[service.id]  # a dead gateway worker from an earlier `up`: not ours to restart
        # Recorded daemons this stack no longer has (an older weight generation's, after a model update was cut
        # short): running engines keep what they mapped and new ones attach elsewhere, so they are stopped; so are
        # recorded batch engines that the config no longer has.
        ours = {*self.services, *batch_ids}
        self.save()
        stopped = []
        for kind, what in ((ServiceKind.DAEMON, "daemon"), (ServiceKind.BATCH, "batch engine")):
            stale = [(name, row.process) for name, row in state.services.items()
                     if row.kind == kind and row.process and name not in ours]  # fmt: skip
            stopped += [f"{line} (a {what} this stack no longer has)" for line in stop_recorded(stale)]
        return adopted + notes + stopped

    def save(self) -> None:
        """Write state.json (while the state dir fails, kept in memory and written later: ``controller.statedir``)."""
        batches = self.batch.processes()
        self.state_file.save(state_of(self.config, self.members, self.services, batches, self.weights, self.removed))

    def reconfigure(self, config: ClusterConfig) -> None:
        """Take ``config``'s engine settings (a rollout's: nothing else differs, see ``rollout_changes``):
        every engine started from now on runs with them, and is given its group's new start timeout."""
        self.layout = replace(self.layout, config=config)
        self.config = config
        for member in self.members.values():
            member.start_timeout_s = config.groups[member.spec.group].start_timeout()

    # --- the snapshot --------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The cluster now, read-only: taking it changes nothing."""
        now = time.monotonic()
        members = tuple(member_view(m, now) for m in sorted(self.members.values(), key=slot_order))
        current = {group: w.current.number for group, w in self.weights.items()}
        services = tuple(service_view(s, current) for s in self.services.values())
        return Snapshot(now, len(self.config.groups), members, services)

    # --- engines -------------------------------------------------------------------------------

    async def start_engine(self, member_id: str) -> Process:
        """Start the slot's engine as a standby (attached from its group's daemon), first evicting an
        orphan of this slot that a previous controller left listening on its port (off the event loop:
        that waits for the orphan's exit)."""
        member = self.members[member_id]
        await self.batch.make_room(member.spec.group, f"starting {member_id}")
        if member.process is not None and member.process.alive:  # fenced as exiting: its port frees at its exit
            await self.supervisor.fence(member.process)
        if member.process is not None and self._tensor_parallel(member):  # no rank of the old group is left
            await self.supervisor.fence_session(member.process)
        spare_id = spare_engine_id(member.spec.group)
        for message in await asyncio.to_thread(evict_orphans, member.spec.listen_port, member_id, spare_id=spare_id):
            log.warning("%s", message)
        group, generation = member.spec.group, self.weights[member.spec.group].current
        slot = {
            "port": member.spec.listen_port,
            "engine_id": member_id,
            "log": str(self.supervisor.log_path(member_id)),
        }
        spare = self.layout.spare_command(group, generation)
        process = self.spares.take(group, spare_key(group), spare, member_id, slot)
        if process is None:
            command = self.layout.engine_command(member.spec, generation)
            process = self.supervisor.spawn(member_id, command, self.layout.environment(group))
        self._attach(member, process, generation.number)
        self.set_role(member_id, Role.STANDBY)
        return process

    def spares_wanted(self, group: int) -> int:
        """How many spare engines the group keeps: ``spare_engines``, none with ``spare = false`` (reference engines'
        spares warm up, vLLM's and SGLang's agents start their server: ``standby.agentspare``)."""
        config = self.config.groups[group]
        return config.spare_engines if config.spare else 0

    def _batch_command(self, spec: EngineSpec) -> list[str]:
        return self.layout.batch_command(spec, self.weights[spec.group].current)

    def _environment(self, group: int) -> dict[str, str] | None:
        return self.layout.environment(group)

    def _generation_number(self, group: int) -> int:
        return self.weights[group].current.number

    def tend_spare(self, snap: Snapshot, group: int) -> None:
        """Keep the group's ``spares_wanted`` spare engines (``controller.spares``); new ones start only while it
        has one serving primary (not while its engines start, nor between primaries)."""
        command = self.layout.spare_command(group, self.weights[group].current)
        serving = sum(m.is_serving_primary for m in snap.primaries(group)) == 1
        env = self.layout.environment(group)
        self.spares.tend(group, spare_key(group), self.spares_wanted(group), command, env, may_start=serving)

    def keeps_daemon_spare(self, group: int) -> bool:
        """Whether the group keeps a spare daemon: ``spare = true``, one daemon per group, reference engines."""
        config = self.config.groups[group]
        return config.spare and config.tp_size == 1 and config.engine == Engine.REFERENCE

    def daemon_spare_for(self, group: int) -> Service | None:
        """The daemon the group's spare daemon is for now: its serving daemon of the current generation; None
        while it has none, or when the group keeps no spare daemon."""
        if not self.keeps_daemon_spare(group):
            return None
        number = self.weights[group].current.number
        serving = (s for s in self.services.values() if s.kind == ServiceKind.DAEMON and s.group == group and s.serving)
        return next((s for s in serving if self._generation_of(s) == number), None)

    def tend_daemon_spare(self, group: int) -> None:
        """Keep a spare for the group's current daemon while it serves (``daemon_spare_for``): its respawn then
        starts the spare, imports done, instead of a new process. While the daemon is down the spare is left
        alone: the respawn takes it."""
        if not self.keeps_daemon_spare(group):
            self.daemon_spares.tend(group, None, 0, [], None)
            return
        service = self.daemon_spare_for(group)
        if service is not None:
            command = self.layout.daemon_command(group, service.rank, service.generation)
            self.daemon_spares.tend(group, service.id, 1, command, self.layout.environment(group))

    def daemon_spares_json(self) -> list[dict[str, Any]]:
        """For each group that wants a spare daemon now: the daemon it waits to replace, the spare's pid (None: not
        started yet), whether it is ready."""
        wanted = {g: d.id for g in range(len(self.config.groups)) if (d := self.daemon_spare_for(g)) is not None}
        return [{"group": g, "service": d} | self.daemon_spares.describe(g, 1)[0] for g, d in sorted(wanted.items())]

    def generations_json(self) -> list[dict[str, Any]]:
        """Each group's current weight generation: number, checkpoint, whether one of its engines was primary."""
        return [
            {"group": g, "generation": w.current.number, "model": str(w.current.model_dir), "served": w.served}
            for g, w in self.weights.items()
        ]

    def spares_json(self, snap: Snapshot) -> list[dict[str, Any]]:
        """Every spare engine each group has or wants now (``Spares.describe``), with its group."""
        return [
            {"group": g} | spare for g in range(snap.groups) for spare in self.spares.describe(g, self.spares_wanted(g))
        ]

    def _attach(self, member: Member, process: Process, generation: int) -> None:
        member.process, member.generation = process, generation
        member.started_at = time.monotonic()
        member.health = self.checker.track(member.spec.id, member.spec.url, process.pid)

    async def fence(self, member_id: str, *, until_exit: bool = True) -> bool:
        """SIGKILL the slot's engine and wait for its exit; False if it would not die. An orphan of the
        slot that we do not supervise (left by an earlier controller) is evicted too. ``until_exit``
        False: wait only until it is gone (see ``Supervisor.fence``); no orphan can listen on the port
        it still holds, and the slot's next start evicts any before it binds."""
        member = self.members[member_id]
        self.checker.untrack(member_id)
        if until_exit:
            ours = member.process.pid if member.process else None
            port, spare_id = member.spec.listen_port, spare_engine_id(member.spec.group)
            for message in await asyncio.to_thread(evict_orphans, port, member_id, ours=ours, spare_id=spare_id):
                log.warning("%s", message)
        fenced = member.process is None or await self.supervisor.fence(member.process, until_exit=until_exit)
        if fenced and until_exit and member.process is not None and self._tensor_parallel(member):
            fenced = await self.supervisor.fence_session(member.process)  # every rank, not only rank 0
        if fenced:
            self.set_role(member_id, Role.STANDBY)  # if it comes back, it comes back as a standby
        return fenced

    def _tensor_parallel(self, member: Member) -> bool:
        return self.config.groups[member.spec.group].tp_size > 1

    async def stop_engine(self, member_id: str) -> str:
        member = self.members[member_id]
        self.checker.untrack(member_id)
        how = await self.supervisor.stop(member.process) if member.process else "was not running"
        self.save()
        return how

    def set_role(self, member_id: str, role: Role) -> None:
        """Record our role change; a primary's process is watched for the first sign of its exit."""
        member = self.members[member_id]
        member.role, member.role_set_at = role, time.monotonic()
        if member.process is not None:
            self.supervisor.watch_exiting(member.process, role == Role.PRIMARY)
        self.save()

    async def others_listen(self, member_id: str) -> bool:
        """While the slot's process still holds its port (exiting): whether another process could answer
        there, i.e. one that inherited the socket (read from /proc)."""
        member = self.members[member_id]
        assert member.process is not None, "only asked while the slot's process holds its port"
        return bool(await asyncio.to_thread(inheritors, member.spec.listen_port, member.process.pid))

    def add_engine(self, group: int) -> Member:
        """A new standby slot in ``group``: next index, next port that nothing uses or listens on."""
        spec_group = self.config.groups[group]
        indexes = [engine_slot(m.spec.id)[1] for m in self.members.values() if m.spec.group == group]
        index = max(indexes, default=-1) + 1
        while engine_id(group, index) in self.removed:
            index += 1
        taken = {p for m in self.members.values() for p in (m.spec.port, m.spec.listen_port)}
        taken |= {self.config.cluster.port, self.config.gateway.port}
        taken |= {p for spec in self.config.engines() for p in (spec.port, spec.listen_port)}
        port = spec_group.base_port + index
        while port in taken or not is_free(port):
            port += 1
        spec = EngineSpec(engine_id(group, index), group, spec_group.device, port, host=self.config.dcs.address)
        member = Member(spec, start_timeout_s=spec_group.start_timeout())
        self.members[member.spec.id] = member
        self.save()
        return member

    def remove_engine(self, member_id: str) -> None:
        del self.members[member_id]
        if any(spec.id == member_id for spec in self.config.engines()):
            self.removed.add(member_id)
        self.save()

    # --- daemons and the gateway ----------------------------------------------------------------

    def respawn(self, service_id: str, keep: Callable[[], Awaitable[None]]) -> None:
        """Run ``keep`` (the loop's retrying start) as the service's keeper, unless one runs already."""
        service = self.services[service_id]
        if service.keeper is None or service.keeper.done():
            service.keeper = asyncio.create_task(keep(), name=f"keep-{service_id}")

    async def start_service(self, service_id: str) -> None:
        """Spawn the service unless it runs, then wait until it serves. Raises ServiceFailed."""
        service = self.services[service_id]
        spawned = service.process is None or not service.process.alive
        if spawned:
            if service.process is not None:
                service.restarts += 1
            if service.kind == ServiceKind.DAEMON:
                command = self.layout.daemon_command(service.group, service.rank, service.generation)
                env = self.layout.environment(service.group)
                taken = self.daemon_spares.take(service.group, service.id, command, service.id)
                service.process = taken or self.supervisor.spawn(service.id, command, env)
                service.from_spare = taken is not None
            else:
                try:
                    fd = self.gateways.listening().fileno()
                except PortUnavailable as exc:
                    raise ServiceFailed(f"the gateway's port: {exc}") from None
                self.layout.gateway_probe_socket(service.id).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                command = self.layout.gateway_command(service.id, fd)
                service.process = self.supervisor.spawn(service.id, command, pass_fds=(fd,))
            self.save()
        process = service.process
        deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
        while not await self._probe(service):
            if not process.alive:
                when = "before serving" if spawned else "while we waited for its answer"
                raise ServiceFailed(f"{service.id} {process.exit_reason} {when}; see {self._log(service)}")
            if time.monotonic() > deadline:
                await self.supervisor.fence(process)
                raise ServiceFailed(f"{service.id} did not serve within {SERVICE_START_TIMEOUT_S:g} s; killed it")
            await asyncio.sleep(PROBE_INTERVAL_S)
        service.serving = True

    async def fill_report(self, service_id: str) -> dict[str, Any]:
        """How a serving daemon filled its arena (``fill`` of its status: source, seconds, detail); {} when it
        does not say (it died meanwhile, or predates the report)."""
        service = self.services[service_id]
        socket_path = self.layout.socket(service.group, service.rank, self._generation_of(service))
        try:
            reply = await asyncio.to_thread(request, socket_path, {"op": "status"}, PROBE_TIMEOUT_S)
        except (DaemonUnavailable, AttachRefused):
            return {}
        fill = reply.get("status", {}).get("fill") if reply.get("ok") else None
        return fill if isinstance(fill, dict) else {}

    def wake_gateways(self) -> None:
        """Tell every serving gateway worker to probe the engines now (a role just changed)."""
        self.gateways.wake(s.id for s in self.services.values() if s.kind == ServiceKind.GATEWAY and s.serving)

    async def stop_service(self, service_id: str) -> str:
        service = self.services[service_id]
        if service.keeper:
            service.keeper.cancel()
        service.serving = False
        how = await self.supervisor.stop(service.process) if service.process else "was not running"
        self.save()
        return how

    async def probe(self, service_id: str) -> bool:
        """Does the service answer now (a daemon its hello, the gateway its health page), within 1 s?"""
        return await self._probe(self.services[service_id])

    async def fence_service(self, service_id: str) -> bool:
        """SIGKILL a service that stopped answering and wait for its exit; the loop then respawns it."""
        service = self.services[service_id]
        service.serving, service.fencing = False, True
        try:
            return service.process is None or await self.supervisor.fence(service.process)
        finally:
            service.fencing = False

    async def _probe(self, service: Service) -> bool:
        if service.kind == ServiceKind.DAEMON:
            try:
                socket_path = self.layout.socket(service.group, service.rank, self._generation_of(service))
                await asyncio.to_thread(hello, socket_path, PROBE_TIMEOUT_S)
            except (DaemonUnavailable, AttachRefused):
                return False
            return True
        return await self.gateways.answers(service.id)

    @staticmethod
    def _generation_of(service: Service) -> int:
        return service.generation.number if service.generation else 0

    # --- weight generations (model updates) ------------------------------------------------------

    def add_generation(self, group: int, model_dir: Path) -> Service:
        """A daemon for the group's next weight generation (``model_dir``), not started: the loop keeps it
        from now on; engines keep starting on the current generation until ``switch_generation``."""
        number = max(self._generation_of(s) for s in self.services.values() if s.group == group) + 1
        generation = Generation(number, model_dir)
        service = Service(daemon_id(group, 0, number), ServiceKind.DAEMON, group, 0, generation=generation)
        self.services[service.id] = service
        self.save()
        return service

    def switch_generation(self, group: int, generation: Generation) -> None:
        """Engines of ``group`` start on ``generation`` from now on; none of it has been primary yet."""
        self.weights[group] = Weights(generation, served=False)
        self.save()

    def revert_generation(self, group: int, previous: Generation) -> None:
        """Engines of ``group`` start on ``previous`` (which has served) again: a model update that failed before
        its generation served is abandoned."""
        self.weights[group] = Weights(previous, served=True)
        self.save()

    def mark_served(self, group: int, member_id: str) -> None:
        """``member_id`` was promoted: if it runs the current generation, no older one may be promoted again."""
        weights = self.weights[group]
        if not weights.served and self.members[member_id].generation == weights.current.number:
            weights.served = True
            self.save()

    def retiring_daemons(self, group: int) -> list[str]:
        """Daemons of the group's older generations that no live engine maps any more: to stop and remove."""
        current = self.weights[group].current.number
        live = {m.generation for m in self.members.values() if m.spec.group == group and m.process and m.process.alive}
        return [
            s.id
            for s in self.services.values()
            if s.kind == ServiceKind.DAEMON and s.group == group and self._generation_of(s) not in (current, *live)
        ]

    async def remove_service(self, service_id: str) -> str:
        """Stop a daemon that is not its group's current generation's (retired, or a model update's that did not
        serve) and forget it; how it ended."""
        how = await self.stop_service(service_id)
        del self.services[service_id]
        self.save()
        return how

    def _log(self, service: Service) -> str:
        return str(self.layout.log_dir / f"{service.id}.log")

    # --- exits and shutdown ---------------------------------------------------------------------

    def handle_exit(self, process: Process) -> None:
        """Runs on the event loop the instant a watched process ends (or a primary is seen exiting): wake
        the HA loop, then remove the offers of engines that are gone (``controller.sockets``)."""
        service = self.services.get(process.id)
        if service is not None and service.process is process:
            service.serving = False
        self.wake()
        asyncio.get_running_loop().call_soon(remove_dead_offers, self.run_dir)

    async def stop_all(self, timeout: float) -> list[str]:
        """Gateway first (clients see it go, not a half-stack), then all engines at once, then the daemons."""
        for service in self.services.values():
            if service.keeper:
                service.keeper.cancel()
        await self.checker.close()
        spares = [*self.spares.release_all(), *self.daemon_spares.release_all()]
        await asyncio.gather(*(self.supervisor.stop(spare) for spare in spares))
        gateways = [s.id for s in self.services.values() if s.kind == ServiceKind.GATEWAY]
        results = await asyncio.gather(*(self.stop_service(service_id) for service_id in gateways))
        lines = [f"{service_id}: {how}" for service_id, how in zip(gateways, results, strict=True)]
        await self.gateways.close()
        engines = [m for m in self.members.values() if m.process and m.process.alive]
        results, batch = await asyncio.gather(
            asyncio.gather(*(self.supervisor.stop(m.process, timeout) for m in engines)), self.batch.stop_all(timeout)
        )
        lines += [f"{m.spec.id}: {how}" for m, how in zip(engines, results, strict=True)] + batch
        daemons = [s for s in self.services.values() if s.kind == ServiceKind.DAEMON]
        results = await asyncio.gather(*(self.stop_service(s.id) for s in daemons))
        lines += [f"{s.id}: {how}" for s, how in zip(daemons, results, strict=True)]
        if self.supervisor.launcher is not None:  # last: it reported the exits of the engines it forked
            await self.supervisor.launcher.stop()
        self.save()
        log.info("removed %d socket(s) the stopped processes left", len(remove_dead_sockets(self.run_dir)))
        return lines

    async def release(self) -> None:
        """Stop watching and leave every process running (the data path outlives the controller)."""
        for service in self.services.values():
            if service.keeper:
                service.keeper.cancel()
        await self.checker.close()
        self.spares.release_all()  # each exits 0 without starting
        self.daemon_spares.release_all()
        await self.batch.release()
        self.save()
        await self.gateways.close()
        if self.supervisor.launcher is not None:  # the engines it forked run on, in their own sessions
            self.supervisor.launcher.close()
        for process in list(self.supervisor.processes.values()):
            self.supervisor.forget(process)


def filled(fill: dict[str, Any]) -> str:
    """'; filled from <source> in <ms> ms (<detail>)' for a daemon's fill report, '' without one."""
    if not fill:
        return ""
    ms = round(fill.get("seconds", 0.0) * 1000, 1)
    return f"; filled from {fill.get('source')} in {ms} ms ({fill.get('detail')})"
