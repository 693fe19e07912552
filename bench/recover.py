"""A daemon's recovery: re-adoption from a live engine vs a processed snapshot vs the checkpoint on disk.

    python bench/recover.py --device cpu                   # writes the 'medium' preset (~1.7 GB) to a temp dir
    python bench/recover.py --device cuda:0 --model DIR [--tmp /dev/shm]

Real processes: a daemon (``hotweights cache serve``) fills from the disk; this process attaches as an engine does
(keeping and offering its arena fd); then the daemon is SIGKILLed and a new one started, once re-adopting
(``--fill-from readopt``) and once from a snapshot written from the arena (``--fill-from snapshot``). Before every
fill the checkpoint's and the snapshot's pages are dropped from the page cache (POSIX_FADV_DONTNEED), so their
bytes come from the disk. Times are the daemons' own fill reports (a disk fill includes hashing the arena, as a
respawn does); ``disk_bytes_read_on_readopt`` is what the re-adopting daemon read from storage while it filled
(``read_bytes`` of its /proc/self/io around the fill, its own report), and ``daemon_read_bytes_whole_life`` the
same over its whole life once it serves (imports included: a library page that is not in the page cache shows
there). The snapshot is then read twice more: from the warm page cache (``snapshot_warm``) and, its pages dropped
again, with O_DIRECT (``--direct-io``, ``snapshot_direct``). The bound: the disk's sequential read of the
checkpoint measured in this run (one thread, 64 MiB reads, cold), and on CUDA the pinned host-to-device rate, and
the arena digest's own rate (``digest_gbps``: content hash and keyed digest in one read, as a fill computes them,
over the engine's mapping). ``--tmp``: where the snapshot and the daemons' sockets go (a tmpfs such as /dev/shm
when the disk cannot hold the checkpoint twice; its "cold" reads are then from memory and O_DIRECT falls back to
buffered reads). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.client import attach
from hotweights.cache.connection import request
from hotweights.cache.digest import fill_digests
from hotweights.cache.diskio import evict
from hotweights.cache.fingerprint import compute_fingerprint
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.makemodel import PRESETS, write_checkpoint
from hotweights.cache.paths import DaemonPaths
from hotweights.cache.snapshot import write_snapshot
from hotweights.spawn import hotweights_command

READ_BYTES = 64 << 20
START_TIMEOUT_S = 600.0


def resident_bytes(paths: list[Path]) -> int:
    """How much of the files is in the page cache now (``mincore`` of a mapping that touches no page): after
    ``evict``, any byte read from them since, by any process, shows here."""
    libc, page = ctypes.CDLL(None, use_errno=True), os.sysconf("SC_PAGE_SIZE")
    resident = 0
    for path in paths:
        size = path.stat().st_size
        if not size:
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
            pages = (ctypes.c_ubyte * ((size + page - 1) // page))()
            start = ctypes.c_char.from_buffer(mapped)
            try:
                if libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), pages) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path}")
            finally:
                del start  # the mapping closes only once nothing points into it
            resident += sum(flag & 1 for flag in pages) * page
    return resident


def sequential_read_gbps(paths: list[Path]) -> float:
    """The disk's cold sequential read rate over ``paths``: one thread, 64 MiB reads."""
    evict(paths)
    buffer = bytearray(READ_BYTES)
    total, start = 0, time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as source:
            while n := source.readinto(buffer):
                total += n
    return total / 1e9 / (time.perf_counter() - start)


def pinned_h2d_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Host-to-device copy rate from pinned memory (the bound of a snapshot or disk fill on CUDA)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    target.copy_(host)
    torch.cuda.synchronize(device)
    return nbytes / 1e9 / (time.perf_counter() - start)


