"""cuda-ipc: the arena is an ordinary torch CUDA tensor shared with torch's own CUDA IPC (cudaIpcMemHandle).

The fallback when cuda-bindings is missing. ``torch.multiprocessing.reductions.reduce_tensor`` gives the
arguments of ``rebuild_cuda_tensor``; we put them on the wire as JSON (bytes as base64, classes and dtypes
by name from a short allow-list, ints as ints), never as a pickle, and send no fds.

SECURITY: the 64-byte cudaIpcMemHandle inside the handle is a bearer token. Any process on the host that
can open the GPU and reads those bytes can map the daemon's memory read-write; no fd, uid check or
capability stands in its way. The daemon therefore only sends it over its 0600 Unix socket, and the
handle must never be logged, written to disk or served over TCP. Prefer cuda-vmm, whose fd cannot be
replayed by someone who merely read a message.

Each ``export()`` takes one slot in torch's producer-side reference counter that the importer gives back
when its tensor is freed, so call ``export()`` once per importer. Imported memory stays valid after the
exporter dies (measured on an H200: docs/architecture.md, "Measured facts"); the driver frees it when the last
process holding it lets go.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from hotweights.cache.backends.base import (
    ARENA_NAME,
    ArenaBackend,
    ExportedArena,
    ImportedArena,
    importing_device,
    require_cuda,
)

NAME = "cuda-ipc"

# The only classes a handle may name: a plain tensor over a (typed or untyped) storage.
_CLASSES: dict[str, type] = {
    "torch.Tensor": torch.Tensor,
    "torch.storage.TypedStorage": torch.storage.TypedStorage,
    "torch.storage.UntypedStorage": torch.UntypedStorage,
}

# rebuild_cuda_tensor's positional arguments, in order, and how each travels as JSON.
_FIELDS: tuple[tuple[str, str], ...] = (
    ("tensor_cls", "class"),
    ("tensor_size", "ints"),
    ("tensor_stride", "ints"),
    ("tensor_offset", "int"),
    ("storage_cls", "class"),
    ("dtype", "dtype"),
    ("storage_device", "int"),
    ("storage_handle", "bytes"),
    ("storage_size_bytes", "int"),
    ("storage_offset_bytes", "int"),
    ("requires_grad", "bool"),
    ("ref_counter_handle", "bytes"),
    ("ref_counter_offset", "int"),
    ("event_handle", "bytes?"),
    ("event_sync_required", "bool"),
)


def _class_name(cls: Any) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}"
    if _CLASSES.get(name) is not cls:
        raise RuntimeError(f"{NAME}: cannot export a {name}; only {sorted(_CLASSES)}")
    return name


def _device_index(value: Any) -> int:
    """torch hands the storage device as an index (older versions: a torch.device)."""
    return value.index if isinstance(value, torch.device) else int(value)


_ENCODE: dict[str, Callable[[Any], Any]] = {
    "class": _class_name,
    "ints": lambda v: [int(x) for x in v],
    "int": _device_index,
    "bytes": lambda v: base64.b64encode(bytes(v)).decode("ascii"),
    "bytes?": lambda v: None if v is None else base64.b64encode(bytes(v)).decode("ascii"),
    "bool": bool,
    "dtype": lambda v: str(v).removeprefix("torch."),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _decode_class(v: Any) -> type:
    if not isinstance(v, str) or v not in _CLASSES:
        raise ValueError(f"class {v!r} is not one of {sorted(_CLASSES)}")
    return _CLASSES[v]


def _decode_ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(_is_int(x) and x >= 0 for x in v):
        raise ValueError(f"expected a list of non-negative ints, got {v!r}")
    return tuple(v)


def _decode_int(v: Any) -> int:
    if not _is_int(v) or v < 0:
        raise ValueError(f"expected a non-negative int, got {v!r}")
    return v


def _decode_bytes(v: Any) -> bytes:
    if not isinstance(v, str):
        raise ValueError(f"expected base64 text, got {type(v).__name__}")
    try:
        return base64.b64decode(v.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise ValueError(f"bad base64: {e}") from e


def _decode_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected a bool, got {v!r}")
    return v


def _decode_dtype(v: Any) -> torch.dtype:
    dtype = getattr(torch, v, None) if isinstance(v, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {v!r}")
    return dtype


_DECODE: dict[str, Callable[[Any], Any]] = {
    "class": _decode_class,
    "ints": _decode_ints,
    "int": _decode_int,
    "bytes": _decode_bytes,
    "bytes?": lambda v: None if v is None else _decode_bytes(v),
    "bool": _decode_bool,
    "dtype": _decode_dtype,
}


def encode_args(args: tuple[Any, ...]) -> dict[str, Any]:
    """``reduce_tensor``'s argument tuple as a JSON-able dict keyed by argument name."""
    if len(args) != len(_FIELDS):
        raise RuntimeError(
            f"{NAME}: torch {torch.__version__} rebuilds CUDA tensors from {len(args)} arguments, "
            f"this backend knows {len(_FIELDS)}"
        )
    return {name: _ENCODE[kind](value) for (name, kind), value in zip(_FIELDS, args, strict=True)}


