"""uvicorn as our long-running HTTP processes (engine, gateway) run it.

They announce one JSON line on stdout once they listen (the real port, also for ``--port 0``), so a
supervisor or a test can wait for it; and a SIGTERM/SIGINT that uvicorn handled gracefully ends the
process with exit code 0 instead of uvicorn re-raising the signal after its clean stop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from types import FrameType

import uvicorn

log = logging.getLogger(__name__)


class AnnouncingServer(uvicorn.Server):
    """uvicorn printing ``{"event": "ready", "port", "pid", **ready}`` on stdout once it listens."""

    def __init__(self, config: uvicorn.Config, ready: dict[str, object] | None = None) -> None:
        super().__init__(config)
        self.ready = ready or {}

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1]
            log.info("serving on http://%s:%d", self.config.host, port)
            print(json.dumps({"event": "ready", "port": port, "pid": os.getpid()} | self.ready), flush=True)


def run_until_signal(server: uvicorn.Server) -> str | None:
    """Run ``server``; return the name of the signal it stopped for (None if it stopped by itself).

    uvicorn restores the handlers it found and re-raises the signal it caught once it has shut down
    gracefully; handlers that only record the signal make that re-raise harmless."""
    caught: list[int] = []

    def record(sig: int, _: FrameType | None) -> None:
        caught.append(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, record)
    server.run()
    return signal.Signals(caught[0]).name if caught else None
