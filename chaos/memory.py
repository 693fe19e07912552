"""Memory held by a stack, before and after a fault: what a leak would show up in.

- stack processes: every process whose command line names the stack's config or state dir (a fenced engine
  that did not die, or a duplicate, is a leak even before it holds much memory), but for spares still
  waiting for a slot and what they started (``controller.spares``: one per group, replaced as the primary moves);
- weight arenas: distinct memfd files those processes map (cpu-shm). A respawned daemon re-adopts the
  arena from a live engine; one that cannot loads a new arena while engines attached to the old one keep
  it mapped until they are replaced, so a round that respawned the daemon may add one arena;
- KV caches in memfds (cpu-shm: ``standby.kvshare``): a failed primary's stays deposited with its daemon for a
  few seconds after the fault (``cache.kvdeposits``), so a round may add up to MAX_RETAINED;
- /dev/shm usage (host-wide, reported only: other programs use it too);
- on CUDA, device memory in use (``nvidia-smi``), judged with a tolerance.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from hotweights.cache.backends.base import ARENA_NAME, KV_NAME
from hotweights.cache.kvdeposits import MAX_RETAINED
from hotweights.controller.spares import is_waiting
from hotweights.proctree import descendants

GPU_TOLERANCE_BYTES = 256 << 20  # allocator caches and CUDA contexts of restarted engines


@dataclass(frozen=True)
class MemorySnapshot:
    processes: int
    arenas: int
    arena_bytes: int
    kv_caches: int
    shm_used_bytes: int
    gpu_used_bytes: int | None

    def to_json(self) -> dict[str, int | None]:
        return asdict(self)


def stack_pids(markers: tuple[str, ...]) -> list[int]:
    """Processes whose command line contains one of ``markers``, except the drill and its ancestors, and spares still
    waiting for a slot with every process below them (a vLLM or SGLang spare's server)."""
    ours = ancestors()
    pids, waiting = [], []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        try:
            command = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if any(marker in command for marker in markers):
            (waiting if is_waiting(int(entry.name), command.split("\0")) else pids).append(int(entry.name))
    spared = set().union(*map(descendants, waiting))
    return [pid for pid in pids if pid not in spared]


def ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return pids


def memfd_arenas(pids: list[int], name: str = ARENA_NAME) -> dict[int, int]:
    """inode -> largest mapped size, over the mappings of ``pids`` of memfds called ``name``."""
    arenas: dict[int, int] = {}
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            span, _, _, _, inode, *path = line.split(maxsplit=5)
            if path[:1] != [f"/memfd:{name} (deleted)"]:
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            arenas[int(inode)] = max(arenas.get(int(inode), 0), end - start)
    return arenas


def gpu_used_bytes() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    result = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if result.returncode != 0:
        return None
    return sum(int(line) for line in result.stdout.split()) << 20  # MiB


def snapshot(markers: tuple[str, ...]) -> MemorySnapshot:
    pids = stack_pids(markers)
    arenas = memfd_arenas(pids)
    shm = os.statvfs("/dev/shm")
    return MemorySnapshot(
        processes=len(pids),
        arenas=len(arenas),
        arena_bytes=sum(arenas.values()),
        kv_caches=len(memfd_arenas(pids, KV_NAME)),
        shm_used_bytes=(shm.f_blocks - shm.f_bfree) * shm.f_frsize,
        gpu_used_bytes=gpu_used_bytes(),
    )


def leak(before: MemorySnapshot, after: MemorySnapshot, daemon_respawned: bool) -> str | None:
    """None if ``after`` holds no more than ``before`` (allowing a respawned daemon's new arena); else what grew."""
    found = []
    if after.processes > before.processes:
        found.append(f"{after.processes - before.processes} more stack process(es)")
    if after.arenas > before.arenas + int(daemon_respawned):
        found.append(f"arenas {before.arenas} -> {after.arenas}")
    if after.kv_caches > before.kv_caches + MAX_RETAINED:
        found.append(f"KV caches {before.kv_caches} -> {after.kv_caches}")
    if not daemon_respawned and before.gpu_used_bytes is not None and after.gpu_used_bytes is not None:
        grown = after.gpu_used_bytes - before.gpu_used_bytes
        if grown > GPU_TOLERANCE_BYTES:
            found.append(f"device memory +{grown >> 20} MiB")
    return "; ".join(found) or None
