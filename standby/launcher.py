"""``python -m hotweights.standby.launcher``: a stack's engine launcher, a fork server with the engine's imports done.

Importing torch and the engine takes seconds per process (more on a busy host); a controller that starts every
engine as a fresh ``python -m hotweights engine`` pays them on the critical path of every replacement after a
fault. The launcher pays them once: it imports the engine's modules (never initialising CUDA, never running a
torch op, starting no Python thread: ``fork_refusal`` checks), listens on a Unix socket (mode 0600, our uid
only) and, for each request (``standby.launchwire``), forks a child that becomes the engine process a fresh
start would have been:

- its own session (``setsid``, as ``start_new_session``), signal dispositions and mask as a fresh interpreter's;
- stdin /dev/null, stdout and stderr the passed log, the other passed fds under the numbers the request names,
  every other fd closed (the listener, other children's connections);
- ``os.environ`` the requested environment, which must be the launcher's own (``env_refusal``: variables read
  at import time were read with it); ``/proc/PID/environ`` shows the launcher's, which carries the stack's marker;
- ``/proc/PID/cmdline`` its argv (``TitleArea``: the launcher starts with a padding argument, and the child
  writes its argv, NUL-terminated, over that area, the rest NULs), so that every check that identifies a process
  by its command line (re-adoption, orphans, spares) reads it as if it had been exec'd;
- then ``hotweights.cli.main(argv)`` and ``os._exit`` with its status.

The launcher reaps its children and sends each one's exit status on the connection its request came on, which
stays open for the child's life. It exits on SIGTERM or SIGINT, or when its stdin reaches EOF (its controller is
gone), leaving its children running: they are the stack's engines, stopped as engines are. A native thread pool
that a library starts at import (OpenBLAS's, through numpy) shuts itself down around a fork (pthread_atfork).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import importlib.util
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from importlib import import_module
from pathlib import Path

from hotweights.cache.protocol import ProtocolError, recv_message, send_message
from hotweights.errors import HotweightsError
from hotweights.standby.launchwire import REPLY_TIMEOUT_S, TITLE_ROOM, BadRequest, LaunchRequest, title_bytes

log = logging.getLogger(__name__)

PRELOADED = ("hotweights.cli", "hotweights.standby.engine")  # what ``hotweights engine`` imports before its work
# Where Triton is installed, the modules of the engine's kernels too: the first import of one hashes Triton's own
# library for its cache keys (2.2 s on 2 busy cores), which every child then inherits done.
KERNELS = ("hotweights.standby.fusedkernels", "hotweights.standby.decodekernels")
REQUEST_TIMEOUT_S = 5.0  # a connection's request must arrive whole within this
# The dispositions CPython sets at its start; every other signal has its default.
FRESH_SIGNALS = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGPIPE: signal.SIG_IGN,
    signal.SIGXFSZ: signal.SIG_IGN,
}
PEERCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


class TitleArea:
    """This process's argument area (``arg_start``..``arg_end``, /proc/self/stat fields 48-49), which
    ``/proc/PID/cmdline`` reads; a forked child writes its own argv there (``write``)."""

    def __init__(self) -> None:
        stat = Path("/proc/self/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # field 3 onwards
        self.start, self.end = int(fields[45]), int(fields[46])

    @property
    def room(self) -> int:
        return self.end - self.start

    def write(self, argv: tuple[str, ...]) -> None:
        """Overwrite the area with ``argv``, NUL-terminated, and NULs to its end (whose last byte, NUL, tells the
        kernel to show the area as arguments); the caller checked that it fits (``LaunchRequest.check``)."""
        data = title_bytes(argv)
        ctypes.memmove(self.start, data + bytes(self.room - len(data)), self.room)


def fork_refusal() -> str | None:
    """Why this process must not fork engines, None when it may: another Python thread runs, or CUDA is
    initialised (a forked child could not use it)."""
    import torch

    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads run after the imports (expected 1)"
    if torch.cuda.is_initialized():
        return "CUDA was initialised by the imports"
    return None


def env_refusal(env: dict[str, str], own: dict[str, str]) -> str | None:
    """Why a child may not run with ``env``, None when it may: the launcher imported with ``own``, so a variable
    read at import time (OMP_NUM_THREADS, TORCH_*) must not differ; any difference is refused."""
    differing = sorted(key for key in env.keys() | own.keys() if env.get(key) != own.get(key))
    if differing:
        return f"env differs from the launcher's in {', '.join(differing[:5])}: expected the launcher's environment"
    return None


class Launcher:
    """The serving loop: one thread, a selector over the listener, stdin, the signals' wake-up pipe and the
    connections of running children."""

    def __init__(self, listener: socket.socket, title: TitleArea) -> None:
        self.listener = listener
        self.title = title
        self.env = dict(os.environ)
        self.children: dict[int, socket.socket | None] = {}  # pid -> its request's connection (None: closed)
        self.selector = selectors.DefaultSelector()
        self.stopping = ""
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up pipe does the rest
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda sig, _: setattr(self, "stopping", signal.Signals(sig).name))
        self.selector.register(listener, selectors.EVENT_READ, self._accept)
        self.selector.register(0, selectors.EVENT_READ, self._stdin)
        self.selector.register(self.wake_r, selectors.EVENT_READ, self._reap)

    def serve(self) -> int:
        """Until a signal or EOF on stdin; 0."""
        while not self.stopping:
            for key, _ in self.selector.select():
                handler: Callable[[], None] = key.data
                handler()
        log.info("stopping (%s); %d child(ren) left running, in their own sessions", self.stopping, len(self.children))
        return 0

    def _stdin(self) -> None:
        if not os.read(0, 4096):
            self.stopping = "its controller is gone (EOF on stdin)"

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError):
            conn, _ = self.listener.accept()
            self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        """One request: refused with one log line, or forked, its connection kept until the child's exit."""
        fds: list[int] = []
        try:
            _, uid, _ = PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
            if uid != os.getuid():
                raise BadRequest(f"peer uid must be {os.getuid()}, found {uid}")
            message, fds = recv_message(conn, max_fds=8, deadline=time.monotonic() + REQUEST_TIMEOUT_S)
            request = LaunchRequest.parse(message, len(fds))
            if refusal := env_refusal(request.env, self.env):
                raise BadRequest(refusal)
        except (BadRequest, ProtocolError, TimeoutError, OSError) as exc:
            self._refuse(conn, fds, "refused" if isinstance(exc, BadRequest) else "bad_message", f"{exc}")
            return
        try:
            pid = self._fork(conn, request, fds)
        except OSError as exc:  # EAGAIN, ENOMEM: the controller starts this one with Popen
            self._refuse(conn, fds, "refused", f"cannot fork: {exc}")
            return
        self._launch(conn, request, pid)

    @staticmethod
    def _refuse(conn: socket.socket, fds: list[int], error: str, message: str) -> None:
        """One log line and the refusal; the passed fds and the connection closed."""
        log.warning("refused a request: %s", message)
        with contextlib.suppress(OSError, ProtocolError, TimeoutError):
            send_message(conn, {"ok": False, "error": error, "message": message}, deadline=_deadline())
        for fd in fds:
            os.close(fd)
        conn.close()

    def _launch(self, conn: socket.socket, request: LaunchRequest, pid: int) -> None:
        pidfd = os.pidfd_open(pid)  # our unreaped child: the pid is its until we reap it
        try:
            reply = {"ok": True, "pid": pid, "start_time": _start_time(pid)}
            send_message(conn, reply, [pidfd], deadline=_deadline())
        except (OSError, ProtocolError, TimeoutError) as exc:  # nobody will supervise it: it must not run
            log.warning("child %d: its requester is gone (%s); killed", pid, exc)
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            conn.close()
            self.children[pid] = None
            return
        finally:
            os.close(pidfd)
        self.children[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, lambda: self._hung_up(pid))
        log.info("started pid %d: %s", pid, " ".join(request.argv[3:]))

    def _fork(self, conn: socket.socket, request: LaunchRequest, fds: list[int]) -> int:
        """Fork the child (``become``); return once it wrote its command line (or died)."""
        written_r, written_w = os.pipe2(os.O_CLOEXEC)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError:
            os.close(written_r)
            os.close(written_w)
            raise
        if pid == 0:
            try:
                os.close(written_r)
                self._close_for_child(conn)
            except BaseException:
                os._exit(1)
            become(request, fds, self.title, written_w)  # never returns
        os.close(written_w)
        for fd in fds:
            os.close(fd)
        os.read(written_r, 1)  # EOF: the child wrote its command line, or died
        os.close(written_r)
        return pid

    def _close_for_child(self, conn: socket.socket) -> None:
        """In the child: close what the launcher owns through Python objects (the rest ``become`` closes by number)."""
        signal.set_wakeup_fd(-1)
        self.selector.close()
        self.listener.close()
        conn.close()
        for child_conn in self.children.values():
            if child_conn is not None:
                child_conn.close()

    def _hung_up(self, pid: int) -> None:
        """The requester closed a running child's connection (its controller left): the child goes on, unreported."""
        conn = self.children.get(pid)
        if conn is not None:
            self.selector.unregister(conn)
            conn.close()
            self.children[pid] = None

    def _reap(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            log.info("child %d exited (%d)", pid, code)
            conn = self.children.pop(pid, None)
            if conn is not None:
                self.selector.unregister(conn)
                with contextlib.suppress(OSError, ProtocolError, TimeoutError):
                    send_message(conn, {"exit": code}, deadline=_deadline())
                conn.close()


def become(request: LaunchRequest, fds: list[int], title: TitleArea, written_fd: int) -> None:
    """The forked child: become the requested engine process (module docstring), run it, exit with its status."""
    code = 1
    try:
        os.setsid()
        reset_signals()
        title.write(request.argv)
        os.close(written_fd)
        arrange_fds(fds, request.fds)
        os.environ.clear()
        os.environ.update(request.env)
        code = run_cli(request.argv)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def reset_signals() -> None:
    """Every disposition and the mask as a freshly started interpreter has them."""
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):  # SIGKILL, SIGSTOP and the C library's own
            signal.signal(sig, FRESH_SIGNALS.get(sig, signal.SIG_DFL))
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def arrange_fds(fds: list[int], targets: tuple[int, ...]) -> None:
    """stdin /dev/null, stdout and stderr ``fds[0]``, ``fds[i]`` at ``targets[i - 1]``; every other fd closed."""
    above = max((2, *targets)) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]  # out of every target's way
    for fd in fds:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    if null != 0:
        os.close(null)
    for target, fd in ((1, moved[0]), (2, moved[0]), *zip(targets, moved[1:], strict=True)):
        os.dup2(fd, target)  # inheritable, as pass_fds makes them
    keep = {0, 1, 2, *targets}
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in keep:
            with contextlib.suppress(OSError):  # the listing's own fd, closed already
                os.close(int(name))


