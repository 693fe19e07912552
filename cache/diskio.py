"""Reads from storage, measured: how much a process has read (``disk_read_bytes``: what a fill reports, and what the
seeding bench and tests check, a seeded daemon reading none of the weights), and files' pages dropped from the page
cache (``evict``) so that the next read of them is a read from the disk. No torch, so the fast tests can import it."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def disk_read_bytes(pid: int | str = "self") -> int:
    """Bytes process ``pid`` (default this one) has made the kernel fetch from storage so far (``read_bytes`` of
    /proc/PID/io)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def evict(paths: Iterable[Path]) -> None:
    """Drop the files' clean pages from the page cache (written ones are synced first), so the next read of them goes
    to the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
