"""cpu-shm: the arena is a sealed memfd; engines get a read-only fd and map it read-only.

This is real zero-copy shared memory (the kernel refcounts the pages, so an engine's mapping
outlives the daemon) and the backend CI exercises. The memfd is sealed against shrinking and
growing, so no process can pull pages from under the others; engines receive a descriptor
reopened read-only, so they cannot write even if they tried.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import warnings
from typing import Any

import torch
from hotweights.cache.backends.base import ArenaBackend, ExportedArena, ImportedArena

PAGE = mmap.PAGESIZE


def _frombuffer(buffer: mmap.mmap, nbytes: int) -> torch.Tensor:
    with warnings.catch_warnings():
        # torch warns that a read-only buffer is not writable; engines never write.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)


class CpuShmExported(ExportedArena):
    def __init__(self, nbytes: int) -> None:
        self.nbytes = -(-max(nbytes, 1) // PAGE) * PAGE
        self._fd = os.memfd_create("hotweights-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, self.nbytes)
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self._map = mmap.mmap(self._fd, self.nbytes, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = _frombuffer(self._map, self.nbytes)
        self._readonly_fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    def export(self) -> tuple[dict[str, Any], list[int]]:
        return {"backend": "cpu-shm", "nbytes": self.nbytes}, [self._readonly_fd]

    def close(self) -> None:
        if self._fd < 0:
            return
        del self.tensor
        with contextlib.suppress(BufferError):  # views still alive here; the mapping goes with them
            self._map.close()
        os.close(self._readonly_fd)
        os.close(self._fd)
        self._fd = -1


class CpuShmImported(ImportedArena):
    def __init__(self, fd: int, nbytes: int) -> None:
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"cpu-shm arena fd holds {size} bytes, the handle claims {nbytes}")
            self._map = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.tensor = _frombuffer(self._map, nbytes)

    def close(self) -> None:
        if getattr(self, "tensor", None) is None:
            return
        self.tensor = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # views still alive; the mapping goes with the last one
            self._map.close()


class CpuShmBackend(ArenaBackend):
    name = "cpu-shm"

    def allocate(self, nbytes: int, device: torch.device) -> ExportedArena:
        if device.type != "cpu":
            raise ValueError(f"cpu-shm holds arenas in host memory; device {device} needs cuda-vmm or cuda-ipc")
        return CpuShmExported(nbytes)

    def import_arena(self, handle: dict[str, Any], fds: list[int], device: torch.device) -> ImportedArena:
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ValueError(f"cpu-shm expects exactly 1 fd, received {len(fds)}")
        nbytes = handle.get("nbytes")
        if not isinstance(nbytes, int) or nbytes <= 0:
            os.close(fds[0])
            raise ValueError(f"cpu-shm handle has bad nbytes {nbytes!r}")
        return CpuShmImported(fds[0], nbytes)
