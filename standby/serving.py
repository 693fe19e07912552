"""uvicorn as our long-running HTTP processes (engine, gateway) run it.

They bind their port first, before loading anything (``bind_port``), so a taken port is one line and exit
code 2 at once rather than a uvicorn log line after minutes of loading; they announce one JSON line on stdout
once they listen (the real port, also for ``--port 0``), so a supervisor or a test can wait for it; and a
SIGTERM/SIGINT that uvicorn handled gracefully ends the process with exit code 0 instead of uvicorn
re-raising the signal after its clean stop.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
from types import FrameType

import uvicorn

from hotweights.errors import HotweightsError

log = logging.getLogger(__name__)


class PortUnavailable(HotweightsError):
    """The address to listen on is taken or cannot be bound here."""


def _unavailable(host: str, port: int, exc: OSError) -> PortUnavailable:
    if exc.errno == errno.EADDRINUSE:
        return PortUnavailable(f"{host}:{port} is in use by another process: stop it or choose another port")
    return PortUnavailable(f"cannot listen on {host}:{port}: {exc.strerror}")


def bind_port(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: a free one), not yet listening: until
    ``run_until_signal`` listens on it, connections are refused rather than left waiting. SO_REUSEADDR, as
    uvicorn sets it, so a restart on the same port need not wait out TIME_WAIT; IPPROTO_TCP named, as
    getaddrinfo would, because asyncio sets TCP_NODELAY only on sockets that say so (without it every small
    response waits out Nagle and delayed ACKs). ``reuse_port``: SO_REUSEPORT, so that another socket of
    our uid with it set may bind the same port beside this one (the kernel spreads connections over
    them). Raises PortUnavailable."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise _unavailable(host, port, exc) from None
    return sock


class AnnouncingServer(uvicorn.Server):
    """uvicorn printing ``{"event": "ready", "port", "pid", **ready}`` on stdout once it listens. It reads
    ``uvicorn.Server``'s ``started`` and ``servers``, which are not uvicorn's public API: pyproject.toml pins the
    uvicorn release this is tested with."""

    def __init__(self, config: uvicorn.Config, ready: dict[str, object] | None = None) -> None:
        super().__init__(config)
        self.ready = ready or {}

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1]
            log.info("serving on http://%s:%d", self.config.host, port)
            print(json.dumps({"event": "ready", "port": port, "pid": os.getpid()} | self.ready), flush=True)


def is_listening(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def run_until_signal(server: uvicorn.Server, *sockets: socket.socket) -> str | None:
    """Listen on each TCP socket of ``sockets`` (from ``bind_port``; one a supervisor handed over already
    listens) and run ``server`` on them all; return the name of the signal it stopped for (None if it
    stopped by itself), after logging it. Raises PortUnavailable if another process bound the same port
    meanwhile and listened first.

    uvicorn restores the handlers it found and re-raises the signal it caught once it has shut down
    gracefully; handlers that only record the signal make that re-raise harmless."""
    for sock in sockets:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not is_listening(sock):
            host, port = sock.getsockname()[:2]
            try:
                sock.listen(server.config.backlog)
            except OSError as exc:
                raise _unavailable(host, port, exc) from None
    caught: list[int] = []

    def record(sig: int, _: FrameType | None) -> None:
        caught.append(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, record)
    server.run(sockets=list(sockets))
    stopped_by = signal.Signals(caught[0]).name if caught else None
    log.info("stopped%s", f" on {stopped_by}" if stopped_by else "")
    return stopped_by
