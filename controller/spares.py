"""Spare processes, started ahead of need: per group, a pool of engines for any of its slots
(``[[groups]] spare_engines``) and one cache daemon (``cluster.daemon_spares``: the same mechanism; a daemon spare,
once started, computes the fingerprint, re-adopts and serves: the respawn's whole path minus the imports and the
CUDA context).

A spare is its group's engine command (``Layout.spare_command``: no slot's port or id yet) with ``--start-fd`` and
``--ready-fd`` (``hotweights.spawn``): it does its imports (torch, uvicorn, the model code: most of an engine's
start on CPU) and what needs no daemon (its CUDA context, the checkpoint's headers, the model's skeleton), then,
with ``spare_warm_up`` and its daemon serving, the attach and the warm-up (most of a start on a GPU, paced so that
it slows the serving engines little: ``standby.pacing``), says so with its ready message (the device memory it
holds), and waits on a start pipe whose write end only this controller holds. When a slot's engine is (re)started
(its primary was fenced, a standby died, a rollout restarts it), the slot takes a spare: ready ones first, else
the one preparing, which then warms up without pauses; the start message names the slot (port, engine id, log
file) and the spare binds the port and listens, supervised as the slot's engine from then on.

Spares are started one at a time: a new one only once every other spare of the group is ready, so that a storm
of faults never starts a herd of warm-ups beside the primary. A spare whose command is no longer what the group
would run (the settings or the weight generation changed), or that the group no longer wants, is released: its
pipe is closed and it exits 0 without starting. The pipe closes with the controller too, so a spare never
outlives the controller that started it. A spare that exits on its own is counted as a failure: the group's next
spare starts only after an exponential backoff (``controller.executor.backoff_s``), and the reason is kept for
``GET /cluster``, so a broken install shows why instead of becoming a spawn loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hotweights.controller.executor import backoff_s
from hotweights.controller.supervisor import Process, Supervisor
from hotweights.errors import ConfigError
from hotweights.spawn import START_FLAG, SparePipes, parse_message, send_message

log = logging.getLogger(__name__)


def plan(pool: list[tuple[float, bool]], wanted: int, may_start: bool) -> tuple[int, bool]:
    """What a pool of spares, each (started at, ready), does next: how many of its youngest to release (those beyond
    ``wanted``: the others are further along), and whether to start one more. Only while ``may_start`` (the group
    serves and no failure holds it back), only below ``wanted``, and only when every spare is ready: one at a time,
    so a storm of faults never starts a herd of warm-ups. Never releases a spare because it may not start one: a
    group between primaries keeps its pool, which its failover draws on."""
    excess = max(0, len(pool) - wanted)
    start = may_start and len(pool) < wanted and all(ready for _, ready in pool)
    return excess, start


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
    group: int
    key: str  # what it waits to replace: a daemon's service id, or its group's engine slots (any of them)
    index: int  # its place in the group's pool: names its process and its log until it starts
    command: list[str]  # what it runs (without the pipes' flags)
    process: Process
    start_fd: int  # our end of its start pipe
    ready_fd: int  # our end of its ready pipe, until its ready message came (-1 then)
    started_at: float  # time.monotonic()
    ready_at: float | None = None  # when its ready message came
    holds: dict[str, Any] = field(default_factory=dict)  # its ready message: the device memory it holds

    @property
    def ready(self) -> bool:
        return self.ready_at is not None

    def describe(self, now: float) -> dict[str, Any]:
        prepared = round((self.ready_at or now) - self.started_at, 3)
        return {"pid": self.process.pid, "ready": self.ready, "prepare_s": prepared} | self.holds


@dataclass
class Failures:
    """A group's spares that exited on their own, in a row."""

    count: int = 0
    reason: str = ""
    retry_at: float = 0.0  # time.monotonic() before which no new spare starts