def run_cli(argv: tuple[str, ...]) -> int:
    """``hotweights.cli.main`` on the arguments after ``python -m hotweights``, as a fresh process would: the root
    logger unconfigured (its ``basicConfig`` applies), ``sys.argv`` as ``-m`` sets it; its exit status."""
    cli = import_module("hotweights.cli")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    sys.argv = [str(Path(cli.__file__).with_name("__main__.py")), *argv[3:]]
    try:
        return cli.main(list(argv[3:]))
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1


def _deadline() -> float:
    return time.monotonic() + REPLY_TIMEOUT_S


def _start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


@contextlib.contextmanager
def listening(path: Path):
    """A Unix socket listening at ``path``, mode 0600 (a stale one replaced), removed at the end."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(previous)  # the children's, as the controller's
    listener.listen(16)
    listener.setblocking(False)
    try:
        yield listener
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hotweights.standby.launcher", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, type=Path, help="the Unix socket to listen on")
    parser.add_argument("--title-room", default="", help="padding (spaces): the room a child's command line has")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    for module in PRELOADED + (KERNELS if importlib.util.find_spec("triton") else ()):
        import_module(module)
    title = TitleArea()
    refusal = fork_refusal() or (f"the argument area holds {title.room} bytes" if title.room < TITLE_ROOM else None)
    if refusal:
        print(f"hotweights launcher: error: {refusal}; engines start as fresh processes", file=sys.stderr)
        return 2
    try:
        with listening(args.socket) as listener:
            log.info("imports done in %.3f s; serving on %s", time.perf_counter() - start, args.socket)
            return Launcher(listener, title).serve()
    except (OSError, HotweightsError) as exc:
        print(f"hotweights launcher: error: {args.socket}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
