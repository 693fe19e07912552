"""cpu-shm: the arena is a sealed memfd; engines get a read-only fd and map it read-only.

This is real zero-copy shared memory (the kernel refcounts the pages, so an engine's mapping
outlives the daemon) and the backend CI exercises. Once the daemon has mapped it, the memfd is
sealed against shrinking and growing (no process can pull pages from under the others, so no
SIGBUS) and against writing (F_SEAL_FUTURE_WRITE: write, pwrite, fallocate and every new writable
shared mapping fail with EPERM, even through a read-write reopen of /proc/<pid>/fd/N; only the
daemon's own mapping, made before the seal, can still write). Once the daemon has filled and hashed
the weights' arena it freezes it (``freeze``): it drops that mapping and adds F_SEAL_WRITE, so no
process, the daemon included, can change a byte after the hash. Then, or at the first export of an
arena never frozen (a KV cache), the seals themselves are sealed. An engine maps only a memfd that
carries the shrink, grow, future-write and seal seals and exactly the size the manifest names.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from hotweights.cache.backends.base import ARENA_NAME, ArenaBackend, ExportedArena, ImportedArena

PAGE = mmap.PAGESIZE
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux >= 5.1; Python 3.11 lacks the name
ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
SEAL_NAMES = {
    fcntl.F_SEAL_SHRINK: "shrink",
    fcntl.F_SEAL_GROW: "grow",
    F_SEAL_FUTURE_WRITE: "future-write",
    fcntl.F_SEAL_SEAL: "seal",
}


def _frombuffer(buffer: mmap.mmap, nbytes: int) -> torch.Tensor:
    with warnings.catch_warnings():
        # torch warns that a read-only buffer is not writable; engines never write.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)


class _MemfdArena(ExportedArena):
    """What both cpu-shm arenas do with the read-only memfd they hand out (``_fd``) and the fds they own."""

    _fd: int  # the read-only fd engines get
    _owned: tuple[int, ...]  # (``_fd``,) until closed
    _map: mmap.mmap
    nbytes: int

    def export(self) -> tuple[dict[str, Any], list[int]]:
        return {"backend": "cpu-shm", "nbytes": self.nbytes}, [self._fd]

    def identity(self) -> dict[str, int | str]:
        return memfd_identity(self._fd)

    def close(self) -> None:
        if not self._owned:
            return
        del self.tensor
        with contextlib.suppress(BufferError):  # views still alive here; the mapping goes with them
            self._map.close()
        for fd in self._owned:
            os.close(fd)
        self._owned = ()


class CpuShmExported(_MemfdArena):
    def __init__(self, nbytes: int, name: str = ARENA_NAME) -> None:
        self.nbytes = -(-max(nbytes, 1) // PAGE) * PAGE
        writable = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(writable, self.nbytes)
        self._map = mmap.mmap(writable, self.nbytes, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # after our mapping: it alone stays writable; F_SEAL_SEAL waits for ``_seal`` (freeze adds F_SEAL_WRITE)
        fcntl.fcntl(writable, fcntl.F_ADD_SEALS, ARENA_SEALS & ~fcntl.F_SEAL_SEAL)
        self.tensor = _frombuffer(self._map, self.nbytes)
        self._fd = os.open(f"/proc/self/fd/{writable}", os.O_RDONLY | os.O_CLOEXEC)  # engines' and identity()'s
        self._writable = writable  # only for the last seals (F_ADD_SEALS needs a writable fd), closed with them
        self._owned = (self._fd, writable)

    def export(self) -> tuple[dict[str, Any], list[int]]:
        self._seal(0)
        return super().export()

    def freeze(self) -> None:
        """Unmap our writable mapping (BufferError, nothing changed, while another view of ``tensor`` lives), add
        F_SEAL_WRITE and F_SEAL_SEAL, and map the bytes again read-only. Nothing once sealed."""
        if self._writable < 0:
            return
        self.tensor = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            self.tensor = _frombuffer(self._map, self.nbytes)
            raise
        self._seal(fcntl.F_SEAL_WRITE)
        # populated: every page stays mapped here too, so an engine's mapping of it is shared, not private
        self._map = mmap.mmap(self._fd, self.nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)
        self.tensor = _frombuffer(self._map, self.nbytes)

    def _seal(self, seals: int) -> None:
        """Add ``seals`` and F_SEAL_SEAL (after which no seal can be added) and close the writable fd; once."""
        if self._writable < 0:
            return
        fcntl.fcntl(self._writable, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
        os.close(self._writable)
        self._writable, self._owned = -1, (self._fd,)


def check_arena_fd(fd: int, nbytes: int) -> None:
    """ValueError unless ``fd`` is a memfd of exactly ``nbytes`` carrying every seal in ARENA_SEALS:
    anything else (a regular file, an unsealed memfd) could shrink under our mapping (SIGBUS on the
    next read) or change under it."""
    target = os.readlink(f"/proc/self/fd/{fd}")
    if not target.startswith("/memfd:"):
        raise ValueError(f"cpu-shm arena fd is {target!r}, not a memfd")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    missing = [name for bit, name in SEAL_NAMES.items() if not seals & bit]
    if missing:
        raise ValueError(f"cpu-shm arena memfd lacks the {', '.join(missing)} seal(s)")
    size = os.fstat(fd).st_size
    if size != nbytes:
        raise ValueError(f"cpu-shm arena memfd holds {size} bytes, the handle says {nbytes}")


def memfd_identity(fd: int) -> dict[str, int | str]:
    """The memfd's device and inode, and this boot's id (inode numbers start over after a reboot)."""
    info = os.fstat(fd)
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return {"dev": info.st_dev, "ino": info.st_ino, "boot_id": boot_id}


class CpuShmAdopted(_MemfdArena):
    """An arena a dead daemon made, served again from the read-only fd an engine kept. Read-only here too:
    the only writable mapping died with the daemon that filled it, and the seals forbid a new one."""

    def __init__(self, fd: int, nbytes: int) -> None:
        check_arena_fd(fd, nbytes)
        self._fd, self._owned = fd, (fd,)
        self.nbytes = nbytes
        self._map = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        self.tensor = _frombuffer(self._map, nbytes)


class CpuShmImported(ImportedArena):
    def __init__(self, fd: int, nbytes: int) -> None:
        try:
            check_arena_fd(fd, nbytes)
            self._identity = memfd_identity(fd)
            self._map = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.tensor = _frombuffer(self._map, nbytes)

    def identity(self) -> dict[str, int | str]:
        return self._identity

    def close(self) -> None:
        if getattr(self, "tensor", None) is None:
            return
        self.tensor = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # views still alive; the mapping goes with the last one
            self._map.close()


class CpuShmBackend(ArenaBackend):
    name = "cpu-shm"
    adoptable = True

    def allocate(self, nbytes: int, device: torch.device, name: str = ARENA_NAME) -> ExportedArena:
        if device.type != "cpu":
            raise ValueError(f"cpu-shm holds arenas in host memory; device {device} needs cuda-vmm or cuda-ipc")
        return CpuShmExported(nbytes, name)

    def import_arena(self, handle: dict[str, Any], fds: list[int], device: torch.device) -> ImportedArena:
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ValueError(f"cpu-shm expects exactly 1 fd, received {len(fds)}")
        nbytes = handle.get("nbytes")
        if type(nbytes) is not int or nbytes <= 0:
            os.close(fds[0])
            raise ValueError(f"cpu-shm handle has bad nbytes {nbytes!r}")
        return CpuShmImported(fds[0], nbytes)

    def adopt(self, handle: dict[str, Any], fd: int, device: torch.device) -> ExportedArena:
        """ValueError (``fd`` closed) unless ``fd`` is a memfd of ``handle``'s size carrying every arena seal."""
        try:
            if device.type != "cpu":
                raise ValueError(f"cpu-shm holds arenas in host memory, not on {device}")
            return CpuShmAdopted(fd, handle["nbytes"])
        except BaseException:
            os.close(fd)
            raise
