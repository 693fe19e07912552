"""The engine server ``hotweights agent`` runs as its child: started under ``hotweights agent-guard`` on a free
loopback port, at a lower priority than the agent (``ENGINE_NICE``), with its output in a log file of its own, judged
ready (its own health endpoint, then one one-token completion), stopped with its whole process group.

A spare agent's engine (``standby.agentspare``) logs to ``<engine id>.<agent pid>.engine.log``, one file per spare,
renamed after the slot when the spare starts as its engine; every other engine to ``<engine id>.engine.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from hotweights.contract import Endpoint
from hotweights.engines import PORT_PLACEHOLDER, EngineKind
from hotweights.errors import ConfigError
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 15
# The engine server's niceness: the agent (and the controller and gateway beside it) before any engine server when
# they compete for the cores, so that the agent answers its health checks while servers start beside the one it
# fronts (measured on 2 shared cores, a vLLM primary at 10 requests/s while two more vLLM servers started: the
# agent's /health/ready p99 115 ms, max 177 ms at the same niceness; 33 ms, max 40 ms with 10). Servers compete
# among themselves as before.
ENGINE_NICE = 10
KEEPALIVE_S = 2.0  # below the engine's (uvicorn's 5 s), so a pooled connection is never reused as it closes
READY_POLL_S = 0.2


def engine_command(command: list[str], port: int) -> list[str]:
    """The engine's argv with ``{port}`` replaced; ConfigError when it does not name its port."""
    if not any(PORT_PLACEHOLDER in arg for arg in command):
        raise ConfigError(f"the engine command must take its port as {PORT_PLACEHOLDER} (e.g. --port {{port}})")
    return [arg.replace(PORT_PLACEHOLDER, str(port)) for arg in command]


def engine_log(log_dir: Path, engine_id: str, spare_pid: int | None = None) -> Path:
    """Where an engine's output goes (module docstring); ``spare_pid``: the spare agent's pid, for a spare's."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id) + (f".{spare_pid}" if spare_pid is not None else "")
    return log_dir / f"{name}.engine.log"


@dataclass
class EngineChild:
    """The engine (under its guard), its log file, and how it ended."""

    process: subprocess.Popen  # the guard; the engine is its one child and leads its own process group
    log_path: Path
    port: int
    started: float = field(default_factory=time.monotonic)
    _engine_pid: int | None = None

    @property
    def engine_pid(self) -> int | None:
        """The engine's own pid (the guard's child), once it runs."""
        if self._engine_pid is None:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
            with contextlib.suppress(OSError, ValueError, IndexError):  # IndexError: not forked yet
                self._engine_pid = int(children.read_text().split()[0])
        return self._engine_pid

    def kill_group(self) -> None:
        """SIGKILL whatever is left of the engine's process group (when the guard could not: it died)."""
        if self.engine_pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.engine_pid, signal.SIGKILL)

    def move_log(self, path: Path) -> None:
        """Name the engine's log ``path`` from now on (the engine goes on writing to the same file)."""
        os.rename(self.log_path, path)
        self.log_path = path

    def tail(self) -> str:
        """The engine log's last lines, one string (for errors and events)."""
        try:
            with self.log_path.open(errors="replace") as lines:
                return " | ".join(line.rstrip() for line in deque(lines, LOG_TAIL_LINES) if line.strip())
        except OSError:
            return "(no log)"

    def exit_text(self) -> str:
        """How the engine ended: the guard exits with the engine's code, or 128 + the signal that ended it."""
        code = self.process.returncode
        if code is not None and code < 0:
            how = f"signal {-code} (to its guard)"
        else:
            how = f"signal {code - 128}" if code is not None and code > 128 else f"code {code}"
        lived = time.monotonic() - self.started
        return f"the engine exited with {how} after {lived:.1f} s; last log lines: {self.tail()}"


def start_engine(command: list[str], log_path: Path) -> EngineChild:
    """The guard (and through it the engine) as our child; the engine's output goes to ``log_path``."""
    port = free_port()
    guard = ("agent-guard", "--parent", str(os.getpid()), "--nice", str(ENGINE_NICE))
    argv = hotweights_command(*guard, "--", *engine_command(command, port))
    with log_path.open("ab") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    log.info("engine starting (pid %d via guard, port %d), log %s", process.pid, port, log_path)
    return EngineChild(process, log_path, port)


def engine_client(child: EngineChild) -> httpx.AsyncClient:
    """A client of the engine's server (one per event loop: its pooled connections belong to the loop)."""
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{child.port}",
        timeout=httpx.Timeout(None, connect=5.0),
        limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
    )


async def wait_ready(
    kind: EngineKind, child: EngineChild, engine_id: str, client: httpx.AsyncClient, timeout_s: float
) -> str:
    """Until the engine's health answers 200 and one one-token completion succeeds: the served model's id.
    ConfigError ``timeout_s`` after the engine's start or when the engine exits, naming its last log lines."""
    deadline = child.started + timeout_s
    while True:
        if child.process.poll() is not None:
            raise ConfigError(f"{engine_id}: {child.exit_text()}")
        child.engine_pid  # noqa: B018 - learn it now, while the guard lives, for kill_group
        if time.monotonic() > deadline:
            raise ConfigError(
                f"{engine_id}: the engine did not become ready on port {child.port} within {timeout_s:g} s "
                f"(does its command listen on {PORT_PLACEHOLDER}?); last log lines: {child.tail()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get(kind.health)).status_code == 200:
                model = (await client.get(Endpoint.MODELS)).json()["data"][0]["id"]
                probe = {"model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0}
                if (await client.post(Endpoint.COMPLETIONS, json=probe)).status_code == 200:
                    return model
        await asyncio.sleep(READY_POLL_S)


async def engine_exit(child: EngineChild) -> None:
    """Returns the instant the engine's guard exits (a pidfd turns readable), without a thread; reaped."""
    ended, loop = asyncio.Event(), asyncio.get_running_loop()
    pidfd = os.pidfd_open(child.process.pid)
    loop.add_reader(pidfd, ended.set)
    try:
        await ended.wait()
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    child.process.wait()


def stop_engine(child: EngineChild, timeout_s: float) -> None:
    """SIGTERM to the guard (it stops the engine's group), SIGKILL after ``timeout_s``; then whatever
    is left of the group, should the guard have died before the engine."""
    if child.process.poll() is None:
        child.process.terminate()
        try:
            child.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
    child.kill_group()
