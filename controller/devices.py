"""Memory free on a device, read without touching the device: what a model update, a batch engine's return and
``POST /engines`` check (what processes hold: ``hotweights.proctree``)."""

from __future__ import annotations

import subprocess
from pathlib import Path


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