class Daemon:
    """``hotweights cache serve`` on ``socket``, filled from ``fill_from``; ``fill`` is its own report."""

    def __init__(self, model: Path, device: str, socket_path: Path, fill_from: str, *extra: str) -> None:
        command = hotweights_command("cache", "serve", "--model", str(model), "--device", device)
        command += ["--socket", str(socket_path), "--fill-from", fill_from, *extra]
        self.paths = DaemonPaths(socket_path)
        self.log = socket_path.with_suffix(f".{fill_from}.log")
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=out)
        self._wait_serving()
        self.read_bytes = proc_io(self.process.pid)["read_bytes"]
        self.fill: dict[str, Any] = request(socket_path, {"op": "status"})["status"]["fill"]

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise SystemExit(f"daemon did not serve; see {self.log}:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.01)

    def _ready(self) -> bool:
        try:
            return json.loads(self.paths.ready.read_text())["pid"] == self.process.pid
        except (FileNotFoundError, ValueError):
            return False

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def proc_io(pid: int) -> dict[str, int]:
    """/proc/<pid>/io as numbers: ``read_bytes`` is what the process made the kernel fetch from storage."""
    rows = Path(f"/proc/{pid}/io").read_text().splitlines()
    return {key: int(value) for key, value in (row.split(": ") for row in rows)}


def run(model: Path, device: str, workdir: Path) -> dict[str, Any]:
    """The three fills, one after the other, against one attached engine (this process)."""
    checkpoint = read_checkpoint(model)
    shards = sorted(checkpoint.files)
    checkpoint_bytes = sum(path.stat().st_size for path in shards)
    socket_path = workdir / "run" / "d.sock"
    socket_path.parent.mkdir(mode=0o700)
    result: dict[str, Any] = {"device": device, "model": str(model), "checkpoint_bytes": checkpoint_bytes}
    result["disk_seq_read_gbps"] = round(sequential_read_gbps(shards), 3)
    if device.startswith("cuda"):
        result["pinned_h2d_gbps"] = round(pinned_h2d_gbps(torch.device(device)), 2)

    evict(shards)
    first = Daemon(model, device, socket_path, "disk")
    result["disk_load_s"] = round(first.fill["seconds"], 3)
    result["disk_gbps"] = round(checkpoint_bytes / 1e9 / first.fill["seconds"], 3)
    engine = attach(socket_path, compute_fingerprint(checkpoint, LoadSpec(device=device)), device, offer_handover=True)
    arena_bytes = engine.manifest["used_bytes"]
    result["digest_gbps"] = round(arena_bytes / 1e9 / digest_seconds(engine.arena.tensor, arena_bytes), 2)
    snapshot = workdir / "arena.snap"
    write_snapshot(snapshot, engine.manifest, engine.arena.tensor)
    first.kill()

    evict(shards)
    readopted = Daemon(model, device, socket_path, "readopt")
    result["readopt_ms"] = round(readopted.fill["seconds"] * 1e3, 2)
    result["readopt_detail"] = readopted.fill["detail"]
    result["disk_bytes_read_on_readopt"] = readopted.fill["disk_read_bytes"]
    result["daemon_read_bytes_whole_life"] = readopted.read_bytes
    readopted.kill()

    evict([snapshot, *shards])
    restored = Daemon(model, device, socket_path, "snapshot", "--snapshot", str(snapshot))
    result["snapshot_load_s"] = round(restored.fill["seconds"], 3)
    result["snapshot_gbps"] = round(arena_bytes / 1e9 / restored.fill["seconds"], 3)
    restored.kill()
    for name, extra in (("snapshot_warm", ()), ("snapshot_direct", ("--direct-io",))):
        if extra:
            evict([snapshot])
        again = Daemon(model, device, socket_path, "snapshot", "--snapshot", str(snapshot), *extra)
        result[f"{name}_gbps"] = round(arena_bytes / 1e9 / again.fill["seconds"], 3)
        again.kill()
    result["snapshot_direct_vs_disk"] = round(result["snapshot_direct_gbps"] / result["disk_seq_read_gbps"], 3)
    engine.close()
    result["arena_bytes"] = arena_bytes
    result["readopt_speedup_vs_disk"] = round(first.fill["seconds"] / readopted.fill["seconds"], 1)
    return result


def digest_seconds(arena: torch.Tensor, nbytes: int) -> float:
    """Seconds for a fill's digests of ``nbytes`` of ``arena`` (the second of two runs: the first warms up)."""
    for _ in range(2):
        start = time.perf_counter()
        fill_digests(arena, nbytes)
        seconds = time.perf_counter() - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N")
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the medium preset, made here)")
    parser.add_argument("--tmp", default="/tmp", help="directory for the snapshot and sockets (default %(default)s)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="hw-recover-", dir=args.tmp))
    os.environ["HOTWEIGHTS_RUNTIME_DIR"] = str(workdir / "rt")  # the daemons' published links die with workdir
    try:
        model = args.model
        if model is None:
            model = write_checkpoint(workdir / "medium", PRESETS["medium"], progress=False)
        result = run(model.resolve(), args.device, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for key, value in result.items():
        print(f"{key}: {value}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