class Spares:
    """Per group, a pool of spares for one key; every method runs on the event loop and does not wait."""

    def __init__(self, supervisor: Supervisor, wake: Callable[[], None] = lambda: None) -> None:
        self.supervisor = supervisor
        self.wake = wake  # called when a spare says it is ready (the HA loop reassesses)
        self.pools: dict[int, list[Spare]] = {}
        self.failures: dict[int, Failures] = {}

    def tend(
        self,
        group: int,
        key: str | None,
        wanted: int,
        command: list[str],
        env: dict[str, str] | None,
        may_start: bool = True,
    ) -> None:
        """Keep ``wanted`` spares for ``key`` running ``command`` (``key`` None: the group wants none): those that
        exited are counted as failures, those for another key or command released, then ``plan`` decides."""
        pool = self.pools.setdefault(group, [])
        now = time.monotonic()
        for spare in list(pool):
            if not spare.process.alive:
                self._failed(group, spare, now)
            elif spare.key != key or spare.command != command:
                self._release(group, spare)
        backing_off = now < self.failures.setdefault(group, Failures()).retry_at
        excess, start = plan(
            [(s.started_at, s.ready) for s in pool], wanted if key is not None else 0, may_start and not backing_off
        )
        for spare in sorted(pool, key=lambda s: s.started_at, reverse=True)[:excess]:
            self._release(group, spare)
        if start and key is not None:
            pool.append(self._start(group, key, self._free_index(pool), command, env))

    def _failed(self, group: int, spare: Spare, now: float) -> None:
        failures = self.failures.setdefault(group, Failures())
        failures.count += 1
        delay = backoff_s(failures.count)
        failures.reason = f"spare (pid {spare.process.pid}) {spare.process.exit_reason}"
        failures.retry_at = now + delay
        log.warning("%s; the next spare of group %d starts in %.1f s", failures.reason, group, delay)
        self._release(group, spare)

    @staticmethod
    def _free_index(pool: list[Spare]) -> int:
        taken = {s.index for s in pool}
        return next(i for i in range(len(pool) + 1) if i not in taken)

    def _start(self, group: int, key: str, index: int, command: list[str], env: dict[str, str] | None) -> Spare:
        """A new spare, its output appended to ``key``'s log (a daemon's own; an engine spare moves to its slot's
        at its start)."""
        pipes = SparePipes.open()
        name = f"{key}-spare{index}" if index else f"{key}-spare"
        try:
            process = self.supervisor.spawn(name, pipes.command(command), env, pass_fds=pipes.theirs, log_id=key)
        except BaseException:
            os.close(pipes.start_fd)
            os.close(pipes.ready_fd)
            raise
        finally:
            pipes.close_theirs()
        spare = Spare(group, key, index, command, process, pipes.start_fd, pipes.ready_fd, time.monotonic())
        asyncio.get_running_loop().add_reader(pipes.ready_fd, self._on_ready, spare)
        log.info("spare %s started (pid %d)", name, process.pid)
        return spare

    def _on_ready(self, spare: Spare) -> None:
        """Its ready pipe is readable: its ready message, or EOF (it exited first)."""
        try:
            message = parse_message(os.read(spare.ready_fd, select.PIPE_BUF))
        except (OSError, ConfigError) as exc:
            log.warning("spare (pid %d): %s", spare.process.pid, exc)
            message = None
        if message is not None:
            spare.ready_at, spare.holds = time.monotonic(), message
            self.failures.pop(spare.group, None)
            self.wake()
        self._close_ready(spare)

    @staticmethod
    def _close_ready(spare: Spare) -> None:
        if spare.ready_fd >= 0:
            asyncio.get_running_loop().remove_reader(spare.ready_fd)
            os.close(spare.ready_fd)
            spare.ready_fd = -1

    def take(
        self, group: int, key: str, command: list[str], process_id: str, message: dict[str, Any] | None = None
    ) -> Process | None:
        """A spare of the group for ``key`` running ``command``, started as ``process_id`` (``message``: what it
        starts as), the oldest ready one first, else the one preparing; None when there is none (the caller
        starts the process itself)."""
        pool = [s for s in self.pools.get(group, []) if s.key == key and s.command == command and s.process.alive]
        for spare in sorted(pool, key=lambda s: (not s.ready, s.started_at)):
            try:
                send_message(spare.start_fd, message or {})
            except BrokenPipeError:  # it is exiting: the pidfd reports that next
                continue
            finally:
                self._release(group, spare)  # its pipe closes after the message it reads first
            self.supervisor.rename(spare.process, process_id)
            log.info("spare (pid %d) started as %s", spare.process.pid, process_id)
            return spare.process
        return None

    def _release(self, group: int, spare: Spare) -> Process:
        """Forget ``spare`` and close its pipes: one that was sent no start message exits 0 without starting. Its
        process, still to be reaped."""
        self.pools[group].remove(spare)
        os.close(spare.start_fd)
        self._close_ready(spare)
        return spare.process

    def release_all(self) -> list[Process]:
        return [self._release(group, spare) for group, pool in self.pools.items() for spare in list(pool)]

    def failure(self, group: int) -> str:
        """Why the group's last spare exited before it was ready, while no spare has been ready since ("": none)."""
        failures = self.failures.get(group)
        return failures.reason if failures is not None and failures.count else ""

    def ready_count(self, group: int) -> int:
        return sum(spare.ready for spare in self.pools.get(group, []))

    def preparing(self, group: int) -> bool:
        """Whether a spare of the group is still preparing (a warm-up allocates device memory)."""
        return any(not spare.ready for spare in self.pools.get(group, []))

    def describe(self, group: int, wanted: int) -> list[dict[str, Any]]:
        """The group's spares (pid, ready, how long it took to be ready or has been preparing, its ready message),
        and one ``{"pid": None, "ready": False}`` per wanted spare not started yet (with the last failure's reason
        and the backoff left while one holds it back)."""
        now = time.monotonic()
        found = [spare.describe(now) for spare in sorted(self.pools.get(group, []), key=lambda s: s.index)]
        failures = self.failures.get(group)
        missing: dict[str, Any] = {"pid": None, "ready": False}
        if failures is not None and failures.count:
            missing |= {"failed": failures.reason, "retry_in_s": round(max(0.0, failures.retry_at - now), 1)}
        return found + [missing] * max(0, wanted - len(found))
