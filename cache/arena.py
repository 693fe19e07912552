"""The arena layout: every processed tensor at an aligned offset inside one allocation.

One allocation means one handle to open, so attaching costs the same for 1 GB and for 100 GB;
the per-tensor work on the engine side is only making views. The manifest (name -> dtype, shape,
offset, nbytes) travels as JSON; the content hash lets ``cache verify`` prove the bytes unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hotweights.dtypes import ARENA_DTYPES

ALIGNMENT = 256  # bytes; enough for vectorised CPU and CUDA kernels
HASH_CHUNK_WORDS = 1 << 17  # 1 MiB of int64 words per hashed row
HASH_BATCH_ROWS = 64  # rows hashed per step: bounds the temporary to 64 MiB



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
        """Strict parse of one manifest row; a bad row raises ValueError naming it."""
        try:
            name, dtype, shape, offset, nbytes = row  # type: ignore[misc]
            entry = cls(str(name), str(dtype), tuple(int(d) for d in shape), int(offset), int(nbytes))
        except (TypeError, ValueError):
            raise ValueError(f"malformed manifest row {row!r}") from None
        if entry.dtype not in ARENA_DTYPES:
            raise ValueError(f"manifest tensor {entry.name!r} has unknown dtype {entry.dtype!r}")
        expected = math.prod(entry.shape) * ARENA_DTYPES[entry.dtype].itemsize
        if entry.nbytes != expected or entry.offset < 0 or entry.offset + entry.nbytes > arena_nbytes:
            raise ValueError(f"manifest tensor {entry.name!r} does not fit the arena ({entry})")
        return entry


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


def content_hash(arena: torch.Tensor, nbytes: int) -> str:
    """A position-weighted sum mod 2**64 of the arena's first ``nbytes`` (rounded to whole words).

    Runs where the arena lives (GB/s on a GPU). Any change to one word changes the sum: every
    weight is odd, so a nonzero difference times it is nonzero mod 2**64; weights differ by
    position, so swapped blocks are caught too. For corruption detection, not for adversaries.
    """
    words_n = -(-nbytes // 8)
    padded = words_n * 8
    if padded > arena.numel():
        raise ValueError(f"cannot hash {nbytes} bytes of a {arena.numel()}-byte arena")
    words = arena[:padded].view(torch.int64)
    gen = torch.Generator().manual_seed(0x5EED)
    weights = (torch.randint(0, 2**62, (HASH_CHUNK_WORDS,), generator=gen) * 2 + 1).to(arena.device)
    total = torch.zeros((), dtype=torch.int64, device=arena.device)
    full_rows = words_n // HASH_CHUNK_WORDS
    rows = words[: full_rows * HASH_CHUNK_WORDS].view(full_rows, HASH_CHUNK_WORDS)
    for start in range(0, full_rows, HASH_BATCH_ROWS):
        batch = rows[start : start + HASH_BATCH_ROWS]
        row_sums = (batch * weights).sum(dim=1)
        positions = torch.arange(start, start + batch.shape[0], device=arena.device) * 2 + 1
        total += (row_sums * positions).sum()
    tail = words[full_rows * HASH_CHUNK_WORDS :]
    if tail.numel():
        total += (tail * weights[: tail.numel()]).sum() * (2 * full_rows + 1)
    return f"{int(total.item()) & 0xFFFFFFFFFFFFFFFF:016x}"
