"""The CUDA arena backends across real processes: fds over a Unix socketpair, handles as JSON over a Pipe.

The cross-process machinery and the four checks live once, in bench/gpu_backends_check.py; these tests run
its check functions and assert on what they return. Every helper process there is spawned daemonic, every
wait has a timeout, and children are killed on the way out: a child left alive keeps a GPU run from exiting
until its time limit (docs/architecture.md, "Measured facts").
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from bench.gpu_backends_check import (
    IMPORT_LIMIT_MS,
    MiB,
    check_import_time,
    check_roundtrip,
    check_sigkill,
    check_write_refused,
    check_wrong_device,
    cuda_ready,
    digest,
    fill,
)
from hotweights.cache.backends import get_backend
from hotweights.cache.backends.base import ArenaBackend

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ["cuda-vmm", "cuda-ipc"]
IMPORT_TARGET_MS = 50.0  # the design's budget for mapping one arena of any size; IMPORT_LIMIT_MS is enforced


def _backend(name: str) -> ArenaBackend:
    """The backend, or skip when cuda-vmm's optional cuda-bindings is not installed."""
    if name == "cuda-vmm":
        pytest.importorskip("cuda.bindings.driver", reason="cuda-vmm needs cuda-bindings")
    return get_backend(name)


@pytest.fixture
def device() -> torch.device:
    return cuda_ready(torch.cuda.current_device())


@pytest.mark.parametrize("name", BACKENDS)
def test_child_sees_parents_bytes(name: str, device: torch.device) -> None:
    arena = _backend(name).allocate(64 * MiB, device)
    try:
        assert arena.nbytes >= 64 * MiB and arena.tensor.dtype == torch.uint8 and arena.tensor.is_cuda
    finally:
        arena.close()
    res = check_roundtrip(name, device, 64 * MiB, seed=0)
    assert res["ok"], "the child's digest differs from the parent's"
    print(f"{name}: 64 MiB import {res['import_ms']:.2f} ms, read-only mapping: {res['read_only']}")


@pytest.mark.parametrize("name", BACKENDS)
def test_import_of_1gib_is_fast(name: str, device: torch.device) -> None:
    _backend(name)
    res = check_import_time(name, device)
    ms, warmup = res["import_ms"], res["warmup_ms"]
    print(f"{name}: 1 GiB import+map {ms:.2f} ms (target < {IMPORT_TARGET_MS} ms), one-time warm-up {warmup:.1f} ms")
    assert ms < IMPORT_LIMIT_MS
    assert res["ok"], "the child's digest differs from the parent's"


@pytest.mark.parametrize("name", BACKENDS)
def test_import_survives_exporter_sigkill(name: str, device: torch.device) -> None:
    _backend(name)
    res = check_sigkill(name, device)
    assert res["before"], "the imported bytes differ from the exporter's"
    assert res["after"], "the imported bytes changed after the exporter was SIGKILLed"
    assert res["ok"], "a matmul on the imported bytes was not finite, or the exporter is still alive"


@pytest.mark.parametrize("name", BACKENDS)
def test_import_on_the_wrong_device_is_refused(name: str, device: torch.device) -> None:
    backend = _backend(name)
    res = check_wrong_device(name, device)
    assert res["ok"], res["error"]
    assert f"cuda:{device.index}" in res["error"]
    # The handle's own device index is checked too: one that names another device is refused.
    arena = backend.allocate(2 * MiB, device)
    try:
        handle, fds = arena.export()
        moved = dict(handle, device_index=device.index + 1)
        with pytest.raises(ValueError):
            backend.import_arena(moved, [os.dup(fd) for fd in fds], device)
    finally:
        arena.close()


def test_cuda_ipc_rejects_malformed_handles(device: torch.device) -> None:
    backend = _backend("cuda-ipc")
    arena = backend.allocate(2 * MiB, device)
    try:
        handle, _ = arena.export()
        args = handle["args"]
        for bad in (
            dict(handle, args=dict(args, tensor_cls="os.system")),
            dict(handle, args=dict(args, storage_handle="not base64!")),
            dict(handle, args=dict(args, tensor_size=[4 * MiB])),
            dict(handle, args={k: v for k, v in args.items() if k != "event_handle"}),
            dict(handle, nbytes="2097152"),
        ):
            with pytest.raises(ValueError):
                backend.import_arena(bad, [], device)
    finally:
        arena.close()


def test_cuda_vmm_unmaps_only_after_the_last_view(device: torch.device) -> None:
    """close() with a view alive must not unmap under it (a later read would poison the context)."""
    arena = _backend("cuda-vmm").allocate(4 * MiB, device)
    fill(arena.tensor, seed=3)
    view = arena.tensor[MiB : 2 * MiB]
    expected = digest(view)
    arena.close()
    gc.collect()
    assert not arena.unmapped
    assert digest(view) == expected
    del view
    gc.collect()
    assert arena.unmapped


def test_cuda_vmm_importers_cannot_write_the_arena(device: torch.device) -> None:
    """The driver maps the arena PROT_READ into engines: a kernel writing it fails, the bytes stay.
    (cuda-ipc cannot give this guarantee: its handle maps read-write; see docs/operations.md.)"""
    _backend("cuda-vmm")
    res = check_write_refused("cuda-vmm", device)
    assert res["read_only"] is True, "the driver did not grant a read-only mapping"
    assert res["unchanged"], f"an importer overwrote the arena: {res}"
    assert res["ok"], res


def test_cuda_vmm_warm_up_leaves_no_memory_nor_fd_behind(device: torch.device) -> None:
    backend = _backend("cuda-vmm")
    backend.warm_up(device)  # the first one loads what it loads; the second must leave the process as it was
    fds_before, (free_before, _) = set(os.listdir("/proc/self/fd")), torch.cuda.mem_get_info(device)
    backend.warm_up(device)
    assert set(os.listdir("/proc/self/fd")) == fds_before
    assert torch.cuda.mem_get_info(device)[0] == free_before
