"""Memory free on a device and held by processes, read without touching the device: what a model update, a batch
engine's return and ``POST /engines`` check."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

from hotweights.controller.supervisor import descendants

PAGE = os.sysconf("SC_PAGE_SIZE")


def free_bytes(device: str) -> int | None:
    """Memory free for a new arena on ``device``: host memory available (``MemAvailable``: a cpu-shm arena
    is shared memory) or the GPU's free memory (``nvidia-smi``, so the controller makes no CUDA context);
    None when it cannot be read."""
    if device == "cpu":
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        return None
    query = ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", device.split(":")[1]]
    try:
        result = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return int(result.stdout.split()[0]) << 20  # MiB


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