def decode_args(encoded: Any) -> tuple[Any, ...]:
    """The inverse of ``encode_args``; ValueError names the first malformed field."""
    if not isinstance(encoded, dict) or set(encoded) != {name for name, _ in _FIELDS}:
        raise ValueError(f"{NAME}: handle args must have exactly the fields {[name for name, _ in _FIELDS]}")
    out = []
    for name, kind in _FIELDS:
        try:
            out.append(_DECODE[kind](encoded[name]))
        except ValueError as e:
            raise ValueError(f"{NAME}: handle field {name}: {e}") from e
    return tuple(out)


class IpcExportedArena(ExportedArena):
    """The daemon's arena: a torch CUDA tensor from the caching allocator."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.device_index = tensor.device.index

    def export(self) -> tuple[dict[str, Any], list[int]]:
        """A fresh handle per call (one reference-counter slot each): call once per importer."""
        if not hasattr(self, "tensor"):
            raise RuntimeError(f"{NAME}: export() after close()")
        rebuild, args = reduce_tensor(self.tensor)
        if rebuild is not rebuild_cuda_tensor:
            raise RuntimeError(f"{NAME}: torch reduced the arena with {rebuild!r}, not rebuild_cuda_tensor")
        handle = {"backend": NAME, "nbytes": self.nbytes, "device_index": self.device_index, "args": encode_args(args)}
        return handle, []

    def close(self) -> None:
        """Drop the arena; torch frees the block once importers released their reference slots."""
        if hasattr(self, "tensor"):
            del self.tensor
            torch.cuda.ipc_collect()


class IpcImportedArena(ImportedArena):
    """An engine's view of the daemon's arena (mapped read-write: cudaIpc has no read-only mode)."""

    read_only = False

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.device_index = tensor.device.index

    def close(self) -> None:
        """Drop our reference; torch closes the IPC mapping when the last view is freed."""
        if hasattr(self, "tensor"):
            del self.tensor


def _parse_handle(handle: Any, device: torch.device) -> tuple[int, tuple[Any, ...]]:
    """Validate a handle against the importing device: (device index, rebuild_cuda_tensor's arguments)."""
    if not isinstance(handle, dict) or handle.get("backend") != NAME:
        raise ValueError(f"{NAME}: not a {NAME} handle")
    nbytes, exporter_index = handle.get("nbytes"), handle.get("device_index")
    if not _is_int(nbytes) or nbytes <= 0 or not _is_int(exporter_index):
        raise ValueError(f"{NAME}: bad nbytes {nbytes!r} or device_index {exporter_index!r}")
    args = decode_args(handle.get("args"))
    fields = dict(zip((name for name, _ in _FIELDS), args, strict=True))
    if fields["tensor_size"] != (nbytes,) or fields["tensor_stride"] != (1,) or fields["dtype"] != torch.uint8:
        raise ValueError(f"{NAME}: handle does not describe a flat uint8 tensor of {nbytes} bytes")
    if fields["storage_device"] != exporter_index:
        raise ValueError(
            f"{NAME}: handle names device {exporter_index} but its storage is on {fields['storage_device']}"
        )
    index = importing_device(NAME, exporter_index, device)
    return index, args


class CudaIpcBackend(ArenaBackend):
    """torch's CUDA IPC: works wherever torch has CUDA, no extra package."""

    name = NAME

    def allocate(self, nbytes: int, device: torch.device, name: str = ARENA_NAME) -> IpcExportedArena:
        """``name``: unused (no memfd)."""
        if nbytes <= 0:
            raise ValueError(f"{NAME}: nbytes must be positive, got {nbytes}")
        index = require_cuda(NAME, device)
        return IpcExportedArena(torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index)))

    def import_arena(self, handle: dict[str, Any], fds: list[int], device: torch.device) -> IpcImportedArena:
        for fd in fds:  # none expected; we own whatever came
            _close(fd)
        index, args = _parse_handle(handle, device)
        with torch.cuda.device(index):
            tensor = rebuild_cuda_tensor(*args)
        if tensor.dtype != torch.uint8 or tensor.shape != (handle["nbytes"],) or tensor.device.index != index:
            raise ValueError(f"{NAME}: rebuilt {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        return IpcImportedArena(tensor)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
