"""The arena backend interface: one contiguous device allocation, exported once, imported by engines.

A backend turns "nbytes on this device" into a writable uint8 tensor in the daemon and a handle
description (JSON-able dict) plus file descriptors that another process of the same user on the
same host turns back into a uint8 tensor over the SAME memory. No bytes are copied on import.
Memory lifetime is the driver's or the kernel's business: an importer's mapping stays valid after
the exporter dies, until the importer closes it.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

import torch

ARENA_NAME = "hotweights-arena"  # a memfd holding weights
KV_NAME = "hotweights-kv"  # a memfd holding a KV cache (``cache.kvdeposits``)
LEDGER_NAME = "hotweights-kv-ledger"  # a memfd holding a KV cache's ledger


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (no CUDA, no cuda-bindings, unsupported driver); says which."""


class ExportedArena(ABC):
    """The daemon's side: owns the allocation, writable, exportable to any number of engines."""

    nbytes: int
    tensor: torch.Tensor  # uint8, shape [nbytes], on the arena's device, writable

    @abstractmethod
    def export(self) -> tuple[dict[str, Any], list[int]]:
        """(JSON-able handle description, fds to send with it). The fds stay owned by the arena:
        the caller sends them (the kernel duplicates them into the peer) and must not close them."""

    @abstractmethod
    def close(self) -> None:
        """Drop the daemon's reference. Engines that imported keep their mappings valid."""

    def identity(self) -> dict[str, int | str] | None:
        """What names this very allocation to the kernel (cpu-shm: the memfd's inode and the boot), so a
        successor daemon can tell the arena it recorded from any other; None where nothing does."""
        return None

    def freeze(self) -> None:
        """Once the arena is filled and hashed: make its bytes immutable for every process, this one included,
        where the backend can (cpu-shm: F_SEAL_WRITE); ``tensor`` stays readable. Every other view of ``tensor``
        must be dropped first. This default: nothing (CUDA memory has no such seal)."""
        return


class ImportedArena(ABC):
    """An engine's side: a read-mostly view of the daemon's arena. Engines never write to it."""

    nbytes: int
    tensor: torch.Tensor  # uint8, shape [nbytes], on the engine's device

    @abstractmethod
    def close(self) -> None:
        """Unmap. Every tensor viewing ``tensor`` must be dropped first."""

    def identity(self) -> dict[str, int | str] | None:
        """What names the mapped memory to the kernel (cpu-shm: the memfd's inode and the boot), so that a
        check of its bytes can be remembered for it (``cache.verified``); None where nothing does."""
        return None


class ArenaBackend(ABC):
    """A way to share one allocation between processes. ``name`` goes on the wire. ``adoptable``: an
    engine's fd is enough to serve the arena again after its daemon died (``adopt``)."""

    name: str
    adoptable: bool = False

    @abstractmethod
    def allocate(self, nbytes: int, device: torch.device, name: str = ARENA_NAME) -> ExportedArena:
        """Allocate at least ``nbytes`` (rounded up to the backend's granularity) on ``device``; ``name`` names a
        memfd where the backend makes one (what /proc/PID/maps shows: ARENA_NAME for weights, KV_NAME and
        LEDGER_NAME for KV caches). Raises BackendUnavailable if the backend cannot run here."""

    @abstractmethod
    def import_arena(self, handle: dict[str, Any], fds: list[int], device: torch.device) -> ImportedArena:
        """Map an arena exported by ``ExportedArena.export`` in another process. Takes ownership of
        ``fds`` (closes them when done with them). Raises BackendUnavailable or ValueError for a
        handle this backend cannot read."""

    def adopt(self, handle: dict[str, Any], fd: int, device: torch.device) -> ExportedArena:
        """Serve again an arena a dead daemon exported as ``handle``, from the fd an engine kept (re-adoption).
        Takes ownership of ``fd``. Raises ValueError for an fd of the wrong type, size or seals, and
        BackendUnavailable where the backend cannot adopt at all (this default: cuda-ipc, whose
        cudaIpcMemHandle cannot be shared again once its exporter is gone)."""
        os.close(fd)
        raise BackendUnavailable(f"{self.name} arenas cannot be re-adopted: their handle dies with the daemon")

    def warm_up(self, device: torch.device) -> None:
        """Do ahead of time what a process's first ``import_arena`` would do lazily (load libraries, take
        the driver's paths once), so the first real attach costs what later ones do. This default: nothing."""
        return


def require_cuda(backend: str, device: torch.device) -> int:
    """The CUDA device index ``device`` names; BackendUnavailable when torch sees no such device."""
    if device.type != "cuda":
        raise BackendUnavailable(f"{backend} shares CUDA memory; got device {device}")
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"{backend}: torch sees no CUDA device (torch {torch.__version__})")
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < torch.cuda.device_count():
        raise BackendUnavailable(f"{backend}: no CUDA device {index} (torch sees {torch.cuda.device_count()})")
    return index


def importing_device(backend: str, exporter_index: int, device: torch.device) -> int:
    """The device index an arena exported on ``exporter_index`` is imported on; ValueError for another
    device (checked before CUDA is touched, so the refusal is the same on any machine)."""
    if device.type == "cuda" and device.index is not None and device.index != exporter_index:
        raise ValueError(f"{backend}: arena lives on cuda:{exporter_index} but was imported on cuda:{device.index}")
    index = require_cuda(backend, device)
    if index != exporter_index:
        raise ValueError(f"{backend}: arena lives on cuda:{exporter_index} but was imported on cuda:{index}")
    return index
