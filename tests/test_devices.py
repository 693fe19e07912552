"""Memory read from /proc and nvidia-smi for the controller's checks and a spare's report, on real processes."""

from __future__ import annotations

import subprocess
import sys

from hotweights.controller.devices import free_bytes
from hotweights.proctree import device_bytes_of, tree_rss_bytes
from tests.cachehelpers import wait_until

HOLD_MIB = 64  # what the child below touches, so its resident memory shows it


def test_a_process_trees_resident_memory_counts_its_children_and_ends_with_it() -> None:
    code = (
        f"import subprocess, sys; b = bytearray({HOLD_MIB} << 20); "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; b = bytearray(64 << 20); time.sleep(60)']); "
        "print(c.pid, flush=True); sys.stdin.read()"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        child = int(parent.stdout.readline())
        wait_until(lambda: (tree_rss_bytes(child) or 0) > HOLD_MIB << 20, 30, "the child's memory resident")
        alone, tree = tree_rss_bytes(child), tree_rss_bytes(parent.pid)
        assert alone is not None and tree is not None
        assert tree > alone + (HOLD_MIB << 20)  # the parent's own 64 MiB on top of its child's
    finally:
        parent.kill()
        parent.wait()
        if child:
            subprocess.run(["kill", "-9", str(child)], check=False)
    assert tree_rss_bytes(parent.pid) is None


def test_host_memory_is_read_and_no_gpu_means_no_device_figure() -> None:
    assert (free_bytes("cpu") or 0) > 0
    assert device_bytes_of([1]) is None  # pid 1 holds no device memory (and there may be no nvidia-smi at all)
