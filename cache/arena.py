"""The arena layout: every processed tensor at an aligned offset inside one allocation.

One allocation means one handle to open, so attaching costs the same for 1 GB and for 100 GB;
the per-tensor work on the engine side is only making views. The manifest (name -> dtype, shape,
offset, nbytes) travels as JSON; the content hash (``cache.digest``) lets ``cache verify`` show the bytes unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hotweights.cache.protocol import HEX
from hotweights.dtypes import ARENA_DTYPES

ALIGNMENT = 256  # bytes; enough for vectorised CPU and CUDA kernels


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_json(cls, row: object, arena_nbytes: int) -> TensorEntry:
        """Strict parse of one manifest row; a bad row raises ValueError naming it. Checked: a name,
        a dtype of ``ARENA_DTYPES``, non-negative int dims, an aligned int offset, nbytes == numel * itemsize,
        and the bytes inside ``arena_nbytes``."""
        try:
            name, dtype, shape, offset, nbytes = row  # type: ignore[misc]
            entry = cls(name, dtype, tuple(shape), offset, nbytes)
        except (TypeError, ValueError):
            raise ValueError(f"malformed manifest row {str(row)[:200]}") from None
        if not isinstance(name, str) or not all(_is_count(v) for v in (*entry.shape, offset, nbytes)):
            raise ValueError(f"manifest row {str(row)[:200]}: name must be a string, dims/offset/nbytes ints >= 0")
        if entry.dtype not in ARENA_DTYPES:
            raise ValueError(f"manifest tensor {name!r} has unknown dtype {entry.dtype!r}")
        expected = math.prod(entry.shape) * ARENA_DTYPES[entry.dtype].itemsize
        if entry.nbytes != expected:
            raise ValueError(f"manifest tensor {name!r}: nbytes {nbytes} but shape and dtype need {expected}")
        if offset % ALIGNMENT:
            raise ValueError(f"manifest tensor {name!r}: offset {offset} is not a multiple of {ALIGNMENT}")
        if offset + nbytes > arena_nbytes:
            end = offset + nbytes
            raise ValueError(f"manifest tensor {name!r}: bytes {offset}..{end} overrun the {arena_nbytes}-byte arena")
        return entry


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def check_disjoint(entries: list[TensorEntry]) -> None:
    """ValueError naming the first two tensors whose bytes overlap (or share a name)."""
    names = set()
    previous: TensorEntry | None = None
    for entry in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        if entry.name in names:
            raise ValueError(f"manifest names tensor {entry.name!r} twice")
        names.add(entry.name)
        if entry.nbytes == 0:
            continue
        if previous is not None and entry.offset < previous.offset + previous.nbytes:
            raise ValueError(f"manifest tensors {previous.name!r} and {entry.name!r} overlap at byte {entry.offset}")
        previous = entry


def manifest_entries(manifest: dict) -> list[TensorEntry]:
    """A manifest's rows, checked strictly: sizes (0 < used_bytes <= arena_bytes), alignment, the content hash's
    format, and every row (``TensorEntry.from_json``, ``check_disjoint``). ValueError naming the fault."""
    arena_bytes, used = manifest.get("arena_bytes"), manifest.get("used_bytes")
    if not (type(arena_bytes) is int and type(used) is int and 0 < used <= arena_bytes):
        raise ValueError(f"used_bytes {used!r} and arena_bytes {arena_bytes!r} must be ints, 0 < used <= arena")
    if manifest.get("alignment") != ALIGNMENT:
        raise ValueError(f"alignment {manifest.get('alignment')!r}, expected {ALIGNMENT}")
    content = manifest.get("content_hash")
    if not isinstance(content, str) or not HEX.fullmatch(content):
        raise ValueError(f"content_hash {str(content)[:80]!r} is not a 64-digit hex digest")
    rows = manifest.get("tensors")
    if not isinstance(rows, list):
        raise ValueError("'tensors' must be a list of rows")
    entries = [TensorEntry.from_json(row, used) for row in rows]
    check_disjoint(entries)
    return entries


def plan_layout(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[TensorEntry], int]:
    """Aligned offsets in the given order; returns (entries, bytes needed)."""
    entries, offset = [], 0
    for name, (shape, dtype) in specs.items():
        offset = -(-offset // ALIGNMENT) * ALIGNMENT
        nbytes = math.prod(shape) * dtype.itemsize
        entries.append(TensorEntry(name, str(dtype).removeprefix("torch."), tuple(shape), offset, nbytes))
        offset += nbytes
    return entries, max(offset, 1)


def view(arena: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """A zero-copy typed view of one tensor inside the uint8 arena."""
    return arena[entry.offset : entry.offset + entry.nbytes].view(ARENA_DTYPES[entry.dtype]).view(entry.shape)


def views(arena: torch.Tensor, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """All views at once: one typed view of the arena per dtype, then one ``as_strided`` per tensor.

    Same result as ``view`` per entry with a third of the per-tensor torch calls, which is what
    attach time is made of once the arena is mapped.
    """
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = {}
    for entry in entries:
        dtype = ARENA_DTYPES[entry.dtype]
        base = typed.get(dtype)
        if base is None:
            usable = arena.numel() // dtype.itemsize * dtype.itemsize
            base = typed[dtype] = arena[:usable].view(dtype)
        out[entry.name] = base.as_strided(entry.shape, _contiguous_strides(entry.shape), entry.offset // dtype.itemsize)
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))
