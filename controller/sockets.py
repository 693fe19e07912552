"""The stack's Unix sockets that dead processes left, found and removed.

A stack's sockets live in ``state_dir/run`` (``run_dir``): its daemons' (``g<N>.sock``, with their lock, ready
marker and arena record), the re-adoption offer of every engine attached to them (``cache.handover``:
``<digest>.<pid>-<n>.handover``, one per engine, which a SIGKILLed engine cannot remove) and its gateway workers'
probe sockets. The controller removes a dead engine's offers when it sees a process exit
(``remove_dead_offers``: every offer whose engine is gone, so a tensor-parallel rank's and a spare's too), and
every socket nothing serves at a clean stop (``remove_dead_sockets``, by ``up``'s stop and by ``down``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path

from hotweights.cache.paths import OFFER_SUFFIX, DaemonPaths, offer_pid, remove_if_stale
from hotweights.controller.supervisor import read_identity
from hotweights.paths import runtime_dir

PROBE_TIMEOUT_S = 1.0  # a connect to a socket nothing may serve


def run_dir(state_dir: Path) -> Path:
    """Where a stack's Unix sockets live."""
    return state_dir / "run"


def remove_dead_offers(directory: Path) -> list[Path]:
    """Remove every re-adoption offer in ``directory`` whose engine is gone (its pid not live, or a zombie);
    return them. An offer whose pid a newcomer took is kept (the daemon that asks it finds it stale)."""
    removed = []
    for path in _entries(directory, f"*{OFFER_SUFFIX}"):
        pid = offer_pid(path)
        if pid is not None and read_identity(pid) is None and _unlink_socket(path):
            removed.append(path)
    return removed


def remove_dead_sockets(directory: Path) -> list[Path]:
    """Remove every socket in ``directory`` that nothing serves (the stack is stopped): dead engines' offers, the
    daemons' (with their ready markers, holding each one's lock meanwhile: ``cache.paths.remove_if_stale``) and
    the gateway workers' probe sockets (nothing accepts on them), and the runtime dir's links to them that their
    killed daemons could not remove. Returns what it removed."""
    removed = remove_dead_offers(directory)
    for path in _entries(directory, "*"):
        if path.suffix == OFFER_SUFFIX or not _is_socket(path):
            continue
        if DaemonPaths(path).lock.exists():
            removed += [path] if remove_if_stale(path) else []
        elif not _answers(path) and _unlink_socket(path):
            removed.append(path)
    target = directory.resolve()
    for link in _entries(runtime_dir(), "*.sock"):
        with contextlib.suppress(OSError):
            if link.is_symlink() and Path(os.readlink(link)).parent == target and remove_if_stale(link):
                removed.append(link)
    return removed


def _entries(directory: Path, pattern: str) -> list[Path]:
    try:
        return sorted(directory.glob(pattern))
    except OSError:
        return []


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _unlink_socket(path: Path) -> bool:
    """Unlink ``path`` if it is still a socket; whether it was removed."""
    if not _is_socket(path):
        return False
    try:
        path.unlink()
    except OSError:
        return False
    return True


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True
