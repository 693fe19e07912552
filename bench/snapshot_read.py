"""Ways to move one large file from the page cache onto a CUDA device, side by side in one run.

    python bench/snapshot_read.py --device cuda:0 [--gb 16] [--dir /dev/shm]

A snapshot's fill is this move (``cache.snapshot``); the loader reads it through a ring of pinned buffers.
Written to choose how it should: a file of ``--gb`` random bytes in ``--dir`` (tmpfs: the page cache with no
disk under it), then, each twice, in GB/s of file bytes landed on the device:

- ``loader``: ``cache.loader.Loader`` as snapshots use it (one ``read_into`` of the whole file: 16 threads,
  4 pinned buffers of 64 MiB, reads of the next pieces running while earlier ones copy);
- ``ring_T_D_P``: the same loader with T threads, D buffers of P MiB;
- ``registered_W_P``: the file mapped, windows of W MiB registered with CUDA (``cudaHostRegister``, read-only)
  on P threads, each copied straight from the page cache once registered, unregistered once copied;
- ``pageable``: the mapped file copied as it is (the driver stages it).

Every result is checked against the file's first and last MiB. Also printed: the pinned host-to-device rate
(a 1 GiB pinned buffer, copied 8 times), and this host's own bounds on any way through host memory:
``host_read_T``, the file read into pinned buffers of 64 MiB by T threads with no device copy (the loader's
reads alone), ``host_read_16_beside_h2d``, the same reads while another thread copies pinned memory to the
device without pause (both rates: what the two halves of the loader's work get when they share host
memory), and ``host_memcpy_gbps``, one 1 GiB copy between pinned buffers on torch's threads. The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import threading
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hotweights.cache import loader
from hotweights.cache.loader import HOST_REGISTER_READ_ONLY, aligned_host_buffer

MiB = 1 << 20


def write_file(path: Path, nbytes: int) -> None:
    block = torch.randint(0, 256, (256 * MiB,), dtype=torch.uint8).numpy().tobytes()
    with path.open("wb") as f:
        for start in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - start)])


def via_loader(path: Path, dest: torch.Tensor, threads: int = 0, buffers: int = 0, piece: int = 0) -> None:
    """One ``read_into`` of the whole file; nonzero arguments set the loader's read threads, ring buffers and
    piece size for this load (its module constants, put back afterwards)."""
    settings = {"READ_THREADS": threads, "RING_BUFFERS": buffers, "BUFFER_BYTES": piece}
    saved = {name: getattr(loader, name) for name in settings}
    try:
        for name, value in settings.items():
            if value:
                setattr(loader, name, value)
        with loader.Loader(dest.device) as reads:
            reads.read_into(path, 0, dest)
    finally:
        for name, value in saved.items():
            setattr(loader, name, value)


def via_registered(path: Path, dest: torch.Tensor, window: int, threads: int) -> None:
    size = dest.numel()
    fd = os.open(path, os.O_RDONLY)
    mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        host = torch.frombuffer(mapped, dtype=torch.uint8)
    cudart, base = torch.cuda.cudart(), host.data_ptr()
    stream = torch.cuda.Stream(dest.device)

    def register(start: int) -> int:
        n = min(window, size - start)
        error = cudart.cudaHostRegister(base + start, n, HOST_REGISTER_READ_ONLY)
        if int(error) != 0:
            raise OSError(f"cudaHostRegister refused: {int(error)}")
        return start

    copied: deque = deque()
    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(register, s) for s in range(0, size, window)]:
            start = future.result()
            n = min(window, size - start)
            with torch.cuda.stream(stream):
                dest[start : start + n].copy_(host[start : start + n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            copied.append((event, start))
            while copied and copied[0][0].query():
                cudart.cudaHostUnregister(base + copied.popleft()[1])
    stream.synchronize()
    for _, start in copied:
        cudart.cudaHostUnregister(base + start)
    host = None  # the mapping closes once no tensor views it
    mapped.close()
    os.close(fd)


def via_pageable(path: Path, dest: torch.Tensor) -> None:
    fd = os.open(path, os.O_RDONLY)
    mapped = mmap.mmap(fd, dest.numel(), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        host = torch.frombuffer(mapped, dtype=torch.uint8)
    for start in range(0, dest.numel(), 256 * MiB):
        dest[start : start + 256 * MiB].copy_(host[start : start + 256 * MiB])
    torch.cuda.synchronize(dest.device)
    del host
    mapped.close()
    os.close(fd)


def pinned_h2d_gbps(device: torch.device) -> float:
    host = aligned_host_buffer(1 << 30, pinned=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dev.copy_(host)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(8):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return 8 / (time.perf_counter() - start) * (1 << 30) / 1e9


def host_read_gbps(path: Path, nbytes: int, threads: int, piece: int = 64 * MiB) -> float:
    """The file read into one pinned buffer per thread, thread i taking pieces i, i + threads, ...: no device."""
    buffers = [aligned_host_buffer(piece, pinned=True) for _ in range(threads)]
    fd = os.open(path, os.O_RDONLY)

    def read(i: int) -> None:
        view = memoryview(buffers[i].numpy())
        for start in range(i * piece, nbytes, threads * piece):
            os.preadv(fd, [view[: min(piece, nbytes - start)]], start)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(threads)))
        return round(nbytes / (time.perf_counter() - start) / 1e9, 2)
    finally:
        os.close(fd)


def host_read_beside_h2d(path: Path, nbytes: int, device: torch.device, threads: int = 16) -> dict[str, float]:
    """``host_read_gbps`` while another thread copies a pinned 1 GiB buffer to the device over and over: both
    rates over the same interval, as the loader's reads and copies share host memory."""
    host = aligned_host_buffer(1 << 30, pinned=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    stop, copies = threading.Event(), [0]

    def copy() -> None:
        stream = torch.cuda.Stream(device)
        while not stop.is_set():
            with torch.cuda.stream(stream):
                dev.copy_(host, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()
            copies[0] += 1

    copier = threading.Thread(target=copy)
    copier.start()
    try:
        start = time.perf_counter()
        read = host_read_gbps(path, nbytes, threads)
        counted, elapsed = copies[0], time.perf_counter() - start
    finally:
        stop.set()
        copier.join()
    return {"read_gbps": read, "h2d_gbps": round(counted * (1 << 30) / elapsed / 1e9, 2)}


def host_memcpy_gbps() -> float:
    src, dst = aligned_host_buffer(1 << 30, pinned=True), aligned_host_buffer(1 << 30, pinned=True)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(4):
        dst.copy_(src)
    return round(4 / (time.perf_counter() - start) * (1 << 30) / 1e9, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--gb", type=float, default=16.0)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    device = torch.device(args.device)
    nbytes = int(args.gb * 1e9) // MiB * MiB
    variants = {
        "loader": via_loader,
        "ring_8_2_64": lambda p, d: via_loader(p, d, 8, 2, 64 * MiB),
        "ring_16_4_256": lambda p, d: via_loader(p, d, 16, 4, 256 * MiB),
        "registered_256_4": lambda p, d: via_registered(p, d, 256 * MiB, 4),
        "registered_256_16": lambda p, d: via_registered(p, d, 256 * MiB, 16),
        "pageable": via_pageable,
    }
    result: dict[str, object] = {"gb": nbytes / 1e9, "cpus": os.cpu_count(), "pinned_h2d_gbps": pinned_h2d_gbps(device)}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "snapshot.bin"
        write_file(path, nbytes)
        with path.open("rb") as f:
            head = torch.frombuffer(bytearray(f.read(MiB)), dtype=torch.uint8)
            f.seek(nbytes - MiB)
            tail = torch.frombuffer(bytearray(f.read(MiB)), dtype=torch.uint8)
        result["host_memcpy_gbps"] = host_memcpy_gbps()
        for threads in (16, 32):
            result[f"host_read_{threads}"] = [host_read_gbps(path, nbytes, threads) for _ in range(2)]
            print(f"host_read_{threads:<13d} {result[f'host_read_{threads}']}", file=sys.stderr, flush=True)
        result["host_read_16_beside_h2d"] = host_read_beside_h2d(path, nbytes, device)
        print(f"host_read_16_beside_h2d {result['host_read_16_beside_h2d']}", file=sys.stderr, flush=True)
        dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for name, move in variants.items():
            rates = []
            for _ in range(2):
                dest.zero_()
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                try:
                    move(path, dest)
                except Exception as exc:  # one variant failing must not hide the others
                    rates.append(f"{type(exc).__name__}: {exc}")
                    break
                rates.append(round(nbytes / (time.perf_counter() - start) / 1e9, 2))
                if not (torch.equal(dest[:MiB].cpu(), head) and torch.equal(dest[-MiB:].cpu(), tail)):
                    rates.append("WRONG BYTES")
                    break
            result[name] = rates
            print(f"{name:22s} {rates}", file=sys.stderr, flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
