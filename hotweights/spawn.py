"""The one way a hotweights process starts another: ``[sys.executable, "-m", "hotweights", ...]`` (a helper that
is no subcommand, ``[sys.executable, "-m", "hotweights.<module>", ...]``).

Children run this interpreter's installed package, never whatever ``cache/`` or ``controller/``
folder happens to lie in the current directory, and nothing sets or extends ``PYTHONPATH``.

Spares (``controller.spares``): an engine or cache daemon started with START_FLAG and READY_FLAG does its
imports (an engine also its attach and warm-up; a vLLM or SGLang agent starts its engine server and waits until it
is ready), says so with one message on its ready pipe, and waits on its start pipe (``wait_for_start``) for one
message that starts it. A message is one JSON object on one line, smaller than PIPE_BUF so that it is written whole,
and the writer closes the pipe after it: the ready message says what the spare holds (``{}``, or an engine's
device bytes, or an agent's engine's host and device bytes), the start message what it starts as (``{}``, or an
engine's slot: ``Slot``). A pipe closed without a message says no: the spare exited before it was ready, or it is
not needed after all and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import sys
from dataclasses import dataclass
from typing import Any

from hotweights.errors import ConfigError

log = logging.getLogger(__name__)

START_FLAG, READY_FLAG = "--start-fd", "--ready-fd"
# The share of time a spare engine's warm-up may keep its device busy before it is needed (``standby.pacing``).
SPARE_DUTY = 0.5


def hotweights_command(*args: str, python: str | None = None) -> list[str]:
    """The argv that runs ``hotweights ARGS...`` with this interpreter, or with ``python`` (another
    environment that has hotweights installed, e.g. vLLM's)."""
    return [python or sys.executable, "-m", "hotweights", *args]


def module_command(module: str, *args: str) -> list[str]:
    """The argv that runs the hotweights module ``module`` (``hotweights.standby.checker``) as a script with this
    interpreter."""
    return [sys.executable, "-m", module, *args]


def add_spare_arguments(parser: argparse.ArgumentParser, starts: str) -> None:
    """START_FLAG and READY_FLAG; ``starts``: what the process does once started (for the help)."""
    parser.add_argument(
        START_FLAG,
        type=int,
        metavar="FD",
        help=f"start as a spare: import everything, then wait for one JSON message on the inherited FD before "
        f"{starts} (EOF: exit 0 without starting); the controller keeps them per group",
    )
    parser.add_argument(
        READY_FLAG,
        type=int,
        metavar="FD",
        help=f"with {START_FLAG}: write one JSON message to this inherited FD once ready to start",
    )


@dataclass(frozen=True)
class SparePipes:
    """The two pipes of a spare about to be spawned: ``flags`` for its command (``command``), ``theirs`` for it to
    inherit (close them here once it is spawned), and our ends: the start pipe's write end and the ready pipe's read
    end."""

    flags: tuple[str, ...]
    theirs: tuple[int, int]
    start_fd: int
    ready_fd: int

    @classmethod
    def open(cls) -> SparePipes:
        (start_read, start_write), (ready_read, ready_write) = os.pipe(), os.pipe()
        flags = (START_FLAG, str(start_read), READY_FLAG, str(ready_write))
        return cls(flags, (start_read, ready_write), start_write, ready_read)

    def command(self, command: list[str]) -> list[str]:
        """``command`` with ``flags``, before its first ``--`` (the command another program runs follows it, as an
        agent's engine's), else at its end."""
        end = command.index("--") if "--" in command else len(command)
        return [*command[:end], *self.flags, *command[end:]]

    def close_theirs(self) -> None:
        for fd in self.theirs:
            os.close(fd)


def send_message(fd: int, message: dict[str, Any]) -> None:
    """Write ``message`` whole to the pipe ``fd`` (module docstring); the caller closes it after. BrokenPipeError:
    the reader is gone."""
    data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
    if len(data) > select.PIPE_BUF:
        raise ValueError(f"a spare's message must be under {select.PIPE_BUF} bytes, found {len(data)}")
    os.write(fd, data)


def readable(fd: int, timeout: float = 0.0) -> bool:
    """Whether ``fd`` (a pipe, a pidfd, a socket) has something to read within ``timeout`` seconds (0: now): data,
    its writer's close, or, for a pidfd, the process's exit. Any fd number, unlike ``select.select``."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(timeout, 0.0) * 1000))


def read_message(fd: int) -> dict[str, Any] | None:
    """The message on the pipe ``fd`` up to its writer's close (it blocks until then); None when it closed with none.
    ConfigError for anything but one JSON object."""
    chunks = []
    while chunk := os.read(fd, select.PIPE_BUF):
        chunks.append(chunk)
    return parse_message(b"".join(chunks))


def parse_message(data: bytes) -> dict[str, Any] | None:
    """``data`` read from a spare's pipe as its message: None for none (b""), ConfigError for anything but one JSON
    object. One read of a readable pipe returns a whole message (it is written whole, under PIPE_BUF)."""
    if not data:
        return None
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"a spare's pipe message is not JSON ({exc}): {data[:80]!r}") from None
    if not isinstance(message, dict):
        raise ConfigError(f"a spare's pipe message must be a JSON object, found {data[:80]!r}")
    return message


def announce_ready(ready_fd: int, ready: dict[str, Any]) -> None:
    """A spare's ready message ``ready`` on ``ready_fd``, which is then closed. EPIPE is no error: the controller
    took or released the spare before the message, and its start pipe says which."""
    with contextlib.suppress(BrokenPipeError):
        send_message(ready_fd, ready)
    os.close(ready_fd)


@dataclass(frozen=True)
class Slot:
    """A spare engine's start message: the slot it starts as (``{"port": P, "engine_id": ID, "log": PATH}``, each
    optional; None: keep its command's)."""

    port: int | None = None
    engine_id: str | None = None
    log: str | None = None

    @classmethod
    def of(cls, message: dict[str, Any]) -> Slot:
        """ConfigError for a malformed message, naming the field."""
        port, engine_id, log_file = message.get("port"), message.get("engine_id"), message.get("log")
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535):
            raise ConfigError(f"the start message's port must be an integer in 0..65535, found {port!r}")
        for name, value in (("engine_id", engine_id), ("log", log_file)):
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"the start message's {name} must be a string, found {value!r}")
        return cls(port, engine_id, log_file)

    def move_output(self) -> None:
        """Go on writing stdout and stderr to the slot's log file (appended to), if the message named one."""
        if self.log is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        for target in (1, 2):
            os.dup2(fd, target)
        os.close(fd)


def wait_for_start(start_fd: int, ready_fd: int | None, ready: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A spare: send ``ready`` (default ``{}``) on ``ready_fd`` and close it, then block until the controller sends
    the start message on ``start_fd`` (returned: start now, as it says) or closes it without one (None: not needed
    after all)."""
    try:
        if ready_fd is not None:
            announce_ready(ready_fd, ready or {})
        log.info("spare: ready and waiting on fd %d to start", start_fd)
        started = read_message(start_fd)
        os.close(start_fd)
    except OSError as exc:
        raise ConfigError(f"{START_FLAG} {start_fd} / {READY_FLAG} {ready_fd}: {exc.strerror}") from None
    if started is None:
        log.info("spare: released before it was needed")
    return started
