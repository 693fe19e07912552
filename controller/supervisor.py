"""Start, adopt, watch and stop the stack's processes: mechanism only (``ha.py`` decides).

Every process runs in its own session with its output appended to ``state_dir/logs/<id>.log``, so
engines, daemons and the gateway outlive the controller. Each carries its stack's state dir in its environment
(``STACK_ENV``; its children inherit it), so ``hotweights down`` finds every process of a stack, whatever the
records say. Exits are seen through pidfds registered
with the event loop: no polling delay, and it works for processes a previous controller started
(they are not our children). A recorded process is adopted only if its pid is alive with the
recorded start time and command line, so a reused pid is never mistaken for ours. Signals go
through the pidfd, so they can never reach a process that merely inherited the pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from hotweights.controller.launcherclient import LAUNCHER_LOG, LAUNCHER_SOCKET, Launched, Launcher
from hotweights.errors import ConfigError
from hotweights.pidlock import LockHeld, PidLock, is_held
from hotweights.proctree import descendants, is_exiting, is_stopped
from hotweights.spawn import readable
from hotweights.state import ProcessRecord

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # SIGTERM -> SIGKILL for a planned stop
FENCE_TIMEOUT_S = 5.0  # SIGKILL -> exit; longer means the process is stuck in the kernel
EXITING_POLL_S = 0.01  # how often the processes watched for an early exit (primaries) are read from /proc
# A watched process seen stopped this long is reported (``on_stopped``): it runs nothing until it is continued, and
# ``controller.health.process_stopped`` fails it then, without waiting for a health check's timeout.
STOPPED_FOR_S = 0.05
STACK_ENV = "HOTWEIGHTS_STACK"  # in the environment of every process a controller starts: its resolved state dir


Identity = ProcessRecord  # what tells a live process from another one that reused its pid


def read_identity(pid: int) -> Identity | None:
    """The identity of a live (not zombie) pid, None if it is gone. The command line ends at its last non-empty
    argument: an engine the launcher forked shows its argv followed by NULs (``standby.launcher``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw_command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # comm may hold spaces and parentheses; fields 3.. follow
    if fields[0] in ("Z", "X"):
        return None
    return Identity(pid, int(fields[19]), command_identity(raw_command.decode(errors="replace").split("\0")))


def command_identity(command: list[str]) -> tuple[str, ...]:
    """A command line as an identity holds it: without trailing empty arguments (``read_identity``)."""
    return tuple(command[: max((i + 1 for i, arg in enumerate(command) if arg), default=0)])


def _session(pid: int) -> int | None:
    """The session id of a live (not zombie) pid; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[3])


def session_members(sid: int) -> list[int]:
    """The live processes of session ``sid``, read from /proc."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _session(int(p.name)) == sid]


def _kill_in_session(pid: int, sid: int) -> None:
    """SIGKILL ``pid`` through a pidfd, once that pidfd is known to name a process of session ``sid``."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if _session(pid) == sid:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)


def _start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def exit_reason(returncode: int | None) -> str:
    if returncode is None:
        return "exited"  # not our child: the status went to its new parent
    if returncode < 0:
        return f"exited (signal {-returncode}, {signal.Signals(-returncode).name})"
    return f"exited with code {returncode}"


@dataclass(eq=False)
class Process:
    """One supervised process. ``exited`` is set by the event loop the moment the process ends."""

    id: str
    identity: Identity
    pidfd: int
    popen: subprocess.Popen | Launched | None  # None when adopted from a previous controller
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    exit_reason: str | None = None
    exited_at: float | None = None  # time.monotonic()
    exiting_at: float | None = None  # when every thread was seen exiting (watched processes only)
    stopped_at: float | None = None  # since when it has been seen stopped (watched processes only; None: running)
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # exiting seen, or exited: it never answers again

    @property
    def pid(self) -> int:
        return self.identity.pid

    @property
    def alive(self) -> bool:
        return not self.exited.is_set()

    def record(self) -> ProcessRecord:
        return self.identity


class Supervisor:
    """Owns the pidfds; ``on_exit`` runs on the event loop right after a watched process ends."""

    def __init__(
        self,
        log_dir: Path,
        on_exit: Callable[[Process], None],
        stack: str = "",
        launcher_dir: Path | None = None,
        on_stopped: Callable[[Process], None] = lambda _: None,
    ) -> None:
        """``on_exit`` also runs when a process watched for an early exit is seen exiting (``exiting_at``), and
        ``on_stopped`` once one has been seen stopped for STOPPED_FOR_S (``stopped_at``);
        ``stack``: the ``STACK_ENV`` value of the processes it starts (``stack_marker``; "": none); ``launcher_dir``:
        where the socket of the launcher that forks its engines is (``controller.launcherclient``; None: none)."""
        self.log_dir = log_dir
        env = {**os.environ, STACK_ENV: stack} if stack else dict(os.environ)
        self.launcher = Launcher(launcher_dir / LAUNCHER_SOCKET, log_dir / LAUNCHER_LOG, env) if launcher_dir else None
        self.stack = stack
        self.on_exit = on_exit
        self.on_stopped = on_stopped
        self.processes: dict[str, Process] = {}
        self.early: set[Process] = set()  # watched for the first sign of their exit
        self.stops_reported: set[Process] = set()  # of them, stopped ones ``on_stopped`` was run for
        self.early_watch: asyncio.Task | None = None

    def log_path(self, log_id: str) -> Path:
        """The file a process spawned with ``log_id`` appends its output to."""
        return self.log_dir / f"{log_id}.log"

    def spawn(
        self,
        process_id: str,
        command: list[str],
        env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
        log_id: str | None = None,
    ) -> Process:
        """Start ``command`` in a new session (it outlives us), output appended to the log of ``log_id``
        (default ``process_id``); ``env``: its environment (None: ours), with ``STACK_ENV``; ``pass_fds``: our
        fds it inherits under the same numbers. An engine is forked by the launcher when it serves."""
        if self.stack:
            env = {**(os.environ if env is None else env), STACK_ENV: self.stack}
        with self._open_log(log_id or process_id) as out:
            launched = self.launcher.launch(command, env, pass_fds, out) if self.launcher else None
            if launched is not None:
                identity = Identity(launched.pid, launched.start_time, command_identity(command))
                return self._started(Process(process_id, identity, launched.pidfd, launched))
            popen = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env=env,
                pass_fds=pass_fds,
            )
        pidfd = os.pidfd_open(popen.pid)  # our unreaped child: pid and /proc entry stay until we reap it
        # The command as we exec'd it, not /proc/<pid>/cmdline: Popen can return while the kernel is still
        # setting up the new image (vfork), when cmdline reads empty.
        identity = Identity(popen.pid, _start_time(popen.pid), command_identity(command))
        return self._started(Process(process_id, identity, pidfd, popen))

    def _started(self, process: Process) -> Process:
        self._watch(process)
        log.debug("started %s (pid %d): %s", process.id, process.pid, " ".join(process.identity.command))
        return process

    def _open_log(self, log_id: str) -> BinaryIO:
        """The log to append to; /dev/null when the state dir takes no writes (the process starts all the same:
        a replacement standby matters more than its log)."""
        path = self.log_path(log_id)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return open(path, "ab")
        except OSError as exc:
            log.warning("cannot open %s (%s): the output of %s is discarded", path, exc.strerror, log_id)
            return open(os.devnull, "ab")

    def adopt(self, process_id: str, record: ProcessRecord) -> Process | None:
        """Watch a process a previous controller started, if it is still that very process."""
        opened = open_pidfd(record)
        if opened is None:
            return None
        process = Process(process_id, opened[1], opened[0], None)
        self._watch(process)
        return process

    def rename(self, process: Process, process_id: str) -> None:
        """Supervise ``process`` as ``process_id`` from now on (a spare that became a slot's engine)."""
        if self.processes.get(process.id) is process:
            del self.processes[process.id]
        process.id = process_id
        if process.alive:
            self.processes[process_id] = process

    def watch_exiting(self, process: Process, watch: bool = True) -> None:
        """Watch ``process`` (or stop) for the first sign of its exit, every EXITING_POLL_S.

        The pidfd fires only once the kernel has torn the process down: its address space first (tens of
        ms per GB mapped; a CUDA context's mappings and driver state take longer), then its files. The
        task flags show PF_EXITING within a few ms of a SIGKILL. Once every thread shows it (``is_exiting``)
        the process can never run user code again, so it is as good as fenced for a failover, though its
        memory may still be being released: ``exiting_at`` is set, ``gone`` fires and ``on_exit`` runs. A process
        seen stopped (``is_stopped``) has ``stopped_at`` set, cleared once it runs again, and ``on_stopped`` runs
        once it has been stopped for STOPPED_FOR_S."""
        if not watch or not process.alive:
            self.early.discard(process)
            return
        self.early.add(process)
        if self.early_watch is None or self.early_watch.done():
            self.early_watch = asyncio.create_task(self._watch_early(), name="watch-exiting")

    async def _watch_early(self) -> None:
        while self.early:
            for process in list(self.early):
                if process.alive and is_exiting(process.pid):
                    process.exiting_at = time.monotonic()
                    process.gone.set()
                    log.debug("%s (pid %d): every thread is exiting", process.id, process.pid)
                    self.on_exit(process)
                elif process.alive:
                    self._note_stop(process)
                if not process.alive or process.exiting_at is not None:
                    self.early.discard(process)
                    self.stops_reported.discard(process)
            await asyncio.sleep(EXITING_POLL_S)

    def _note_stop(self, process: Process) -> None:
        """``stopped_at`` as ``process`` is now; ``on_stopped`` on the poll that finds it stopped STOPPED_FOR_S."""
        now = time.monotonic()
        if not is_stopped(process.pid):
            process.stopped_at = None
            self.stops_reported.discard(process)
            return
        process.stopped_at = process.stopped_at or now
        if now - process.stopped_at >= STOPPED_FOR_S and process not in self.stops_reported:
            self.stops_reported.add(process)
            log.debug("%s (pid %d): stopped for %.0f ms", process.id, process.pid, (now - process.stopped_at) * 1000)
            self.on_stopped(process)

    async def fence(self, process: Process, timeout: float = FENCE_TIMEOUT_S, *, until_exit: bool = True) -> bool:
        """SIGKILL and wait for the exit (works on a SIGSTOPped process too); False if it outlived ``timeout``.
        ``until_exit`` False: wait only until it is ``gone`` (for a process watched with ``watch_exiting``,
        every thread exiting; it can never answer again, but its port and memory are freed a little later)."""
        if process.alive:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(process.pidfd, signal.SIGKILL)
        return await _wait(process, timeout, process.exited if until_exit else process.gone)

    async def stop(self, process: Process, timeout: float = STOP_TIMEOUT_S) -> str:
        """SIGTERM, then SIGKILL after ``timeout``; returns how it ended."""
        if not process.alive:
            return process.exit_reason or "exited"
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(process.pidfd, signal.SIGTERM)
        if await _wait(process, timeout):
            return process.exit_reason or "exited"
        if not await self.fence(process):
            return f"still alive {FENCE_TIMEOUT_S:g} s after SIGKILL (it ignored SIGTERM for {timeout:g} s)"
        return f"killed after ignoring SIGTERM for {timeout:g} s"

    async def fence_session(self, process: Process, timeout: float = FENCE_TIMEOUT_S) -> bool:
        """SIGKILL every process left in the session ``process`` was started in (it led it: a tensor-parallel
        engine's rank 0, whose ranks share it) and wait until none is left; False if one outlived ``timeout``."""
        deadline = time.monotonic() + timeout
        while members := await asyncio.to_thread(session_members, process.pid):
            for pid in members:
                _kill_in_session(pid, process.pid)
            if time.monotonic() > deadline:
                log.error("session %d: pid(s) %s outlived SIGKILL by %.0f s", process.pid, members, timeout)
                return False
            await asyncio.sleep(EXITING_POLL_S)
        return True

    def forget(self, process: Process) -> None:
        """Stop watching without touching the process (controller shutdown that leaves it running)."""
        self.early.discard(process)
        if isinstance(process.popen, Launched):
            process.popen.close()
        if process.alive:
            asyncio.get_running_loop().remove_reader(process.pidfd)
            os.close(process.pidfd)
            process.pidfd = -1
        self.processes.pop(process.id, None)

    def _watch(self, process: Process) -> None:
        self.processes[process.id] = process
        asyncio.get_running_loop().add_reader(process.pidfd, self._handle_exit, process)

    def _handle_exit(self, process: Process) -> None:
        asyncio.get_running_loop().remove_reader(process.pidfd)
        if isinstance(process.popen, Launched):  # its status comes from the launcher, which reaps it at once
            process.popen.when_reported(lambda: self._exited(process))
        else:
            self._exited(process)

    def _exited(self, process: Process) -> None:
        os.close(process.pidfd)
        process.pidfd = -1
        process.exit_reason = exit_reason(process.popen.poll() if process.popen else None)
        process.exited_at = time.monotonic()
        process.exited.set()
        process.gone.set()
        self.early.discard(process)
        if self.processes.get(process.id) is process:
            del self.processes[process.id]
        self.on_exit(process)


async def _wait(process: Process, timeout: float, event: asyncio.Event | None = None) -> bool:
    """Whether ``event`` (default: the exit) is set within ``timeout``."""
    try:
        await asyncio.wait_for((event or process.exited).wait(), timeout)
    except TimeoutError:
        return False
    return True


def open_pidfd(record: ProcessRecord) -> tuple[int, Identity] | None:
    """A pidfd for the recorded process if it is alive and still the same process (same start time and
    command line: after a reboot the pid may belong to another program), else None.

    The pidfd is opened first and the identity checked after, so the fd cannot point to a
    process that took over the pid between the check and the open."""
    try:
        pidfd = os.pidfd_open(record.pid)
    except (ProcessLookupError, ValueError, OverflowError):
        return None
    identity = read_identity(record.pid)
    if identity != record:
        os.close(pidfd)
        return None
    return pidfd, identity


def stop_recorded(records: Iterable[tuple[str, ProcessRecord]], timeout: float = STOP_TIMEOUT_S) -> list[str]:
    """Synchronous stop of recorded (id, process) pairs (``hotweights down``): SIGTERM all, wait, SIGKILL
    leftovers. Returns one line per process that was still running."""
    running = [(name, record, opened[0]) for name, record in records if (opened := open_pidfd(record)) is not None]
    for _, _, fd in running:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    lines = []
    for name, record, fd in running:
        if readable(fd, deadline - time.monotonic()):
            lines.append(f"{name} (pid {record.pid}) stopped")
        else:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            how = f"killed after {timeout:g} s" if readable(fd, FENCE_TIMEOUT_S) else "still alive after SIGKILL"
            lines.append(f"{name} (pid {record.pid}) {how}")
        os.close(fd)
    return lines


STACK_COMMANDS = ("engine", "cache", "gateway")  # what a controller starts (`hotweights <command> ...`)
STOP_ROUNDS = 3  # ``stop_leftovers``: top processes, then what outlived them (reparented), at most this often


def stack_marker(state_dir: Path) -> str:
    """The ``STACK_ENV`` value of a stack's processes: its state dir, resolved (``down`` may run elsewhere)."""
    return str(state_dir.resolve())


def carries_marker(pid: int, marker: str) -> bool:
    """Whether ``pid`` was started with ``STACK_ENV`` = ``marker`` (its environment as exec'd, from /proc)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return False
    return f"{STACK_ENV}={marker}".encode() in environ.split(b"\0")


def stack_orphans(marker: str, markers: Iterable[str] = ()) -> list[tuple[str, ProcessRecord]]:
    """Every live process of a stack, whatever its records say: those carrying ``STACK_ENV`` = ``marker`` (all a
    controller started and their children: spares, tensor-parallel ranks, an agent's engine), and engines, daemons
    and gateways (not other hotweights commands) with an argument that is one of ``markers`` or lies under it (a
    state dir holds its stack's daemon sockets, which its daemons and engines name; a config path is named by its
    gateway), for processes started before the environment said so. Never this process, nor one of another stack
    or a stranger that reused a recorded pid: each is judged live, from /proc. Returns (a name, its identity)
    pairs for ``stop_recorded``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        identity = read_identity(int(proc.name))
        if identity is None:
            continue
        command = identity.command
        subcommand = command[command.index("hotweights") + 1 :][:1] if "hotweights" in command else []
        named = bool(subcommand) and subcommand[0] in STACK_COMMANDS
        named = named and any(arg == m or arg.startswith(m + "/") for arg in command for m in markers)
        if named or carries_marker(identity.pid, marker):
            found.append((f"leftover {describe(command)}", identity))
    return found


def describe(command: tuple[str, ...]) -> str:
    """A stack process by its command line: ``engine g0-e1``, ``cache``, ``gateway``, else its program."""
    args = list(command)
    if "hotweights" not in args:
        return Path(args[0]).name if args else "process"
    what = args[args.index("hotweights") + 1 :][:1] or ["hotweights"]
    engine_id = args[args.index("--engine-id") + 1 :][:1] if "--engine-id" in args else []
    return " ".join(what + engine_id)


def stop_leftovers(marker: str, markers: Iterable[str] = (), timeout: float = STOP_TIMEOUT_S) -> list[str]:
    """Stop every process ``stack_orphans`` finds: first those whose parent is not one of them (an agent before
    its engine, a tensor-parallel rank 0 before its ranks), then what outlived them, for ``STOP_ROUNDS`` rounds at
    most. One line per process stopped (``stop_recorded``)."""
    lines: list[str] = []
    for _ in range(STOP_ROUNDS):
        found = stack_orphans(marker, markers)
        pids = {identity.pid for _, identity in found}
        top = [(name, identity) for name, identity in found if _parent(identity.pid) not in pids]
        if not top:
            break
        lines += stop_recorded(top, timeout)
    return lines


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def controller_holding(lock: Path) -> ProcessRecord | None:
    """The live controller holding the lock at ``lock`` (its pid from the file, then its identity, then the
    lock seen held with the same pid in the file: the identity is not a newcomer's that reused the pid), None
    when no live process holds it. ``stop_recorded`` then checks the identity again through a pidfd."""
    pid = _lock_pid(lock)
    identity = read_identity(pid) if pid else None
    if identity is None or not is_held(lock) or _lock_pid(lock) != pid:
        return None
    return identity


def _lock_pid(lock: Path) -> int | None:
    try:
        return int(lock.read_text().strip())
    except (OSError, ValueError):
        return None


def listening_pids(port: int, owner: int | None = None) -> set[int]:
    """Pids holding a TCP socket that listens on ``port`` (IPv4 or IPv6), read from /proc.

    With ``owner`` (a process we started): when every such socket is one ``owner`` holds, only it and
    its descendants (which may have inherited them) are looked at, not every fd on the host (hundreds of
    ms on a busy one). Another process can hold the very same socket only if one of them handed it over
    on purpose (SCM_RIGHTS, pidfd_getfd), which engines do not do."""
    inodes = _listening_inodes(port)
    if not inodes:
        return set()
    if owner is not None and inodes <= _fd_targets(owner):
        return {pid for pid in {owner, *descendants(owner)} if _fd_targets(pid) & inodes}
    pids = (int(proc.name) for proc in Path("/proc").iterdir() if proc.name.isdigit())
    return {pid for pid in pids if _fd_targets(pid) & inodes}


def inheritors(port: int, pid: int) -> set[int]:
    """Descendants of ``pid`` holding a socket that listens on ``port``. While ``pid`` (an engine: it binds
    without SO_REUSEPORT) still holds its port, even as it exits, no other socket can listen there, so
    these are the only other processes that could answer on it."""
    inodes = _listening_inodes(port)
    return {child for child in descendants(pid) if _fd_targets(child) & inodes} if inodes else set()


def _listening_inodes(port: int) -> set[str]:
    """``socket:[inode]`` of every TCP socket listening on ``port`` (IPv4 or IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    return inodes


def _fd_targets(pid: int) -> set[str]:
    """What each open fd of a process points to (``socket:[inode]`` for sockets); empty once it is gone."""
    targets = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                targets.add(os.readlink(fd))
    return targets


def evict_orphans(
    port: int, engine_id: str, timeout: float = STOP_TIMEOUT_S, ours: int | None = None, spare_id: str = ""
) -> list[str]:
    """SIGKILL engines of this slot left behind by an earlier controller (same --engine-id, or ``spare_id``: a
    spare of the slot's group, whose start message named the slot; still listening on the slot's port) and wait
    for them to go. An orphan that kept its role could answer 200 on /primary beside the new primary. Other
    holders of the port, and ``ours`` (the slot's own process, which the caller fences), are left alone."""
    evicted = []
    for pid in sorted(listening_pids(port, ours) - {ours}):
        try:
            pidfd = os.pidfd_open(pid)  # first, then the identity: the fd cannot follow the pid to a newcomer
        except ProcessLookupError:
            continue  # gone meanwhile
        identity = read_identity(pid)
        if identity is None or not any(_is_engine_of(identity.command, name) for name in (engine_id, spare_id) if name):
            os.close(pidfd)
            continue
        try:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            readable(pidfd, timeout)
        finally:
            os.close(pidfd)
        evicted.append(f"evicted orphan engine {engine_id} (pid {pid}) from port {port}")
    return evicted


def _is_engine_of(command: tuple[str, ...], engine_id: str) -> bool:
    """Whether ``command`` is a reference engine's or an agent's, with ``--engine-id engine_id``."""
    args = list(command)
    if not {"engine", "agent"} & set(args) or "--engine-id" not in args:
        return False
    return args[args.index("--engine-id") + 1 :][:1] == [engine_id]


class ControllerLock(PidLock):
    """One controller per state dir: held for the controller's life."""

    def acquire(self) -> None:
        try:
            super().acquire()
        except LockHeld as held:
            raise ConfigError(
                f"another controller (pid {held.holder}) manages {self.path.parent}; stop it first "
                "(hotweights down stops the whole stack)"
            ) from None
