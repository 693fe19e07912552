"""cuda-vmm: one ``cuMemCreate`` allocation shared by a POSIX file descriptor (CUDA virtual memory management).

The daemon creates the physical allocation with ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``, maps it
read-write for itself and exports it once as an fd. The fd travels over the daemon's Unix socket
(SCM_RIGHTS), so only a process that was handed it can map the memory, unlike a cudaIpcMemHandle.
An engine imports the fd, reserves an address range, maps it and asks for read-only access
(falling back to read-write where the driver refuses). Import cost is one handle, not one per byte:
measured 1.1 ms for 4 GiB on an H200 (docs/architecture.md, "Measured facts").

The driver frees the physical memory only when every mapping is unmapped and every handle and fd is
released, so an engine's mapping survives the daemon's death.

Tear-down is tied to the tensor, not only to ``close()``: the mapping object is the tensor's owner
(torch holds a reference to the ``__cuda_array_interface__`` object), so unmapping happens once
``close()`` was called AND the last view of the arena is freed. Unmapping under a live view would turn
the next kernel that reads it into an illegal address error that poisons the whole CUDA context.

cuda-bindings is an optional extra; it is imported when the backend is used, not when this module is.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hotweights.cache.backends.base import (
    ARENA_NAME,
    ArenaBackend,
    BackendUnavailable,
    ExportedArena,
    ImportedArena,
    importing_device,
    require_cuda,
)

NAME = "cuda-vmm"
INSTALL_HINT = "pip install 'hotweights[cuda]'"
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY, a CUresult

_driver_lock = threading.Lock()
_driver_module: Any = None
_primary_contexts: dict[int, Any] = {}


def _driver() -> Any:
    """``cuda.bindings.driver``, initialised; BackendUnavailable (with the install hint) when it cannot load."""
    global _driver_module
    with _driver_lock:
        if _driver_module is not None:
            return _driver_module
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise BackendUnavailable(f"{NAME} needs cuda-bindings ({e}); install it with: {INSTALL_HINT}") from e
        try:
            result = driver.cuInit(0)
        except Exception as e:  # the bindings raise their own error when libcuda.so cannot be found
            raise BackendUnavailable(f"{NAME}: the CUDA driver cannot be loaded: {e}") from e
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            raise BackendUnavailable(f"{NAME}: cuInit failed: {_error_name(result[0])}")
        _driver_module = driver
        return driver


def _error_name(err: Any) -> str:
    """``CUDA_ERROR_...`` for a CUresult (the enum knows its name; no driver call needed)."""
    return f"{getattr(err, 'name', None) or 'CUresult'} ({int(err)})"


def _check(result: Any, what: str) -> Any:
    """Unwrap a cuda-bindings ``(CUresult, *values)`` tuple: raise RuntimeError naming the call and the
    error on failure (torch.OutOfMemoryError, a RuntimeError, when the device has no memory left), else return
    None, the one value, or the tuple of values. CUresult is an int enum."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) == OUT_OF_MEMORY:  # what torch's allocator raises too, so that callers handle both alike
        raise torch.OutOfMemoryError(f"{what} failed: {_error_name(err)}")
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {_error_name(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@contextmanager
def _on_device(drv: Any, index: int) -> Iterator[None]:
    """Make device ``index``'s primary context (the one torch uses) current on this thread, restoring
    torch's current device afterwards. torch may not have created that context yet, so retain it."""
    torch.cuda.init()
    with torch.cuda.device(index):
        ctx = _check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(ctx) == 0 or int(_check(drv.cuCtxGetDevice(), "cuCtxGetDevice")) != index:
            _check(drv.cuCtxSetCurrent(_primary_context(drv, index)), "cuCtxSetCurrent")
        yield


def _primary_context(drv: Any, index: int) -> Any:
    """Retain device ``index``'s primary context once per process (kept for the process's lifetime)."""
    with _driver_lock:
        if index not in _primary_contexts:
            dev = _check(drv.cuDeviceGet(index), "cuDeviceGet")
            _primary_contexts[index] = _check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        return _primary_contexts[index]


def _allocation_prop(drv: Any, index: int) -> Any:
    """Pinned device memory on ``index`` that can be exported as a POSIX fd."""
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _granularity(drv: Any, index: int) -> int:
    """The recommended granularity (a multiple of the minimum one that cuMemMap requires): 2 MiB on an H200."""
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(_check(drv.cuMemGetAllocationGranularity(_allocation_prop(drv, index), flag), "granularity"))


def _access_desc(drv: Any, index: int, read_only: bool) -> Any:
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = index
    flags = drv.CUmemAccess_flags
    desc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def _set_access(drv: Any, ptr: Any, size: int, index: int, read_only: bool) -> bool:
    """Grant this device access to the mapped range; with ``read_only``, try PROT_READ first and fall
    back to PROT_READWRITE when the driver refuses it. Returns whether the mapping is read-only."""
    if read_only:
        err = drv.cuMemSetAccess(ptr, size, [_access_desc(drv, index, True)], 1)[0]
        if err == drv.CUresult.CUDA_SUCCESS:
            return True
    _check(drv.cuMemSetAccess(ptr, size, [_access_desc(drv, index, False)], 1), "cuMemSetAccess(READWRITE)")
    return False


class _Mapping:
    """A mapped virtual address range; the owner object of the tensor that views it.

    torch keeps a reference to the ``__cuda_array_interface__`` object for as long as the tensor's
    storage lives, so ``__del__`` (unmap and free the range) runs only when the last view is gone and
    the arena has dropped its own reference."""

    def __init__(self, drv: Any, index: int, ptr: Any, size: int) -> None:
        self._drv, self.index, self.ptr, self.size = drv, index, ptr, size
        self._mapped = True

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"version": 3, "shape": (self.size,), "typestr": "|u1", "data": (int(self.ptr), False), "strides": None}

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the whole range, zero-copy (checked: a copy would silently break sharing)."""
        with torch.cuda.device(self.index):
            t = torch.as_tensor(self, dtype=torch.uint8, device=torch.device("cuda", self.index))
        if t.data_ptr() != int(self.ptr) or t.numel() != self.size:
            raise RuntimeError(f"{NAME}: torch.as_tensor copied the mapping instead of viewing it")
        return t

    def release(self) -> None:
        """Wait for queued kernels (they may still read the range), then unmap and free it. Idempotent."""
        if not self._mapped:
            return
        self._mapped = False
        drv = self._drv
        with _on_device(drv, self.index):
            _check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
            _check(drv.cuMemUnmap(self.ptr, self.size), "cuMemUnmap")
            _check(drv.cuMemAddressFree(self.ptr, self.size), "cuMemAddressFree")

    def __del__(self) -> None:
        try:
            self.release()
        except Exception as e:  # a destructor cannot raise; at interpreter exit the driver may be gone
            warnings.warn(f"{NAME}: unmapping failed: {e}", ResourceWarning, stacklevel=1)


def _map(drv: Any, index: int, handle: Any, size: int, read_only: bool) -> tuple[_Mapping, bool]:
    """Reserve an address range, map ``handle`` into it and grant access; on failure undo what was done
    (best effort: the original error is the one worth raising)."""
    ptr = _check(drv.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
    try:
        _check(drv.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
    except BaseException:
        drv.cuMemAddressFree(ptr, size)
        raise
    try:
        granted_read_only = _set_access(drv, ptr, size, index, read_only)
    except BaseException:
        drv.cuMemUnmap(ptr, size)
        drv.cuMemAddressFree(ptr, size)
        raise
    return _Mapping(drv, index, ptr, size), granted_read_only


class _MappedArena:
    """What both sides share: a tensor over a mapping, and a close() that drops the references to it."""

    _mapping: _Mapping | None
    tensor: torch.Tensor

    def _adopt(self, mapping: _Mapping) -> None:
        self._mapping = mapping
        self._mapping_ref = weakref.ref(mapping)
        self.device_index = mapping.index
        self.nbytes = mapping.size
        self.tensor = mapping.tensor()

    @property
    def unmapped(self) -> bool:
        """True once close() ran and the last view of ``tensor`` is gone, i.e. the range is unmapped here."""
        return self._mapping is None and self._mapping_ref() is None

    def _drop(self) -> None:
        """Forget the tensor and the mapping: unmapped now if no view is left, else with the last view."""
        if self._mapping is not None:
            self._mapping = None
            del self.tensor


class VmmExportedArena(_MappedArena, ExportedArena):
    """The daemon's arena: keeps the allocation handle (and the exported fd, made once) until close()."""

    def __init__(self, mapping: _Mapping, handle: Any, granularity: int, requested: int) -> None:
        self._adopt(mapping)
        self._handle: Any | None = handle
        self._fd: int | None = None
        self.requested_nbytes = requested
        self.granularity = granularity

    def export(self) -> tuple[dict[str, Any], list[int]]:
        if self._mapping is None:
            raise RuntimeError(f"{NAME}: export() after close()")
        if self._fd is None:
            drv = self._mapping._drv
            fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            with _on_device(drv, self.device_index):
                fd = _check(drv.cuMemExportToShareableHandle(self._handle, fd_type, 0), "cuMemExportToShareableHandle")
            self._fd = int(fd)
        handle = {
            "backend": NAME,
            "nbytes": self.nbytes,
            "device_index": self.device_index,
            "device_uuid": _device_uuid(self.device_index),
            "granularity": self.granularity,
            "handle_type": "posix-fd",
        }
        return handle, [self._fd]

    def close(self) -> None:
        """Close the exported fd and release the allocation handle now (the driver keeps the memory while
        any mapping of it exists); the daemon's own mapping goes with the last view. Engines keep theirs."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        if self._handle is not None:
            drv = self._mapping._drv if self._mapping is not None else _driver()
            handle, self._handle = self._handle, None
            with _on_device(drv, self.device_index):
                _check(drv.cuMemRelease(handle), "cuMemRelease")
        self._drop()


class VmmAdoptedArena(_MappedArena, ExportedArena):
    """An arena a dead daemon exported, served again from the fd an engine kept (facts/vmm_readopt.md): an
    imported handle cannot be exported again, but that fd can be handed on as it is."""

    def __init__(self, mapping: _Mapping, fd: int, handle: dict[str, Any]) -> None:
        self._adopt(mapping)
        self._fd: int | None = fd
        self._handle_description = dict(handle)

    def export(self) -> tuple[dict[str, Any], list[int]]:
        if self._fd is None:
            raise RuntimeError(f"{NAME}: export() after close()")
        return dict(self._handle_description), [self._fd]

    def close(self) -> None:
        """Close the kept fd; the mapping goes with the last view. Engines keep theirs."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self._drop()


class VmmImportedArena(_MappedArena, ImportedArena):
    """An engine's mapping of the daemon's arena. ``read_only`` says whether the driver granted PROT_READ
    (if not, the mapping is read-write and engines must simply not write)."""

    def __init__(self, mapping: _Mapping, read_only: bool) -> None:
        self._adopt(mapping)
        self.read_only = read_only

    def close(self) -> None:
        """Drop the engine's references; the range is unmapped when the last view is freed (now, if none)."""
        self._drop()


def _device_uuid(index: int) -> str | None:
    """The GPU's UUID, to catch daemon and engine seeing different GPUs under the same index
    (different CUDA_VISIBLE_DEVICES). None where torch does not report it."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else str(uuid)


def _parse_handle(handle: dict[str, Any], fds: list[int], device: torch.device) -> tuple[int, int]:
    """Validate a handle description against the importing device: (device index, mapped size).
    The device check comes first and needs no GPU: a wrong index is a caller's error, not unavailability."""
    if not isinstance(handle, dict) or handle.get("backend") != NAME:
        raise ValueError(f"{NAME}: not a {NAME} handle: {handle!r}")
    nbytes, exporter_index = handle.get("nbytes"), handle.get("device_index")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ValueError(f"{NAME}: bad nbytes {nbytes!r}")
    if not isinstance(exporter_index, int) or isinstance(exporter_index, bool):
        raise ValueError(f"{NAME}: bad device_index {exporter_index!r}")
    index = importing_device(NAME, exporter_index, device)
    ours, theirs = _device_uuid(index), handle.get("device_uuid")
    if ours is not None and theirs is not None and ours != theirs:
        raise ValueError(f"{NAME}: arena lives on GPU {theirs} but cuda:{index} here is GPU {ours}")
    if len(fds) != 1:
        raise ValueError(f"{NAME}: expected exactly one fd, got {len(fds)}")
    return index, nbytes


class CudaVmmBackend(ArenaBackend):
    """cuMemCreate + POSIX fd export: the default CUDA backend."""

    name = NAME
    adoptable = True

    def allocate(self, nbytes: int, device: torch.device, name: str = ARENA_NAME) -> VmmExportedArena:
        """``name``: unused (no memfd)."""
        if nbytes <= 0:
            raise ValueError(f"{NAME}: nbytes must be positive, got {nbytes}")
        index = require_cuda(NAME, device)
        drv = _driver()
        with _on_device(drv, index):
            granularity = _granularity(drv, index)
            size = -(-nbytes // granularity) * granularity
            handle = _check(drv.cuMemCreate(size, _allocation_prop(drv, index), 0), "cuMemCreate")
            try:
                mapping, _ = _map(drv, index, handle, size, read_only=False)
                return VmmExportedArena(mapping, handle, granularity, nbytes)
            except BaseException:
                drv.cuMemRelease(handle)
                raise

    def import_arena(self, handle: dict[str, Any], fds: list[int], device: torch.device) -> VmmImportedArena:
        owned = list(fds)  # ours to close, whatever happens
        try:
            index, size = _parse_handle(handle, owned, device)
            drv = _driver()
            fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            with _on_device(drv, index):
                alloc = _check(drv.cuMemImportFromShareableHandle(owned[0], fd_type), "cuMemImportFromShareableHandle")
                _close_fds(owned)  # the imported handle holds the memory now
                try:
                    mapping, read_only = _map(drv, index, alloc, size, read_only=True)
                except BaseException:
                    drv.cuMemRelease(alloc)
                    raise
                # The mapping keeps the memory alive; the imported handle is not needed any more.
                _check(drv.cuMemRelease(alloc), "cuMemRelease")
                return VmmImportedArena(mapping, read_only)
        finally:
            _close_fds(owned)

    def warm_up(self, device: torch.device) -> None:
        """One granule through every call an attach makes (allocate, export, import, map read-only, view,
        unmap): the first real attach then finds cuda-bindings imported and the driver's paths taken."""
        exported = self.allocate(1, device)
        try:
            handle, fds = exported.export()
            self.import_arena(handle, [os.dup(fds[0])], device).close()
        finally:
            exported.close()

    def adopt(self, handle: dict[str, Any], fd: int, device: torch.device) -> VmmAdoptedArena:
        """Import the engine's fd, check it is a POSIX-fd allocation on this device, map ``handle``'s size
        (the driver refuses a smaller allocation) read-only, and keep the fd to export it again."""
        owned = [fd]
        try:
            index, size = _parse_handle(handle, owned, device)
            drv = _driver()
            fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            with _on_device(drv, index):
                alloc = _checked_import(drv, fd, fd_type)
                try:
                    _check_allocation(drv, alloc, index)
                    mapping, _ = _map(drv, index, alloc, size, read_only=True)
                except RuntimeError as exc:
                    raise ValueError(f"{NAME}: the engine's allocation cannot be mapped as the arena: {exc}") from None
                finally:
                    drv.cuMemRelease(alloc)  # the mapping (if any) keeps the memory alive
            owned.clear()
            return VmmAdoptedArena(mapping, fd, handle)
        finally:
            _close_fds(owned)


def _checked_import(drv: Any, fd: int, fd_type: Any) -> Any:
    """The allocation behind ``fd``; ValueError when the driver does not take it for one of ours."""
    try:
        return _check(drv.cuMemImportFromShareableHandle(fd, fd_type), "cuMemImportFromShareableHandle")
    except RuntimeError as exc:
        raise ValueError(f"{NAME}: the engine's fd is not a CUDA allocation: {exc}") from None


def _check_allocation(drv: Any, alloc: Any, index: int) -> None:
    """ValueError unless ``alloc`` lives on device ``index``. (That it was shared as a POSIX fd the import
    itself proved; an imported handle's properties report no requested handle types, measured on the H200.)"""
    prop = _check(drv.cuMemGetAllocationPropertiesFromHandle(alloc), "cuMemGetAllocationPropertiesFromHandle")
    if int(prop.location.id) != index:
        location = int(prop.location.id)
        raise ValueError(f"{NAME}: the engine's allocation lives on cuda:{location}, the arena on cuda:{index}")


def _close_fds(fds: list[int]) -> None:
    """Close and forget every fd in ``fds`` (a list this module owns), so a second call closes nothing."""
    while fds:
        fd = fds.pop()
        with contextlib.suppress(OSError):
            os.close(fd)
