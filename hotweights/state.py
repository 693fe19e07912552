"""``state.json``: what a controller persists about its stack, one typed schema for the writer and every reader.

The controller (``controller/cluster.py``) writes it after every change; the gateway reads the
engine ports from it, ``hotweights down`` the processes to stop, the drills the controller's pid.

A file is read as follows (documented in docs/operations.md, "Persisted state"):

- missing: an empty state (a first start);
- not JSON, not an object, or a field of the wrong type: ``StateCorrupt`` (the controller moves the
  file aside and starts fresh, evicting the stack's leftover processes; ``down`` does the eviction);
- a ``version`` this code does not know: ``StateVersionUnknown``, a one-line refusal (a newer
  hotweights wrote it; its records must not be thrown away by an older one).

A file without ``version`` was written before the field existed; it has the layout of version 1.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from hotweights.contract import Role
from hotweights.errors import ConfigError

STATE_VERSION = 1


class ServiceKind(StrEnum):
    """A supervised process that is not an engine slot."""

    DAEMON = "daemon"  # a group's cache daemon (one per rank of a tensor-parallel group)
    GATEWAY = "gateway"
    BATCH = "batch"  # a group's co-located batch engine


class StateCorrupt(ConfigError):
    """state.json is not a state this schema can read (bad JSON, wrong shape or types)."""


class StateVersionUnknown(ConfigError):
    """state.json was written with a schema version this hotweights does not know."""


@dataclass(frozen=True)
class ProcessRecord:
    """What tells a live process from another one that reused its pid."""

    pid: int
    start_time: int  # /proc/<pid>/stat field 22: clock ticks after boot
    command: tuple[str, ...]


@dataclass(frozen=True)
class MemberRecord:
    """One engine slot. ``added``: created through the API, not in cluster.toml."""

    group: int
    device: str
    port: int
    role: Role = Role.STANDBY  # of ``process``; meaningless without one
    added: bool = False
    process: ProcessRecord | None = None
    generation: int = 0  # the weight generation ``process`` runs (its group's ``GroupRecord``)


@dataclass(frozen=True)
class ServiceRecord:
    kind: ServiceKind
    process: ProcessRecord | None = None


@dataclass(frozen=True)
class GroupRecord:
    """A group's weight generation: 0 is cluster.toml's ``[model]``; each model update (``rollout --model``)
    makes the next, with its own daemon. ``served``: one of its engines has been primary, so no engine of an
    older generation may be again."""

    generation: int = 0
    model: str = ""  # the checkpoint of ``generation`` (generation 0, cluster.toml's, is never recorded)
    served: bool = True


@dataclass(frozen=True)
class ClusterState:
    version: int = STATE_VERSION
    cluster: str = ""
    controller: ProcessRecord | None = None
    members: dict[str, MemberRecord] = field(default_factory=dict)
    services: dict[str, ServiceRecord] = field(default_factory=dict)
    removed: tuple[str, ...] = ()  # configured engines deleted through the API
    groups: dict[str, GroupRecord] = field(default_factory=dict)  # by group number; absent: generation 0

    def processes(self) -> list[tuple[str, ProcessRecord]]:
        """Every recorded stack process (not the controller), as (id, record)."""
        rows = [*self.members.items(), *self.services.items()]
        return [(name, row.process) for name, row in rows if row.process is not None]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def read_state(path: Path) -> ClusterState:
    """The state in ``path``; an empty one if there is none. Raises StateCorrupt or StateVersionUnknown,
    whose one-line message names the file, the field, and what was expected and found."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return ClusterState()
    except OSError as exc:
        raise StateCorrupt(f"{path}: unreadable controller state: {exc.strerror}") from None
    try:
        document = json.loads(raw)
    except ValueError as exc:  # bad JSON or bad UTF-8
        raise StateCorrupt(f"{path}: unreadable controller state: not JSON ({exc})") from None
    return parse_state(document, path)


