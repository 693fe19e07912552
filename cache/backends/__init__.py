"""Arena backends by name. Imported lazily: cuda-bindings is an optional extra."""

from __future__ import annotations

import contextlib
import threading
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


def device_context(device: str | torch.device) -> threading.Thread:
    """A started thread that makes ``device``'s CUDA context and warms its default backend up
    (``ArenaBackend.warm_up``); nothing on another device. That takes ~0.1 s: a process starts this, does
    other start-up work meanwhile (reading the checkpoint's headers), then joins it. A failure is left
    to the caller's own use of the device, which reports it."""

    def make() -> None:
        with contextlib.suppress(Exception):
            target = torch.device(device)
            if target.type == "cuda":
                torch.empty(1, device=target)
                get_backend(default_backend_name(target)).warm_up(target)

    thread = threading.Thread(target=make, name="hw-cuda-context", daemon=True)
    thread.start()
    return thread
