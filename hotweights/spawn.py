"""The one way a hotweights process starts another: ``[sys.executable, "-m", "hotweights", ...]``.

Children run this interpreter's installed package, never whatever ``cache/`` or ``controller/``
folder happens to lie in the current directory, and nothing sets or extends ``PYTHONPATH``.

Spares (``controller.spares``): an engine or cache daemon started with START_FLAG and READY_FLAG does its
imports, says so with one byte on its ready pipe, and waits on its start pipe (``wait_for_start``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from dataclasses import dataclass

from hotweights.errors import ConfigError

log = logging.getLogger(__name__)

START_FLAG, READY_FLAG = "--start-fd", "--ready-fd"


def hotweights_command(*args: str, python: str | None = None) -> list[str]:
    """The argv that runs ``hotweights ARGS...`` with this interpreter, or with ``python`` (another
    environment that has hotweights installed, e.g. vLLM's)."""
    return [python or sys.executable, "-m", "hotweights", *args]


def add_spare_arguments(parser: argparse.ArgumentParser, starts: str) -> None:
    """START_FLAG and READY_FLAG; ``starts``: what the process does once started (for the help)."""
    parser.add_argument(
        START_FLAG,
        type=int,
        metavar="FD",
        help=f"start as a spare: import everything, then wait for one byte on the inherited FD before {starts} "
        "(EOF: exit 0 without starting); the controller keeps one per group",
    )
    parser.add_argument(
        READY_FLAG, type=int, metavar="FD", help=f"with {START_FLAG}: write one byte to this inherited FD once imported"
    )


@dataclass(frozen=True)
class SparePipes:
    """The two pipes of a spare about to be spawned: ``flags`` for its command, ``theirs`` for it to inherit (close
    them here once it is spawned), and our ends: the start pipe's write end and the ready pipe's read end."""

    flags: tuple[str, ...]
    theirs: tuple[int, int]
    start_fd: int
    ready_fd: int

    @classmethod
    def open(cls) -> SparePipes:
        (start_read, start_write), (ready_read, ready_write) = os.pipe(), os.pipe()
        flags = (START_FLAG, str(start_read), READY_FLAG, str(ready_write))
        return cls(flags, (start_read, ready_write), start_write, ready_read)

    def close_theirs(self) -> None:
        for fd in self.theirs:
            os.close(fd)


def wait_for_start(start_fd: int, ready_fd: int | None) -> bool:
    """A spare: say so on ``ready_fd`` (one byte, then closed), then block until the controller writes a byte to
    ``start_fd`` (start now) or closes it without one (not needed after all); whether to start."""
    try:
        if ready_fd is not None:
            # EPIPE: the controller took or released us before the byte; the start pipe says which
            with contextlib.suppress(BrokenPipeError), os.fdopen(ready_fd, "wb", buffering=0) as ready:
                ready.write(b"1")
        log.info("spare: imported and waiting on fd %d to start", start_fd)
        with os.fdopen(start_fd, "rb", buffering=0) as start:
            started = bool(start.read(1))
    except OSError as exc:
        raise ConfigError(f"{START_FLAG} {start_fd} / {READY_FLAG} {ready_fd}: {exc.strerror}") from None
    if not started:
        log.info("spare: released before it was needed")
    return started