def parse_state(document: Any, path: Path) -> ClusterState:
    reader = _Reader(path)
    root = reader.object(document, "the document")
    version = root.get("version", 1)
    if version != STATE_VERSION:
        raise StateVersionUnknown(
            f"{path}: controller state version {version!r}, this hotweights reads version {STATE_VERSION}; "
            "run the hotweights that wrote it, or move the file away to start fresh"
        )
    members = reader.object(root.get("members", {}), "members")
    services = reader.object(root.get("services", {}), "services")
    removed = reader.typed(root.get("removed", []), list, "removed")
    groups = reader.object(root.get("groups", {}), "groups")
    return ClusterState(
        version=STATE_VERSION,
        cluster=reader.typed(root.get("cluster", ""), str, "cluster"),
        controller=reader.process(root.get("controller"), "controller"),
        members={name: reader.member(row, f"members.{name}") for name, row in members.items()},
        services={name: reader.service(row, f"services.{name}") for name, row in services.items()},
        removed=tuple(reader.typed(name, str, "removed[]") for name in removed),
        groups={name: reader.group(row, f"groups.{name}") for name, row in groups.items()},
    )


def write_state(path: Path, state: ClusterState) -> None:
    """Write a temp file, fsync it, rename it over the old one, fsync the directory: after a crash or a power
    loss the file is the old state or the new one, never empty or half written. Raises OSError (ENOSPC, EIO,
    EROFS...) with the old file untouched and no temp file left behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    try:
        with open(tmp, "w") as out:
            out.write(json.dumps(state.to_json(), indent=1))
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's error is the one to report
            tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename or a new name in ``directory`` durable. OSError when the directory cannot be synced."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Reader:
    """Field checks that fail with one line: file, field, expected, found."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, expected: str, value: Any) -> StateCorrupt:
        found = json.dumps(value)[:40] if isinstance(value, str | int | float | bool | None) else type(value).__name__
        return StateCorrupt(f"{self.path}: unreadable controller state: {where} must be {expected}, found {found}")

    def typed(self, value: Any, kind: type, where: str) -> Any:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(where, f"a JSON {_JSON_NAMES[kind]}", value)
        return value

    def object(self, value: Any, where: str) -> dict[str, Any]:
        return self.typed(value, dict, where)

    def process(self, value: Any, where: str) -> ProcessRecord | None:
        if value is None:
            return None
        row = self.object(value, where)
        command = self.typed(row.get("command"), list, f"{where}.command")
        return ProcessRecord(
            pid=self.typed(row.get("pid"), int, f"{where}.pid"),
            start_time=self.typed(row.get("start_time"), int, f"{where}.start_time"),
            command=tuple(self.typed(arg, str, f"{where}.command[]") for arg in command),
        )

    def member(self, value: Any, where: str) -> MemberRecord:
        row = self.object(value, where)
        role = row.get("role", Role.STANDBY)
        if role not in set(Role):
            raise self.fail(f"{where}.role", " or ".join(Role), role)
        return MemberRecord(
            group=self.typed(row.get("group"), int, f"{where}.group"),
            device=self.typed(row.get("device"), str, f"{where}.device"),
            port=self.typed(row.get("port"), int, f"{where}.port"),
            role=Role(role),
            added=self.typed(row.get("added", False), bool, f"{where}.added"),
            process=self.process(row.get("process"), f"{where}.process"),
            generation=self.typed(row.get("generation", 0), int, f"{where}.generation"),
        )

    def group(self, value: Any, where: str) -> GroupRecord:
        row = self.object(value, where)
        model = self.typed(row.get("model"), str, f"{where}.model")
        if not model.startswith("/"):
            raise self.fail(f"{where}.model", "an absolute checkpoint path", model)
        return GroupRecord(
            generation=self.typed(row.get("generation"), int, f"{where}.generation"),
            model=model,
            served=self.typed(row.get("served", True), bool, f"{where}.served"),
        )

    def service(self, value: Any, where: str) -> ServiceRecord:
        row = self.object(value, where)
        kind = row.get("kind")
        if kind not in set(ServiceKind):
            raise self.fail(f"{where}.kind", " or ".join(ServiceKind), kind)
        return ServiceRecord(kind=ServiceKind(kind), process=self.process(row.get("process"), f"{where}.process"))


_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "integer", bool: "boolean"}
