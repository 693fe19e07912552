"""What the controller keeps in memory of each engine slot (``Member``), each service (``Service``: a cache
daemon, a gateway worker) and each group's weights (``Weights``), and the read-only views of them that a
``Snapshot`` holds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from hotweights.contract import Role
from hotweights.controller.config import START_TIMEOUTS_S, EngineSpec
from hotweights.controller.health import HealthRecord
from hotweights.controller.ids import engine_slot
from hotweights.controller.snapshot import MemberView, ServiceView, Status, engine_state
from hotweights.controller.stack import Generation
from hotweights.controller.supervisor import Process
from hotweights.engines import Engine
from hotweights.state import ServiceKind


@dataclass
class Member:
    """One engine slot: the spec is permanent, the process behind it is replaced on failure."""

    spec: EngineSpec
    role: Role = Role.STANDBY  # what we last set; the engine's own later health replies override it
    role_set_at: float = 0.0  # time.monotonic() of our last role change: older replies are stale
    process: Process | None = None
    health: HealthRecord = field(default_factory=HealthRecord)
    started_at: float = 0.0  # time.monotonic()
    start_timeout_s: float = START_TIMEOUTS_S[Engine.REFERENCE]  # its group's: how long it may take to be ready
    generation: int = 0  # the weight generation its process maps

    def current_role(self) -> Role:
        """The engine's word when its latest reply postdates our last role change, else ours. By
        ``body_at``, not ``sent_at``: a failed check keeps the previous body, which may predate it."""
        body = self.health.body or {}
        if body.get("role") in (Role.PRIMARY, Role.STANDBY) and self.health.body_at > self.role_set_at:
            return Role(body["role"])
        return self.role


@dataclass
class Service:
    """A cache daemon (one per group) or the gateway: kept running, ``serving`` once its probe answered."""

    id: str
    kind: ServiceKind
    group: int | None = None
    rank: int = 0  # a daemon's tensor-parallel rank
    process: Process | None = None
    serving: bool = False
    restarts: int = 0  # replacements of a process that had exited
    keeper: asyncio.Task | None = None  # the (re)start in progress
    fencing: bool = False  # being killed for not answering; respawned once it is gone
    generation: Generation | None = None  # a daemon's weights (None: the first generation)
    from_spare: bool = False  # its process was its group's spare daemon, started when it was needed


@dataclass
class Weights:
    """A group's current weight generation: what its engines start on. ``served``: one of its engines has
    been primary, so no engine of an older generation may be promoted again (answers switch once)."""

    current: Generation
    served: bool = True


def member_view(member: Member, now: float) -> MemberView:
    """An engine slot as the snapshot shows it (``now``: time.monotonic())."""
    process, health = member.process, member.health
    body = health.body or {}
    alive = bool(process and process.alive)
    if process is None:
        status = Status.ABSENT
    elif not alive:
        status = Status.EXITED
    elif process.exiting_at is not None:
        status = Status.EXITING
    elif health.ok:
        status = Status.HEALTHY
    else:
        status = Status.FAILING if health.ever_ok else Status.STARTING
    return MemberView(
        id=member.spec.id,
        group=member.spec.group,
        port=member.spec.port,
        device=member.spec.device,
        url=member.spec.url,
        role=member.current_role(),
        state=engine_state(body) if health.ok is not None else None,
        status=status,
        pid=process.pid if process else None,
        alive=alive,
        exit_reason=process.exit_reason if process else None,
        exited_at=process.exited_at if process else None,
        exiting_at=process.exiting_at if process else None,
        stopped_s=now - process.stopped_at if process and process.stopped_at is not None else None,
        age_s=now - member.started_at,
        start_timeout_s=member.start_timeout_s,
        health=replace(health),
        generation=member.generation,
    )


def service_view(service: Service, current: dict[int, int]) -> ServiceView:
    """A service as the snapshot shows it; ``current``: each group's current weight generation."""
    generation = service.generation.number if service.generation else 0
    return ServiceView(
        service.id,
        service.kind,
        service.group,
        service.rank,
        service.process.pid if service.process else None,
        bool(service.process and service.process.alive),
        service.serving,
        service.fencing or bool(service.keeper and not service.keeper.done()),
        service.restarts,
        service.process.exit_reason if service.process else None,
        generation,
        service.kind != ServiceKind.DAEMON or generation == current[service.group],
    )


def slot_order(member: Member) -> tuple[int, int]:
    return engine_slot(member.spec.id)
