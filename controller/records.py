"""What the controller persists of its stack and reads back at start: ``state.json``'s records (``hotweights.state``)
built from the engine slots, services, batch engines and weight generations it keeps, and the recorded state read
with a corrupt file set aside. ``controller.cluster`` keeps the stack; this module only translates it."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from hotweights.contract import Role
from hotweights.controller.config import ClusterConfig
from hotweights.controller.slots import Member, Service, Weights
from hotweights.controller.stack import Layout
from hotweights.controller.supervisor import Process, read_identity, stack_marker, stop_leftovers
from hotweights.state import (
    ClusterState,
    GroupRecord,
    MemberRecord,
    ServiceKind,
    ServiceRecord,
    StateCorrupt,
    read_state,
)

log = logging.getLogger(__name__)


def read_recorded(layout: Layout) -> tuple[ClusterState, list[str]]:
    """The recorded state and a line per leftover stopped; a corrupt file is moved aside and the stack's
    leftovers (processes naming its state dir or config) are stopped, for a fresh start. An unknown version
    raises (ConfigError)."""
    try:
        return read_state(layout.state_file), []
    except StateCorrupt as exc:
        aside = layout.state_file.with_name(f"state.json.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        layout.state_file.replace(aside)
        log.warning("%s; moved it to %s and starting fresh", exc, aside)
        stopped = stop_leftovers(stack_marker(layout.state_dir), layout.markers)
        return ClusterState(), [f"none from {aside.name} (corrupt)", *stopped]


def record(process: Process | None):
    """A live process's record, None for none (a dead one is not adopted again)."""
    return process.record() if process and process.alive else None


def state_of(
    config: ClusterConfig,
    members: Mapping[str, Member],
    services: Mapping[str, Service],
    batches: Mapping[str, Process | None],
    weights: Mapping[int, Weights],
    removed: set[str],
) -> ClusterState:
    """The state to record of a stack: each slot with its live process and role (a slot without one is a
    standby when it starts again), each service and batch engine with its live process, the engines removed
    through the API, each group's weight generation (the first, never updated, is not recorded)."""
    configured = {spec.id for spec in config.engines()}
    return ClusterState(
        cluster=config.cluster.name,
        controller=read_identity(os.getpid()),
        members={
            m.spec.id: MemberRecord(
                group=m.spec.group,
                device=m.spec.device,
                port=m.spec.port,
                role=m.current_role() if m.process and m.process.alive else Role.STANDBY,
                added=m.spec.id not in configured,
                process=record(m.process),
                generation=m.generation,
            )
            for m in members.values()
        },
        services={s.id: ServiceRecord(s.kind, record(s.process)) for s in services.values()}
        | {batch_id: ServiceRecord(ServiceKind.BATCH, record(process)) for batch_id, process in batches.items()},
        removed=tuple(sorted(removed)),
        groups={
            str(group): GroupRecord(w.current.number, str(w.current.model_dir), w.served)
            for group, w in weights.items()
            if w.current.number
        },
    )
