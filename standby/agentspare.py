"""A spare ``hotweights agent`` (``--start-fd``, ``controller.spares``): a vLLM or SGLang server started ahead of
need, held until a slot needs it.

The agent starts its engine server at once (on CPU most of a start, 28-41 s), with no port of its own yet, on the
spare's share of the CPUs (``standby.pacing.CpuShare``: the agent narrows its own set first, the server inherits
it), so that a server starting beside a serving group leaves the rest to it; and it waits until the engine is ready
by the agent's own check (``agentengine.wait_ready``); then it sends its ready message, what the engine holds
(``held``), and waits for the start message. The start message names the slot (port, engine id, log file): the
agent gives every process and thread of its engine the whole CPU set back, moves its output to the slot's log, names
its engine's log after the slot, binds the slot's port and serves as the slot's engine, ready at once. Taken before
its engine is ready, it binds the port at once and goes on waiting there, as a fresh agent does.

A spare released (its start pipe closed without a message), or sent SIGTERM or SIGINT while it waits, stops its
engine server and the whole process group (``agentengine.stop_engine``), removes the engine's log and exits 0. An
engine that exits, or is not ready within the agent's ``--ready-timeout``, ends the spare with the reason
(exit 1): the controller counts it as the group's spare failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from hotweights.engines import EngineKind
from hotweights.errors import ConfigError
from hotweights.proctree import descendants, device_bytes_of, tree_rss_bytes
from hotweights.spawn import Slot, announce_ready, read_message
from hotweights.standby.agentengine import EngineChild, engine_client, engine_exit, wait_ready

log = logging.getLogger(__name__)
T = TypeVar("T")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class Started:
    """A spare's start: the slot, and the served model's id if its engine was ready before (None: not yet)."""

    slot: Slot
    model: str | None


def held(child: EngineChild) -> dict[str, int]:
    """The ready message: what the spare's engine holds, resident host memory of its process tree (``host_bytes``)
    and, where ``nvidia-smi`` lists one of its processes, device memory (``device_bytes``)."""
    tree = child.process.pid
    holds = {"host_bytes": tree_rss_bytes(tree) or 0}
    device = device_bytes_of([tree, *descendants(tree)])
    return holds if device is None else holds | {"device_bytes": device}


async def first_of(work: Coroutine[Any, Any, T], *events: asyncio.Event) -> T | None:
    """``work``'s result (its exception raised), or None once one of ``events`` is set first (``work`` is then
    cancelled and awaited)."""
    task = asyncio.ensure_future(work)
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    await asyncio.wait([task, *waits], return_when=asyncio.FIRST_COMPLETED)
    pending = [t for t in (task, *waits) if not t.done()]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return task.result() if task.done() and not task.cancelled() else None


async def wait_as_spare(
    kind: EngineKind, child: EngineChild, engine_id: str, ready_s: float, start_fd: int, ready_fd: int
) -> Started | None:
    """The spare's wait (module docstring), on the event loop it runs on: its start, or None once it is released
    or signalled to stop. ConfigError when its engine exits or is not ready within ``ready_s``. Closes both
    pipes."""
    loop = asyncio.get_running_loop()
    start, stop = asyncio.Event(), asyncio.Event()
    loop.add_reader(start_fd, start.set)  # the start message, or the pipe's close
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        async with engine_client(child) as client:
            model = await first_of(wait_ready(kind, child, engine_id, client, ready_s), start, stop)
        if model is not None:
            holds = held(child)
            log.info("spare: engine ready in %.1f s, holding %s; waiting for a slot", time.monotonic() - child.started,
                     ", ".join(f"{key} {value >> 20} MiB" for key, value in holds.items()))  # fmt: skip
            announce_ready(ready_fd, holds)
            ready_fd = -1
            await first_of(engine_exit(child), start, stop)
            if child.process.poll() is not None:
                raise ConfigError(f"{engine_id}: {child.exit_text()}")
    finally:
        loop.remove_reader(start_fd)
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        if ready_fd >= 0:
            os.close(ready_fd)
    if not start.is_set():
        os.close(start_fd)
        return None
    try:
        message = read_message(start_fd)  # the controller closes the pipe right after its message
    finally:
        with contextlib.suppress(OSError):
            os.close(start_fd)
    return None if message is None else Started(Slot.of(message), model)
