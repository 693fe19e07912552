"""A process's tree, the memory it holds, the CPU it used and its threads' states, read from /proc and ``nvidia-smi``
without touching any device: what the controller's memory checks measure of an engine, what a vLLM or SGLang spare
reports it holds, whether an engine that answers its checks late is running (``controller.health``), and whether a
watched primary is exiting or stopped (``controller.supervisor``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")
PF_EXITING = 0x4  # a task flag (include/linux/sched.h): it has entered do_exit() and never runs user code again
STOPPED_STATES = ("T", "t")  # a task's state stopped by a signal (SIGSTOP, SIGTSTP) or by a tracer


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from each thread's /proc children list). A process or thread that exits
    while it is read (an exiting primary's, as a failover checks its port) is skipped: its /proc entries vanish
    between the listing and the read (``Path.glob`` would raise then)."""
    found: set[int] = set()
    parents = [pid]
    while parents:
        parent = parents.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:  # gone meanwhile
            continue
        for task in tasks:
            with contextlib.suppress(OSError):
                for child in map(int, Path(f"/proc/{parent}/task/{task}/children").read_text().split()):
                    if child not in found:
                        found.add(child)
                        parents.append(child)
    return found


def cpu_seconds(pid: int | None) -> float | None:
    """The CPU time ``pid`` has used so far, every thread's, user and system (/proc/PID/stat); None once it is gone
    (or no pid is known)."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


# A health check or probe unanswered while the engine's process ran at least this share of a core is late, not hung
# (``controller.health``, ``gateway.discovery``) ...
BUSY_CPU_SHARE = 0.25
BUSY_GRACE_S = 2.0  # ... until this long after its last healthy answer


def busy_not_hung(cpu_s: float | None, waited_s: float, since_ok_s: float | None) -> bool:
    """Whether a check unanswered for ``waited_s`` is not counted: the engine's process ran ``cpu_s`` meanwhile (None:
    unknown), at least BUSY_CPU_SHARE of the wait, and it answered healthy ``since_ok_s`` ago (None: never), within
    BUSY_GRACE_S."""
    running = cpu_s is not None and cpu_s >= BUSY_CPU_SHARE * waited_s
    return running and since_ok_s is not None and since_ok_s < BUSY_GRACE_S


def cpu_used(pid: int | None, since: float | None) -> float | None:
    """``pid``'s CPU seconds (``cpu_seconds``) less ``since`` (an earlier reading); None where either is unknown."""
    now = cpu_seconds(pid)
    return None if now is None or since is None else now - since


def tree_rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` and every process below it (an agent's engine and its workers, say); None once
    ``pid`` is gone."""
    total = 0
    for member in (pid, *descendants(pid)):
        try:
            total += int(Path(f"/proc/{member}/statm").read_text().split()[1]) * PAGE
        except OSError:
            if member == pid:
                return None
    return total


def device_bytes_of(pids: Iterable[int]) -> int | None:
    """The most device memory any of ``pids`` holds (``nvidia-smi``'s compute processes); None when none of
    them is listed or it cannot be read."""
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        result = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    used = {int(pid): int(mib) << 20 for pid, mib in (line.split(",") for line in result.stdout.splitlines() if line)}
    held = [used[pid] for pid in pids if pid in used]
    return max(held) if held else None


def _task_flags(stat_path: Path) -> int | None:
    """The flags field of a /proc ``stat`` file; None when the task is gone."""
    try:
        stat = stat_path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[6])


def is_stopped(pid: int) -> bool:
    """Whether ``pid``'s main thread is stopped (STOPPED_STATES): by SIGSTOP every thread of it is, and none runs
    until a SIGCONT."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rindex(")") + 2] in STOPPED_STATES


def _is_gone_or_exiting(stat_path: Path) -> bool:
    flags = _task_flags(stat_path)
    return flags is None or bool(flags & PF_EXITING)


def is_exiting(pid: int) -> bool:
    """Whether every thread of ``pid`` has begun to exit (PF_EXITING, or already gone): then none can run
    user code again, so the process will never answer another request, whatever it held open. Cheap
    when it is not (one read of the main thread's flags). The threads are listed again after their flags
    are read: a thread started meanwhile makes it False (every thread read as exiting can start none)."""
    flags = _task_flags(Path(f"/proc/{pid}/stat"))
    if flags is None or not flags & PF_EXITING:
        return False
    tasks = Path(f"/proc/{pid}/task")
    try:
        before = set(os.listdir(tasks))
        exiting = all(_is_gone_or_exiting(tasks / tid / "stat") for tid in before)
        return exiting and set(os.listdir(tasks)) <= before
    except FileNotFoundError:
        return False  # reaped: the pidfd reports the exit
