"""Fault injectors: signals to a process, and packet delay with ``tc netem`` where the kernel has it.

Signals go through a pidfd opened after checking the process's start time against the one recorded
when the target was chosen, so a fault never lands on an unrelated process that reused the pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    """One process to hurt, as the controller reported it."""

    name: str  # member or service id, e.g. g0-e1, daemon-g0, gateway, controller
    pid: int
    start_time: int  # /proc/<pid>/stat field 22

    @classmethod
    def of(cls, name: str, pid: int) -> Target | None:
        start = start_time(pid)
        return None if start is None else cls(name, pid, start)


def start_time(pid: int) -> int | None:
    """The start time of a running pid; None when it is gone or a zombie (dead, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # comm may hold spaces and parentheses
    return None if fields[0] in ("Z", "X") else int(fields[19])


def send(target: Target, sig: signal.Signals) -> bool:
    """Deliver ``sig`` if the target is still that very process; False if it is already gone."""
    try:
        fd = os.pidfd_open(target.pid)
    except ProcessLookupError:
        return False
    try:
        if start_time(target.pid) != target.start_time:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def is_alive(target: Target) -> bool:
    return start_time(target.pid) == target.start_time


def descendant_titled(pid: int, title: str) -> int | None:
    """The first process under ``pid`` whose command line starts with ``title`` (the title vLLM and SGLang give their
    engine core with setproctitle); None if there is none."""
    parents = [pid]
    while parents:
        for child in children(parents.pop()):
            with contextlib.suppress(OSError):  # gone meanwhile
                if Path(f"/proc/{child}/cmdline").read_bytes().startswith(title.encode()):
                    return child
            parents.append(child)
    return None


def children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (none once it is gone)."""
    found = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended
                found += map(int, (task / "children").read_text().split())
    return found


def netem_unavailable() -> str | None:
    """None when packet delay can be injected here; else why not (the scenario is skipped with it).

    Probes in a throwaway network namespace, so nothing on the host's own interfaces changes."""
    namespace = f"hwchaos{os.getpid()}"
    steps = [
        ["ip", "netns", "add", namespace],
        ["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"],
        ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
    ]
    try:
        for step in steps:
            result = subprocess.run(step, capture_output=True, text=True, timeout=10)
            if result.returncode != 0:
                return f"`{' '.join(step[-6:])}` failed: {result.stderr.strip() or result.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run ip/tc: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
    return None
