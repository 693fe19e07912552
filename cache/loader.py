"""File reads at bus speed, for the checkpoint pipeline and snapshots alike.

A ``Loader`` serves one load. It reads byte ranges of files with ``os.preadv`` on a small pool of threads
(each range cut into pieces of at most BUFFER_BYTES, each piece into parts read in parallel), and puts the
bytes where they go:

- into host memory (a CPU destination): straight into the destination's memory, no staging;
- onto a CUDA device, buffered, with ``register=True`` (the checkpoint pipeline): each file is mapped read-only
  and registered with CUDA (``cudaHostRegister``, read-only: its page-cache pages are locked), and copies go
  from the page cache to the device with no host copy at all, on a side stream; where registering is refused
  (logged once a load), as below. Measured on an H200 (docs/architecture.md, "Measured facts"): the xl
  checkpoint's warm load went to 24.9 GB/s, but a 32 GB snapshot on tmpfs filled slower registered (6.6 GB/s)
  than through the ring (16.3), so snapshots are read through the ring;
- onto a CUDA device otherwise: through a ring of pinned host buffers allocated once per load (on first use, up to
  RING_BUFFERS of them). Within one ``read_into`` the reads of the next pieces run while earlier pieces' host-to-
  device copies do (a piece's copy is queued on a side stream once its read is done), and a buffer is read into
  again only once its copy has finished (a CUDA event per buffer). Measured on an H200 (``bench/snapshot_read.py``,
  docs/architecture.md): 16 threads and 4 buffers without a wait between pieces move a tmpfs file at 32-33 GB/s,
  8 threads reading one piece at a time at 14-20. Processing (slicing, casting, quantizing) then runs on the
  device, queued behind the copies.

With ``direct=True`` files are opened with O_DIRECT, bypassing the page cache (for cold files): buffers and
file offsets are ALIGN-aligned, the aligned superset of each piece is read and its inner part used; a CPU
destination then goes through one aligned staging buffer.

| what happens | what the loader does |
| --- | --- |
| the file system refuses O_DIRECT (EINVAL: tmpfs, some FUSE) | buffered reads of that file, one log line per load |
| a file ends before a range does, or a read fails | ``ReadError`` naming the file, the bytes and the reason |
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import sys
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from hotweights.errors import HotweightsError

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths (a page; enough for every block size in use)
BUFFER_BYTES = 64 << 20  # one piece: one pinned buffer, one host-to-device copy
PART_BYTES = 4 << 20  # the least one thread reads of a piece; a smaller piece is one read
READ_THREADS = 16  # at most; page-cache reads scale with threads up to the memory bus
RING_BUFFERS = 4  # pinned buffers on a CUDA load: the next pieces are read while earlier ones' copies run
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


@dataclass
class _Reads:
    """The parallel reads of one buffer: each part's future and length; ``check`` waits for them."""

    path: Path
    offset: int  # of the buffer's first byte in the file
    needed: int  # bytes that must arrive (an O_DIRECT superset may run past the end of the file)
    parts: list[tuple[Future[int], int]]

    def check(self) -> None:
        """Until every part is read; ReadError unless the first ``needed`` bytes arrived."""
        got = 0
        counts = [(future.result(), length) for future, length in self.parts]
        for count, length in counts:  # the bytes read before the first short part
            got += count
            if count < length:
                break
        if got < self.needed:
            raise ReadError(
                f"{self.path} ends at byte {self.offset + got}, but the load needs its bytes up to "
                f"{self.offset + self.needed} (truncated since it was checked?)"
            )


