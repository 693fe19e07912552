"""The controller's side of its engine launcher (``standby.launcher``, ``cluster.launcher``): the launcher process
kept running beside the stack, and each engine start asked of it.

``Launcher.launch`` returns a ``Launched`` (Popen's stand-in: the child's pid, start time and pidfd, its exit
status reported on the request's connection) or None, and then the caller starts the engine with Popen as without
a launcher. None, with one log line per new reason, when the command is no engine command, or the launcher is
still importing, dead, refuses the request (a different environment, a command line too long) or does not answer
within ``REPLY_TIMEOUT_S`` (then it is killed and started again). The launcher is started with the first process
the stack starts, started again at once when it exits (after ``backoff_s`` when it keeps exiting), and stops with
the controller: its stdin is a pipe whose write end only this process holds, so it reads EOF whenever the
controller exits, however that happens. Its children run in their own sessions and outlive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from hotweights.cache.protocol import ProtocolError, recv_message, send_message
from hotweights.controller.executor import backoff_s
from hotweights.spawn import module_command, readable
from hotweights.standby.launchwire import ENGINE_COMMAND, REPLY_TIMEOUT_S, TITLE_ROOM, BadRequest, LaunchRequest

log = logging.getLogger(__name__)

LAUNCHER_MODULE = "hotweights.standby.launcher"
LAUNCHER_SOCKET, LAUNCHER_LOG = "launcher.sock", "launcher.log"  # in the stack's socket dir, in its log dir
REPORT_WAIT_S = 1.0  # after a launched child's exit, how long its status may take to come (the launcher reaps at once)
HEALTHY_AFTER_S = 60.0  # a launcher that ran this long before it exited starts again without backoff
STOP_S = 5.0  # a stopping stack waits this long for its launcher's exit (it exits at EOF on its stdin), then kills it


class Launched:
    """A child the launcher forked, for ``Supervisor``: ``pid``, ``start_time`` (/proc's), ``pidfd`` (ours to close)
    and, once reported, ``returncode`` (Popen's convention). ``poll`` and ``when_reported`` never block."""

    def __init__(self, pid: int, start_time: int, pidfd: int, conn: socket.socket) -> None:
        self.pid, self.start_time, self.pidfd = pid, start_time, pidfd
        self.conn = conn
        self.returncode: int | None = None
        self.waiting: asyncio.TimerHandle | None = None

    def poll(self) -> int | None:
        """The exit status if the launcher reported it; None while not, or if it never will (the launcher is gone).
        Once the connection has something to read (the status, or EOF) it is read and closed."""
        if self.returncode is None and self.conn.fileno() >= 0 and readable(self.conn.fileno()):
            with contextlib.suppress(OSError, ProtocolError, TimeoutError):
                message, _ = recv_message(self.conn, deadline=time.monotonic() + REPORT_WAIT_S)
                if type(message.get("exit")) is int:
                    self.returncode = message["exit"]
            self.close()
        return self.returncode

    def when_reported(self, then: Callable[[], None]) -> None:
        """Call ``then`` on the event loop once the status came (or the launcher hung up), at most ``REPORT_WAIT_S``
        from now: the child has exited (its pidfd said so) and the launcher reaps and reports it at once."""
        loop = asyncio.get_running_loop()

        def done() -> None:
            self._stop_waiting()
            self.poll()
            self.close()
            then()

        loop.add_reader(self.conn.fileno(), done)
        self.waiting = loop.call_later(REPORT_WAIT_S, done)

    def _stop_waiting(self) -> None:
        if self.waiting is not None:
            self.waiting.cancel()
            self.waiting = None
            asyncio.get_running_loop().remove_reader(self.conn.fileno())

    def close(self) -> None:
        """Stop listening for the status (the process is forgotten, or its status read)."""
        if self.conn.fileno() >= 0:
            self._stop_waiting()
            self.conn.close()


class Launcher:
    """The stack's launcher process, kept running while the controller runs (module docstring)."""

    def __init__(self, socket_path: Path, log_path: Path, env: dict[str, str]) -> None:
        self.socket_path = socket_path
        self.log_path = log_path
        self.env = env
        self.popen: subprocess.Popen | None = None
        self.started_at = 0.0
        self.failures = 0
        self.restart: asyncio.TimerHandle | None = None
        self.fallback = ""  # why the last start fell back to Popen ("": it did not)
        self.closed = False

    def command(self) -> list[str]:
        """Its command: the module, its socket, a padding argument as large as a child's command line may be."""
        return module_command(LAUNCHER_MODULE, "--socket", str(self.socket_path), f"--title-room={' ' * TITLE_ROOM}")

    def ensure(self) -> None:
        """Start the launcher unless one runs (or a restart waits out its backoff, or it was closed)."""
        if self.closed or self.restart is not None or (self.popen is not None and self.popen.poll() is None):
            return
        try:
            self.socket_path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()  # a killed launcher's: until the new one listens, none serves
            with _append(self.log_path) as out:
                self.popen = subprocess.Popen(
                    self.command(), stdin=subprocess.PIPE, stdout=out, stderr=out, start_new_session=True, env=self.env
                )
        except OSError as exc:  # tried again at the next start of a process
            self._fell_back(f"it cannot be started ({exc})")
            return
        self.started_at = time.monotonic()
        pidfd = os.pidfd_open(self.popen.pid)
        asyncio.get_running_loop().add_reader(pidfd, self._exited, self.popen, pidfd)
        log.info("engine launcher started (pid %d); its log: %s", self.popen.pid, self.log_path)

    def _exited(self, popen: subprocess.Popen, pidfd: int) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(pidfd)
        os.close(pidfd)
        code = popen.wait()
        if self.closed or popen is not self.popen:  # stopped on purpose, or already started again
            return
        self.failures = 0 if time.monotonic() - self.started_at > HEALTHY_AFTER_S else self.failures + 1
        delay = backoff_s(self.failures - 1) if self.failures > 1 else 0.0  # the first restart at once
        log.warning("engine launcher (pid %d) exited with %d; starting it again in %.1f s", popen.pid, code, delay)
        self.restart = loop.call_later(delay, self._restart)

    def _restart(self) -> None:
        self.restart = None
        self.ensure()

    def launch(
        self, command: list[str], env: dict[str, str] | None, pass_fds: tuple[int, ...], out: BinaryIO
    ) -> Launched | None:
        """Start ``command`` through the launcher (module docstring); None: start it with Popen. Starts the launcher
        first unless it runs, whatever the command (the stack's first process, its daemon, starts it)."""
        self.ensure()
        if tuple(command[: len(ENGINE_COMMAND)]) != ENGINE_COMMAND:
            return None
        request = LaunchRequest(tuple(command), dict(os.environ if env is None else env), pass_fds)
        try:
            request.check()
            launched = self._ask(request, out)
        except BadRequest as exc:
            return self._fell_back(f"it refused: {exc}")
        except (OSError, ProtocolError, TimeoutError) as exc:
            if self.importing():
                return self._fell_back("it is still importing", logging.INFO)
            return self._fell_back(f"it does not serve on {self.socket_path} ({exc})")
        if self.fallback:
            log.info("engines start through the launcher again")
            self.fallback = ""
        return launched

    def _ask(self, request: LaunchRequest, out: BinaryIO) -> Launched:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(REPLY_TIMEOUT_S)
            conn.connect(str(self.socket_path))
            send_message(conn, request.message(), [out.fileno(), *request.fds], deadline=deadline)
            try:
                reply, fds = recv_message(conn, max_fds=1, deadline=deadline)
            except TimeoutError:
                self.kill()  # a launcher that hangs: never asked again (its child, if any, is evicted as an orphan)
                raise
        except BaseException:
            conn.close()
            raise
        if reply.get("ok") is not True:
            conn.close()
            raise BadRequest(str(reply.get("message")))
        if len(fds) != 1 or type(reply.get("pid")) is not int or type(reply.get("start_time")) is not int:
            for fd in fds:
                os.close(fd)
            conn.close()
            raise ProtocolError(f"a launch reply must hold a pid, a start time and a pidfd, found {reply}")
        return Launched(reply["pid"], reply["start_time"], fds[0], conn)

    def importing(self) -> bool:
        """Whether it runs and has not listened yet (it listens once its imports are done)."""
        return self.popen is not None and self.popen.poll() is None and not self.socket_path.exists()

    def _fell_back(self, reason: str, level: int = logging.WARNING) -> None:
        if reason != self.fallback:
            log.log(level, "engine launcher: %s; starting engines as fresh processes meanwhile", reason)
            self.fallback = reason
        return None

    def kill(self) -> None:
        """SIGKILL it (it is started again, as after any exit)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()

    async def stop(self, timeout: float = STOP_S) -> None:
        """``close`` it and wait for its exit, SIGKILLing it after ``timeout``: a stopped stack leaves no launcher."""
        self.close()
        if self.popen is None:
            return
        try:
            await asyncio.to_thread(self.popen.wait, timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            await asyncio.to_thread(self.popen.wait)

    def close(self) -> None:
        """Stop it (EOF on its stdin) and never start it again; its socket is removed at once (a clean stop leaves
        none behind, whenever the launcher gets to exit)."""
        self.closed = True
        if self.restart is not None:
            self.restart.cancel()
            self.restart = None
        if self.popen is not None and self.popen.stdin is not None:
            self.popen.stdin.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()


def _append(path: Path) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "ab")
