"""File reads at bus speed, for the checkpoint pipeline and snapshots alike.

A ``Loader`` serves one load. It reads byte ranges of files with ``os.preadv`` on a small pool of threads
(each range cut into pieces of at most BUFFER_BYTES, each piece into parts read in parallel), and puts the
bytes where they go:

- into host memory (a CPU destination): straight into the destination's memory, no staging;
- onto a CUDA device, buffered, with ``register=True`` (the checkpoint pipeline): each file is mapped read-only
  and registered with CUDA (``cudaHostRegister``, read-only: its page-cache pages are locked), and copies go
  from the page cache to the device with no host copy at all, on a side stream; where registering is refused
  (logged once a load), as below. Measured on an H200 (docs/benchmarks.md): the xl checkpoint's warm load went
  to 24.9 GB/s, but a 32 GB snapshot on tmpfs filled slower registered (6.6 GB/s) than through the ring (16.3),
  so snapshots are read through the ring;
- onto a CUDA device otherwise: through a ring of pinned host buffers allocated once per load (on first use, up to
  RING_BUFFERS of them). The next piece is read while the previous buffer's host-to-device copy runs on a side
  stream, and a buffer is read into again only once its copy has finished (a CUDA event per buffer).
  Processing (slicing, casting, quantizing) then runs on the device, queued behind the copies.

With ``direct=True`` files are opened with O_DIRECT, bypassing the page cache (for cold files): buffers and
file offsets are ALIGN-aligned, the aligned superset of each piece is read and its inner part used; a CPU
destination then goes through one aligned staging buffer.

| what happens | what the loader does |
| --- | --- |
| the file system refuses O_DIRECT (EINVAL: tmpfs, some FUSE) | buffered reads of that file, one log line per load |
| a file ends before a range does, or a read fails | ``ReadError`` naming the file, the bytes and the reason |
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from hotweights.errors import HotweightsError

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths (a page; enough for every block size in use)
BUFFER_BYTES = 64 << 20  # one piece: one pinned buffer, one host-to-device copy
PART_BYTES = 4 << 20  # the least one thread reads of a piece; a smaller piece is one read
READ_THREADS = 8  # at most; page-cache reads scale with threads up to the memory bus
RING_BUFFERS = 2  # pinned buffers on a CUDA load: one is read into while the other's copy runs
HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads the registered pages


class ReadError(HotweightsError):
    """A file could not be read as far as a load needed; the message names the file, the bytes and why."""


class _RegisteredFile:
    """A whole file mapped read-only and registered with CUDA: its pages stay locked in the page cache, and the
    device copies straight from them. OSError where the mapping or the registration is refused."""

    def __init__(self, fd: int, size: int) -> None:
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "not writable": only the device reads it
            self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        error = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, HOST_REGISTER_READ_ONLY)
        if int(error) != 0:
            self._unmap()
            raise OSError(errno.EPERM, f"cudaHostRegister refused: error {int(error)}")

    def close(self) -> None:
        """Unregister and unmap; every copy from it must have finished."""
        torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self._unmap()

    def _unmap(self) -> None:
        del self.tensor
        self.map.close()


@dataclass
class _File:
    fd: int
    direct: bool
    size: int = 0
    registered: _RegisteredFile | None = None


@dataclass
class _Slot:
    """One pinned buffer of the ring and the event of its last copy."""

    buffer: torch.Tensor  # uint8, ALIGN-aligned, pinned
    event: torch.cuda.Event

    def is_busy(self) -> bool:
        return not self.event.query()

    def wait(self) -> None:
        """Until the buffer may be overwritten (its copy done)."""
        self.event.synchronize()


def progress_bar(total: int, desc: str, *, enabled: bool = True) -> tqdm:
    """A progress bar in bytes, shown only when ``enabled`` and stderr is a terminal (never in a log)."""
    shown = enabled and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not shown, leave=False)


def aligned_host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` whose first byte is ALIGN-aligned (pinned: for host-to-device copies)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pinned)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + nbytes]


class Loader:
    """Reads byte ranges of files onto ``device`` for one load; use it as a context manager (``close``)."""

    def __init__(self, device: torch.device | str, *, direct: bool = False, register: bool = False) -> None:
        self.device = torch.device(device)
        self.direct = direct
        self.register = register
        self._files: dict[Path, _File] = {}
        threads = max(1, min(READ_THREADS, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hw-read")
        self._threads = threads
        self._refused_direct = False
        self._refused_register = False
        self._staging: torch.Tensor | None = None  # CPU with O_DIRECT: the aligned buffer pieces land in
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._ring: deque[_Slot] = deque()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for every copy, then release buffers, threads, registrations and files."""
        for slot in self._ring:
            slot.wait()
        self._ring.clear()
        if self._stream is not None:
            self._stream.synchronize()
        self._pool.shutdown()
        for file in self._files.values():
            if file.registered is not None:
                file.registered.close()
            os.close(file.fd)
        self._files.clear()

    def read(self, path: Path, offset: int, nbytes: int) -> torch.Tensor:
        """A new uint8 tensor on the device with the ``nbytes`` of ``path`` at ``offset``, ready for work on the
        current stream."""
        if self._stream is None:
            dest = torch.empty(nbytes, dtype=torch.uint8)
            self.read_into(path, offset, dest)
            return dest
        with torch.cuda.stream(self._stream):  # allocated in the copies' stream: no wait for earlier work
            dest = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.read_into(path, offset, dest, fresh=True)
        dest.record_stream(torch.cuda.current_stream(self.device))
        return dest

    def read_into(self, path: Path, offset: int, dest: torch.Tensor, *, fresh: bool = False) -> None:
        """Fill ``dest`` (a contiguous uint8 tensor on the device) with the bytes of ``path`` at ``offset``; when
        it returns, work queued on the current stream sees them. ``fresh``: ``dest`` was allocated on the copies'
        stream, so they need not wait for the current one."""
        if self._stream is not None and not fresh:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # dest may still be in use there
        nbytes = dest.numel()
        for start in range(0, nbytes, BUFFER_BYTES):
            piece = dest[start : min(start + BUFFER_BYTES, nbytes)]
            if self._stream is None:
                self._read_host(path, offset + start, piece)
            else:
                self._read_device(path, offset + start, piece)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _read_host(self, path: Path, offset: int, dest: torch.Tensor) -> None:
        file = self._open(path)
        if not file.direct:
            self._fill(path, file, offset, dest.numel(), dest)
            return
        if self._staging is None:
            self._staging = aligned_host_buffer(BUFFER_BYTES + 2 * ALIGN, pinned=False)
        dest.copy_(self._fill(path, file, offset, dest.numel(), self._staging))

    def _read_device(self, path: Path, offset: int, dest: torch.Tensor) -> None:
        file = self._open(path)
        if file.registered is not None:
            if offset + dest.numel() > file.size:
                raise ReadError(
                    f"{path} ends at byte {file.size}, but the load needs its bytes up to {offset + dest.numel()} "
                    "(truncated since it was checked?)"
                )
            with torch.cuda.stream(self._stream):
                dest.copy_(file.registered.tensor[offset : offset + dest.numel()], non_blocking=True)
            return
        slot = self._take_slot()
        host = self._fill(path, self._open(path), offset, dest.numel(), slot.buffer)
        with torch.cuda.stream(self._stream):
            dest.copy_(host, non_blocking=True)
            slot.event.record(self._stream)
        self._ring.append(slot)

    def _take_slot(self) -> _Slot:
        """The oldest buffer of the ring once it is free; a new one while it is busy and the ring not full."""
        if not self._ring or (len(self._ring) < RING_BUFFERS and self._ring[0].is_busy()):
            buffer = aligned_host_buffer(BUFFER_BYTES + 2 * ALIGN, pinned=True)
            return _Slot(buffer, torch.cuda.Event())
        slot = self._ring.popleft()
        slot.wait()
        return slot

    def _fill(self, path: Path, file: _File, offset: int, nbytes: int, buffer: torch.Tensor) -> torch.Tensor:
        """Read ``nbytes`` at ``offset`` into host ``buffer``; returns the part of it that holds them (with
        O_DIRECT the aligned superset is read, and the part starts past the alignment)."""
        if not file.direct:
            self._read_parts(path, file, buffer[:nbytes], offset, nbytes)
            return buffer[:nbytes]
        start = offset - offset % ALIGN
        end = -(-(offset + nbytes) // ALIGN) * ALIGN
        self._read_parts(path, file, buffer[: end - start], start, offset + nbytes - start)
        return buffer[offset - start : offset - start + nbytes]

    def _read_parts(self, path: Path, file: _File, buffer: torch.Tensor, offset: int, needed: int) -> None:
        """Read ``buffer`` from ``offset`` in parallel parts (ALIGN multiples); ReadError unless at least the
        first ``needed`` bytes arrived (an O_DIRECT superset may run past the end of the file)."""
        view = memoryview(buffer.numpy())
        part = max(PART_BYTES, -(-len(view) // self._threads // ALIGN) * ALIGN)
        parts = [view[start : start + part] for start in range(0, len(view), part)]
        if len(parts) == 1:
            counts = [_pread_full(path, file.fd, view, offset)]
        else:
            reads = [self._pool.submit(_pread_full, path, file.fd, p, offset + i * part) for i, p in enumerate(parts)]
            counts = [read.result() for read in reads]
        got = 0
        for piece, count in zip(parts, counts, strict=True):  # the bytes read before the first short part
            got += count
            if count < len(piece):
                break
        if got < needed:
            raise ReadError(
                f"{path} ends at byte {offset + got}, but the load needs its bytes up to {offset + needed} "
                "(truncated since it was checked?)"
            )

    def _open(self, path: Path) -> _File:
        file = self._files.get(path)
        if file is None:
            fd = self._open_direct(path) if self.direct else None
            file = _File(fd, True) if fd is not None else _File(_open_buffered(path), False)
            if self.register and not file.direct and self._stream is not None:
                self._register(path, file)
            self._files[path] = file
        return file

    def _register(self, path: Path, file: _File) -> None:
        """Map and register ``file`` for copies straight from the page cache; where that is refused, the load
        reads it through the pinned ring (logged once a load)."""
        file.size = os.fstat(file.fd).st_size
        if file.size == 0:
            return
        try:
            file.registered = _RegisteredFile(file.fd, file.size)
        except (OSError, ValueError) as exc:
            if not self._refused_register:
                log.warning("cannot register %s with CUDA (%s): this load copies through pinned buffers", path, exc)
                self._refused_register = True

    def _open_direct(self, path: Path) -> int | None:
        """An O_DIRECT fd of ``path`` that has read its first block; None (logged once a load) where the file
        system refuses O_DIRECT."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise ReadError(f"cannot open {path}: {exc.strerror}") from None
            return self._direct_refused(path, exc)
        probe = mmap.mmap(-1, ALIGN)  # page-aligned
        try:
            os.preadv(fd, [probe], 0)
        except OSError as exc:
            os.close(fd)
            if exc.errno != errno.EINVAL:
                raise ReadError(f"cannot read {path}: {exc.strerror}") from None
            return self._direct_refused(path, exc)
        finally:
            probe.close()
        return fd

    def _direct_refused(self, path: Path, exc: OSError) -> None:
        if not self._refused_direct:
            log.warning(
                "O_DIRECT refused for %s (%s): this load reads such files through the page cache", path, exc.strerror
            )
            self._refused_direct = True


def _open_buffered(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ReadError(f"cannot open {path}: {exc.strerror}") from None
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd


def _pread_full(path: Path, fd: int, view: memoryview, offset: int) -> int:
    """Read into all of ``view`` from ``offset``, or up to the end of the file; returns the bytes read."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            end = offset + len(view)
            raise ReadError(f"cannot read bytes {offset + done}..{end} of {path}: {exc.strerror}") from None
        if n == 0:
            break
        done += n
    return done
