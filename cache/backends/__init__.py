"""Arena backends by name. Imported lazily: cuda-bindings is an optional extra."""

from __future__ import annotations

from importlib import import_module

import torch

from hotweights.cache.backends.base import ArenaBackend, BackendUnavailable

BACKENDS = {
    "cpu-shm": "hotweights.cache.backends.cpu_shm:CpuShmBackend",
    "cuda-vmm": "hotweights.cache.backends.cuda_vmm:CudaVmmBackend",
    "cuda-ipc": "hotweights.cache.backends.cuda_ipc:CudaIpcBackend",
}


def get_backend(name: str) -> ArenaBackend:
    """The backend called ``name``; BackendUnavailable says why one cannot run here."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(import_module(module), cls)()


def default_backend_name(device: torch.device) -> str:
    """cuda-vmm on CUDA (cuda-ipc when cuda-bindings is missing), cpu-shm on CPU."""
    if device.type != "cuda":
        return "cpu-shm"
    try:
        import_module("cuda.bindings.driver")
    except ImportError:
        return "cuda-ipc"
    return "cuda-vmm"