@dataclass
class _Piece:
    """A piece on its way through the ring: its reads into ``slot``, then a copy of ``host`` into ``dest``."""

    slot: _Slot
    reads: _Reads
    host: torch.Tensor  # the part of the slot's buffer that holds the piece
    dest: torch.Tensor


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
        self._ring: deque[_Slot] = deque()  # buffers no read is going into (their last copy may still run)

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

    def read_into(
        self,
        path: Path,
        offset: int,
        dest: torch.Tensor,
        *,
        fresh: bool = False,
        progress: Callable[[int], object] | None = None,
    ) -> None:
        """Fill ``dest`` (a contiguous uint8 tensor on the device) with the bytes of ``path`` at ``offset``; when
        it returns, work queued on the current stream sees them. ``fresh``: ``dest`` was allocated on the copies'
        stream, so they need not wait for the current one. ``progress``: called with each piece's bytes."""
        if self._stream is not None and not fresh:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # dest may still be in use there
        nbytes = dest.numel()
        moving: deque[_Piece] = deque()  # pieces read or being read into the ring, not yet queued to copy
        try:
            for start in range(0, nbytes, BUFFER_BYTES):
                piece = dest[start : min(start + BUFFER_BYTES, nbytes)]
                if self._stream is None:
                    self._read_host(path, offset + start, piece)
                elif not self._read_registered(path, offset + start, piece):
                    moving.append(self._start_piece(path, offset + start, piece, moving, progress))
                    continue
                if progress is not None:
                    progress(piece.numel())
            while moving:
                self._copy_piece(moving.popleft(), progress)
        finally:
            for unfinished in moving:  # a read failed: the others must end before their buffers are reused
                with contextlib.suppress(ReadError):
                    unfinished.reads.check()
                self._ring.append(unfinished.slot)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _read_host(self, path: Path, offset: int, dest: torch.Tensor) -> None:
        file = self._open(path)
        if not file.direct:
            self._submit(path, file, offset, dest.numel(), dest).check()
            return
        if self._staging is None:
            self._staging = aligned_host_buffer(BUFFER_BYTES + 2 * ALIGN, pinned=False)
        reads, host = self._submit_aligned(path, file, offset, dest.numel(), self._staging)
        reads.check()
        dest.copy_(host)

    def _read_registered(self, path: Path, offset: int, dest: torch.Tensor) -> bool:
        """Queue the copy of a registered file's bytes into ``dest``; False when ``path`` is not registered."""
        file = self._open(path)
        if file.registered is None:
            return False
        if offset + dest.numel() > file.size:
            raise ReadError(
                f"{path} ends at byte {file.size}, but the load needs its bytes up to {offset + dest.numel()} "
                "(truncated since it was checked?)"
            )
        with torch.cuda.stream(self._stream):
            dest.copy_(file.registered.tensor[offset : offset + dest.numel()], non_blocking=True)
        return True

    def _start_piece(
        self, path: Path, offset: int, dest: torch.Tensor, moving: deque[_Piece], progress: Callable | None
    ) -> _Piece:
        """Start reading a piece into a free buffer of the ring (``_free_slot``)."""
        slot = self._free_slot(moving, progress)
        reads, host = self._submit_aligned(path, self._open(path), offset, dest.numel(), slot.buffer)
        return _Piece(slot, reads, host, dest)

    def _free_slot(self, moving: deque[_Piece], progress: Callable | None) -> _Slot:
        """A buffer for the next piece: a new one while there are fewer than RING_BUFFERS and none is idle; else
        the oldest that no read goes into, once its copy is done (with every buffer being read into, the oldest
        piece's copy is queued first)."""
        idle = bool(self._ring) and not self._ring[0].is_busy()
        if len(self._ring) + len(moving) < RING_BUFFERS and not idle:
            return _Slot(aligned_host_buffer(BUFFER_BYTES + 2 * ALIGN, pinned=True), torch.cuda.Event())
        if not self._ring:
            self._copy_piece(moving.popleft(), progress)
        slot = self._ring.popleft()
        slot.wait()
        return slot

    def _copy_piece(self, piece: _Piece, progress: Callable | None) -> None:
        """Once the piece's reads are done, queue its copy and give its buffer back to the ring."""
        try:
            piece.reads.check()
            with torch.cuda.stream(self._stream):
                piece.dest.copy_(piece.host, non_blocking=True)
                piece.slot.event.record(self._stream)
        finally:
            self._ring.append(piece.slot)
        if progress is not None:
            progress(piece.dest.numel())

    def _submit_aligned(
        self, path: Path, file: _File, offset: int, nbytes: int, buffer: torch.Tensor
    ) -> tuple[_Reads, torch.Tensor]:
        """Start reading ``nbytes`` at ``offset`` into host ``buffer``: the reads, and the part of ``buffer`` that
        will hold the bytes (with O_DIRECT the aligned superset is read, and the part starts past the alignment)."""
        if not file.direct:
            return self._submit(path, file, offset, nbytes, buffer[:nbytes]), buffer[:nbytes]
        start = offset - offset % ALIGN
        end = -(-(offset + nbytes) // ALIGN) * ALIGN
        reads = self._submit(path, file, start, offset + nbytes - start, buffer[: end - start])
        return reads, buffer[offset - start : offset - start + nbytes]

    def _submit(self, path: Path, file: _File, offset: int, needed: int, buffer: torch.Tensor) -> _Reads:
        """Start reading ``buffer`` from ``offset`` in parallel parts (ALIGN multiples) on the pool; a buffer of one
        part is read at once, here."""
        view = memoryview(buffer.numpy())
        part = max(PART_BYTES, -(-len(view) // self._threads // ALIGN) * ALIGN)
        parts = [view[start : start + part] for start in range(0, len(view), part)]
        if len(parts) == 1:
            done: Future[int] = Future()
            done.set_result(_pread_full(path, file.fd, view, offset))
            return _Reads(path, offset, needed, [(done, len(view))])
        futures = [self._pool.submit(_pread_full, path, file.fd, p, offset + i * part) for i, p in enumerate(parts)]
        return _Reads(path, offset, needed, [(f, len(p)) for f, p in zip(futures, parts, strict=True)])

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
