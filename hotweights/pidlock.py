"""One live owner per path: an flock held for the owner's life, the file holding the owner's pid.

The kernel drops the lock when the owner dies, however it dies, so a leftover file never blocks a
successor (after a reboot, a SIGKILL, a crash).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class LockHeld(Exception):
    """Someone else holds the lock; ``holder`` is the pid it wrote, or "unknown"."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by pid {holder}")
        self.path = path
        self.holder = holder


class PidLock:
    """``acquire`` takes the lock without waiting (LockHeld if taken) and writes our pid; ``release``
    drops it. The file stays; it is the lock, not a marker."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LockHeld(self.path, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def is_held(path: Path) -> bool:
    """True while some live process holds the lock at ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
