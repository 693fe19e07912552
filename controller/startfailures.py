"""Starts that fail the same way: told on the console in one line, and for ``up`` an end to retrying them.

Every engine slot, cache daemon and gateway worker whose start fails (an engine that exits before it was ever
ready, a daemon or worker that exits or never serves) has the failure told in one line, its reason:

- a port another process holds, with that process and the ``cluster.toml`` key of the port
  (``controller.preflight.port_refusal``);
- an engine the controller killed, why it did (``fenced``: not ready within its start timeout);
- else how the process ended: a signal (the log of a process killed, by the kernel's OOM killer say, does not say
  why), or an exit status with the last line of its log, where an engine or a daemon says why (its one-line
  refusal, or a traceback's last line).

The first failure of a streak is logged as a warning (``up``'s console). ``decide.GIVE_UP_AFTER`` failures in a
row for one reason end the streak's retries if the controller owns its stack: ``on_give_up`` (``up``'s: stop
everything it started, exit 2 with the sentence) runs once, and a ``gave_up`` event is recorded. A ``controller``
(which owns no stack) keeps retrying with its backoff.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from hotweights.controller.cluster import Cluster
from hotweights.controller.decide import GiveUp, Streak, after_start, give_up
from hotweights.controller.events import EventLog
from hotweights.controller.preflight import listeners, port_refusal, stack_pids
from hotweights.controller.snapshot import MemberView
from hotweights.eventkinds import EventKind

log = logging.getLogger(__name__)

TAIL_BYTES = 4096  # how much of a log's end is read for its last line
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d+ ")  # a logging line's time, left out


def last_line(path: Path) -> str | None:
    """The last non-empty line of the log at ``path`` without its logging timestamp (so that two failures alike
    read alike); None when there is none or it cannot be read."""
    try:
        with open(path, "rb") as log_file:
            log_file.seek(max(0, os.fstat(log_file.fileno()).st_size - TAIL_BYTES))
            tail = log_file.read().decode(errors="replace")
    except OSError:
        return None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return TIMESTAMP.sub("", lines[-1]) if lines else None


class StartFailures:
    """Each slot's streak of failed starts (``decide.Streak``), by slot id; ``give_up`` decides."""

    def __init__(self, cluster: Cluster, events: EventLog, on_give_up: Callable[[GiveUp], None] | None) -> None:
        self.cluster = cluster  # its layout (config, logs) as it is when a start fails
        self.events = events
        self.on_give_up = on_give_up
        self.streaks: dict[str, Streak] = {}
        self.gave_up: GiveUp | None = None
        self.pending: set[asyncio.Task] = set()  # reasons being found (a /proc scan, off the event loop)
        self.fences: dict[str, str] = {}  # engines killed before they were ever ready, and why

    def started(self, slot: str) -> None:
        """``slot``'s start worked: its streak is over."""
        self.streaks.pop(slot, None)

    def failed(self, slot: str, reason: str) -> None:
        """``slot``'s start failed for ``reason``: log the first of a streak, give up after GIVE_UP_AFTER."""
        streak = self.streaks[slot] = after_start(self.streaks.get(slot, Streak()), reason)
        if streak.count == 1:
            log.warning("%s could not start: %s", slot, reason)
        if self.on_give_up is None or self.gave_up is not None or (decision := give_up(self.streaks)) is None:
            return
        self.gave_up = decision
        self.events.record(EventKind.GAVE_UP, decision.sentence, slot=decision.slot, reason=decision.reason)
        self.on_give_up(decision)

    def fenced(self, slot: str, reason: str) -> None:
        """The controller killed ``slot``'s engine, never ready, for ``reason``: its exit's reason."""
        self.fences[slot] = reason

    def engine_exited(self, view: MemberView, host: str, port: int) -> None:
        """An engine that was never ready exited: its reason is found in the background, then ``failed``."""
        task = asyncio.create_task(self._engine_failed(view, host, port), name=f"start-failure-{view.id}")
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _engine_failed(self, view: MemberView, host: str, port: int) -> None:
        if fence := self.fences.pop(view.id, None):
            self.failed(view.id, f"killed: {fence}")
            return
        held = await self.port_held(host, port)
        log_path = self.cluster.layout.log_dir / f"{view.id}.log"
        self.failed(view.id, held or self.ended(view.exit_reason or "exited", log_path))

    async def port_held(self, host: str, port: int) -> str | None:
        """``host:port`` held by a process of another stack or a stranger (module docstring), with its key; None
        when it is free or held by this stack (this controller included: it holds the gateway's socket)."""
        layout = self.cluster.layout
        ours = await asyncio.to_thread(stack_pids, layout)
        refusal = await asyncio.to_thread(port_refusal, host, port, ours | {os.getpid()})
        if refusal is None:
            return None
        key = next((key for _, p, key in listeners(layout.config, True) if p == port), f"port {port}")
        return f"{key}: {refusal}"

    @staticmethod
    def ended(how: str, log_path: Path) -> str:
        """``how`` a process ended, with the last line of its log when it has one and did not die of a signal."""
        line = None if "(signal " in how else last_line(log_path)  # ``supervisor.exit_reason``'s words
        return f"{how}; its log ends: {line}" if line else how
