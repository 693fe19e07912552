"""Spare processes (``[[groups]] spare``), started ahead of need: per group, one engine for the primary's slot
and one cache daemon (``cluster.daemon_spares``: the same mechanism; a daemon spare, once started, computes
the fingerprint, re-adopts and serves: the respawn's whole path minus the imports and the CUDA context).

A spare is the slot's own engine command with ``--start-fd`` and ``--ready-fd``: it does its imports (torch,
uvicorn, the model code: most of an engine's start on CPU) and what needs no daemon (its CUDA context, the
checkpoint's headers, the model's skeleton), then, with ``spare_warm_up`` and its daemon serving, the attach
and the warm-up (most of a start on a GPU: ``standby.engine``), says so with one byte on its ready pipe, and
then waits on a start pipe whose write end only this controller holds. When the slot's engine is replaced
(its primary was fenced, or a rollout restarts it), one byte starts the spare: it binds the slot's port
(attaching and warming up first if it has not) and is supervised as the slot's engine from then on. A daemon
spare makes its CUDA context before it waits too.

A spare whose slot is no longer the primary's, or whose command is no longer what the slot would run (the
settings changed), is released: its pipe is closed and it exits 0 without starting. The pipe closes with
the controller too, so a spare never outlives the controller that started it. A spare that exits on its
own is not started again for ``RETRY_S`` (a broken install must not become a spawn loop).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hotweights.controller.supervisor import Process, Supervisor
from hotweights.spawn import START_FLAG, SparePipes

log = logging.getLogger(__name__)

RETRY_S = 10.0  # after a spare exited on its own, before its group gets another


def is_spare(process: Process) -> bool:
    """Whether ``process`` was started as a spare (and is, or was taken as, a slot's engine)."""
    return START_FLAG in process.identity.command


def is_waiting(pid: int, command: Sequence[str]) -> bool:
    """Whether process ``pid``, which runs ``command``, is a spare still waiting to start: it holds its start
    pipe (a started one closed it)."""
    if START_FLAG not in command[:-1]:
        return False
    try:
        return os.readlink(f"/proc/{pid}/fd/{command[command.index(START_FLAG) + 1]}").startswith("pipe:")
    except OSError:
        return False


@dataclass
class Spare:
    member_id: str  # the slot it will become the engine of
    command: list[str]  # the slot's engine command it runs (without --start-fd)
    process: Process
    start_fd: int  # our end of its start pipe
    ready_fd: int  # our end of its ready pipe, until it has said it is ready (-1 then)
    ready: bool = False  # imported and waiting


class Spares:
    """At most one spare per group; every method runs on the event loop and does not wait."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.spares: dict[int, Spare] = {}
        self.failed_at: dict[int, float] = {}  # time.monotonic() of a group's spare exiting on its own

    def tend(self, group: int, member_id: str | None, command: list[str], env: dict[str, str] | None) -> None:
        """Keep one spare for ``member_id``'s slot running ``command`` (None: the group wants none)."""
        spare = self.spares.get(group)
        if spare is not None and not spare.process.alive:
            log.warning("spare for %s (pid %d) %s", spare.member_id, spare.process.pid, spare.process.exit_reason)
            self.failed_at[group] = time.monotonic()
            self.release(group)
        elif spare is not None and (spare.member_id != member_id or spare.command != command):
            self.release(group)
        if member_id is None or group in self.spares:
            return
        if time.monotonic() - self.failed_at.get(group, -RETRY_S) >= RETRY_S:
            self.spares[group] = self._start(member_id, command, env)

    def _start(self, member_id: str, command: list[str], env: dict[str, str] | None) -> Spare:
        pipes = SparePipes.open()
        try:
            process = self.supervisor.spawn(
                f"{member_id}-spare", [*command, *pipes.flags], env, pass_fds=pipes.theirs, log_id=member_id
            )
        except BaseException:
            os.close(pipes.start_fd)
            os.close(pipes.ready_fd)
            raise
        finally:
            pipes.close_theirs()
        spare = Spare(member_id, command, process, pipes.start_fd, pipes.ready_fd)
        asyncio.get_running_loop().add_reader(pipes.ready_fd, self._on_ready, spare)
        log.info("spare for %s started (pid %d)", member_id, process.pid)
        return spare

    def _on_ready(self, spare: Spare) -> None:
        """Its ready pipe is readable: the byte that says it is imported, or EOF (it exited first)."""
        spare.ready = os.read(spare.ready_fd, 1) == b"1"
        self._close_ready(spare)

    @staticmethod
    def _close_ready(spare: Spare) -> None:
        if spare.ready_fd >= 0:
            asyncio.get_running_loop().remove_reader(spare.ready_fd)
            os.close(spare.ready_fd)
            spare.ready_fd = -1

    def take(self, group: int, member_id: str, command: list[str]) -> Process | None:
        """The group's spare started as ``member_id``'s engine, if it is one for that slot and ``command``;
        None otherwise (the caller starts the engine itself)."""
        spare = self.spares.get(group)
        if spare is None or spare.member_id != member_id:
            return None
        if not spare.process.alive or spare.command != command:
            self.release(group)
            return None
        try:
            os.write(spare.start_fd, b"1")
        except BrokenPipeError:  # it is exiting: the pidfd reports that next
            self.release(group)
            return None
        self.release(group)  # its pipe closes after the byte it reads first
        self.supervisor.rename(spare.process, member_id)
        log.info("spare (pid %d) started as %s", spare.process.pid, member_id)
        return spare.process

    def release(self, group: int) -> Process | None:
        """Forget the group's spare and close its pipes: one that was not sent a byte exits 0 without starting.
        Its process, still to be reaped."""
        spare = self.spares.pop(group, None)
        if spare is None:
            return None
        os.close(spare.start_fd)
        self._close_ready(spare)
        return spare.process

    def release_all(self) -> list[Process]:
        return [process for group in list(self.spares) if (process := self.release(group)) is not None]

    def describe(self, group: int, member_id: str) -> dict[str, object]:
        """The group's spare for ``member_id``'s slot: its pid (None: none yet) and whether it is ready."""
        spare = self.spares.get(group)
        if spare is None or spare.member_id != member_id:
            return {"pid": None, "ready": False}
        return {"pid": spare.process.pid, "ready": spare.ready}
