"""The cluster at one instant, read-only: each engine slot and service as the controller sees it. What one HA
cycle decides from (``controller.decide``), what ``GET /cluster`` shows; ``Cluster.snapshot`` takes it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from hotweights.contract import Role, State
from hotweights.state import ServiceKind


@dataclass
class HealthRecord:
    """What the checks of one engine process have seen so far (a fresh record per process)."""

    checked_at: float | None = None  # time.time() of the last check's answer
    sent_at: float = 0.0  # time.monotonic() when the last check was sent
    body_at: float = 0.0  # time.monotonic() when the check that gave ``body`` was sent: the body is from after this
    ok: bool | None = None  # None: not checked yet
    consecutive_failures: int = 0
    failing_since: float | None = None  # time.monotonic() when the first failed check of this run began
    ever_ok: bool = False
    ok_at: float | None = None  # time.monotonic() when the last check answered 200 was sent
    status_code: int | None = None
    body: dict[str, Any] | None = None
    error: str | None = None
    latency_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "checked_at": self.checked_at,
            "ok": self.ok,
            "consecutive_failures": self.consecutive_failures,
            "status_code": self.status_code,
            "latency_ms": self.latency_ms,
            "error": self.error,
            "body": self.body,
        }


UNKNOWN_STATE = "unknown"  # GET /cluster's state of an engine whose state is not known


def engine_state(body: dict[str, Any]) -> State | None:
    """The state an engine's health reply names, None when it names none of the contract's."""
    state = body.get("state")
    return State(state) if state in State._value2member_map_ else None


class Status(StrEnum):
    """The controller's word on an engine slot (``MemberView.status``), from its process and its checks."""

    ABSENT = "absent"  # no process
    STARTING = "starting"  # not healthy yet, never was
    HEALTHY = "healthy"
    FAILING = "failing"  # its last check failed, after it had been healthy
    EXITING = "exiting"  # a watched primary: every thread has begun to exit
    EXITED = "exited"


@dataclass(frozen=True)
class MemberView:
    id: str
    group: int
    port: int
    device: str
    url: str
    role: Role  # the engine's word when it has answered, else ours
    state: State | None  # the engine's (None: unknown, it has not answered, or with no state of the contract)
    status: Status
    pid: int | None
    alive: bool
    exit_reason: str | None
    exited_at: float | None
    exiting_at: float | None  # a watched primary: when every thread was seen exiting (it is not reaped yet)
    age_s: float
    start_timeout_s: float  # its group's: not ready this long after its start means failed
    health: HealthRecord
    generation: int = 0  # the weight generation it maps
    stopped_s: float | None = None  # a watched primary: how long its process has been seen stopped (None: running)

    @property
    def is_ready_standby(self) -> bool:
        return self.alive and self.role == Role.STANDBY and self.state == State.READY and bool(self.health.ok)

    @property
    def is_serving_primary(self) -> bool:
        return self.alive and self.role == Role.PRIMARY and self.state == State.READY and bool(self.health.ok)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "group": self.group,
            "role": self.role,
            "state": self.state or UNKNOWN_STATE,
            "status": self.status,
            "pid": self.pid,
            "port": self.port,
            "url": self.url,
            "device": self.device,
            "exit_reason": self.exit_reason,
            "last_check": self.health.checked_at,
            "consecutive_failures": self.health.consecutive_failures,
            "health": self.health.to_json(),
            "generation": self.generation,
        }


@dataclass(frozen=True)
class ServiceView:
    id: str
    kind: ServiceKind
    group: int | None
    rank: int
    pid: int | None
    alive: bool
    serving: bool
    restarting: bool
    restarts: int
    exit_reason: str | None
    generation: int = 0  # a daemon's weight generation
    current: bool = True  # a daemon of its group's current generation (else retiring with its last engines)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Snapshot:
    """The whole cluster at one instant: what one HA cycle decides from."""

    taken_at: float
    groups: int
    members: tuple[MemberView, ...]
    services: tuple[ServiceView, ...]

    def member(self, member_id: str) -> MemberView | None:
        return next((m for m in self.members if m.id == member_id), None)

    def group(self, group: int) -> list[MemberView]:
        return [m for m in self.members if m.group == group]

    def primaries(self, group: int) -> list[MemberView]:
        """Members that are (or were, until they died) the primary; live ones first."""
        return sorted((m for m in self.group(group) if m.role == Role.PRIMARY), key=lambda m: not m.alive)

    def is_whole(self, group: int) -> bool:
        """A serving primary, and every other member of ``group`` a ready standby."""
        members = self.group(group)
        return any(m.is_serving_primary for m in members) and all(
            m.is_serving_primary or m.is_ready_standby for m in members
        )

    def daemon(self, group: int) -> ServiceView:
        """The group's daemon of its current generation (of rank 0, in a tensor-parallel group)."""
        return next(s for s in self.services if s.kind == ServiceKind.DAEMON and s.group == group and s.current)

    def daemon_ids(self, group: int) -> list[str]:
        """The group's daemons of its current generation: one, or one per rank of a tensor-parallel group
        (rank 0's first)."""
        return [s.id for s in self.services if s.kind == ServiceKind.DAEMON and s.group == group and s.current]

    def daemons_serve(self, group: int) -> bool:
        """Whether every daemon of the group's current generation (one per rank) serves: new engines can
        attach."""
        return all(s.serving for s in self.services if s.kind == ServiceKind.DAEMON and s.group == group and s.current)
