"""Decode attention with each row's KV length as device data: split-KV ("flash decoding") on CUDA.

A decode step has one query token per row. Attending with ``F.scaled_dot_product_attention`` over a fixed
number of cache positions and an additive mask costs every step the fixed number, not the rows' lengths
(on ``xl`` at 4096 positions ~8 ms a step more than at 64, "Measured facts" in ``docs/architecture.md``),
so that path needs a shape per KV length. Here the length of each row is a tensor on the device, read by
the kernels (``standby.decodekernels``, Triton), so one shape, and one CUDA graph, serves every length:

- stage 1, one program per (row, kv head, split of SPLIT positions): the g = nh / nkv query heads that
  share the kv head attend, with an online softmax in float32, over the split's positions below the row's
  length, BLOCK_N at a time, each position's keys and values read from the block the row's block table names
  (the paged cache, ``standby.kvpool``); it writes their partial output and log-sum-exp to a scratch area. A
  program whose split starts at or beyond the length writes nothing.
- stage 2, one program per (row, q head): the partial outputs of the splits that hold positions
  (ceil(length / SPLIT)), combined in split order by their log-sum-exp, cast to the model's dtype.

SPLIT = 256 positions: at the default 4096 KV positions a batch-1 step of ``xl`` (8 kv heads) runs
16 x 8 = 128 stage-1 programs at its longest, about one per SM of an H100 (132), each reading
256 x 128 x 2 x 2 bytes = 128 KiB of keys and values in 4 tiles; shorter rows leave the later splits idle
(they exit at once), and stage 2 combines at most 16 partials. The number of splits is fixed by the
positions a row may hold, never by the batch, and a row's result depends only on its own query, keys, values
and length: the batch size never changes a row's bits (what ``batch_invariant`` needs of attention), nor do the
blocks its positions lie in.

Everything a step launches is fixed by its shapes: the scratch is allocated per step at a shape fixed by
(rows, heads, positions), nothing syncs with the host, nothing branches in Python on device values; so
the step can be captured in a CUDA graph and replayed at any lengths. ``reference`` is the same math in
plain torch (float32, the same splits and combination) over keys and values in order (``gathered``
puts a row's blocks in order), what the kernels are tested against, and what every call is checked against within
``fused.checking`` (the engine's kernel check at warm-up, ``standby.kernelcheck``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotweights.standby import fused
from hotweights.standby.kvpool import blocks_for

SPLIT = 256  # KV positions per stage-1 program (module docstring)
BLOCK_N = 64  # KV positions per tile of a stage-1 program's loop; divides SPLIT
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Head dims the kernels take: powers of two in this range. A tile of BLOCK_N keys and one of values at 128 dims
# fit twice (the loop's two stages) in an SM's shared memory with room to spare; larger head dims keep masked SDPA.
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
CHECKED = "split-KV attention"  # its calls' name in ``fused.checking``'s departures
PLAIN_ROWS = 8  # rows ``SplitKv.plain`` computes at once


def supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels serve a model on ``device`` in ``dtype`` with ``head_dim``: CUDA with Triton, a
    dtype of DTYPES, a power-of-two head dim in [MIN_HEAD_DIM, MAX_HEAD_DIM]."""
    head_dim_fits = head_dim & (head_dim - 1) == 0 and MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM
    return fused.TRITON and device.type == "cuda" and dtype in DTYPES and head_dim_fits


def splits(positions: int) -> int:
    """Stage 1's splits over a cache of ``positions`` KV positions."""
    return -(-positions // SPLIT)


@dataclass(frozen=True)
class SplitKv:
    """How one decode step's attention reads the cache: each row's length and block table, and the stage-1 scratch,
    made once per step and shared by its layers (they run one after another on one stream)."""

    lengths: torch.Tensor  # (B,) integer: row b attends to positions 0 .. lengths[b] - 1, 1 <= lengths[b] <= S
    table: torch.Tensor  # (B, W) int32: row b's position p is in block table[b, p // BLOCK_SIZE] (standby.kvpool)
    partial: torch.Tensor  # (B, nh, splits, hd) float32: each split's output
    lse: torch.Tensor  # (B, nh, splits) float32: each split's log-sum-exp
    scale: float
    positions: int  # S, the most a row holds

    @classmethod
    def for_step(cls, lengths: torch.Tensor, table: torch.Tensor, heads: int, positions: int, head_dim: int) -> SplitKv:
        """For ``lengths`` (B,) and ``table`` (B, W) on the device, ``heads`` q heads, rows of up to ``positions`` KV
        positions."""
        shape = (lengths.shape[0], heads, splits(positions))
        partial = torch.empty((*shape, head_dim), dtype=torch.float32, device=lengths.device)
        lse = torch.empty(shape, dtype=torch.float32, device=lengths.device)
        return cls(lengths, table, partial, lse, head_dim**-0.5, positions)

    def attend(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """q (B, nh, hd) after RoPE; cache_k/v a layer's blocks (blocks, BLOCK_SIZE, nkv, hd), any strides: (B, nh,
        hd) in q's dtype."""
        from hotweights.standby import decodekernels  # Triton only where the kernels run

        return fused.checked(
            CHECKED, decodekernels.attend(q, cache_k, cache_v, self), lambda: self.plain(q, cache_k, cache_v)
        )

    def plain(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """``attend``'s result computed by ``reference`` over each row's positions, read in order through its table,
        PLAIN_ROWS rows at a time (on ``xl`` at 4096 positions ~0.4 GB at once, where 64 rows would take 3.5 GB beside
        the engines of a device that is filling up)."""
        out = []
        for start in range(0, q.shape[0], PLAIN_ROWS):
            rows = slice(start, start + PLAIN_ROWS)
            k, v = (gathered(cache, self.table[rows], self.positions).transpose(1, 2) for cache in (cache_k, cache_v))
            out.append(reference(q[rows], k, v, self.lengths[rows], self.scale))
        return torch.cat(out)


def gathered(blocks: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of each row of ``table`` (B, W) from a layer's ``blocks`` (blocks, BLOCK_SIZE,
    nkv, hd), in order: (B, length, nkv, hd), a copy."""
    index = table[:, : blocks_for(length)].long()  # (B, n); no copy where ``table`` is already that (``MaskedReads``)
    rows = blocks.index_select(0, index.flatten())  # (B x n, BLOCK_SIZE, nkv, hd): on CPU ~6x an indexing's speed
    return rows.view(index.shape[0], -1, *blocks.shape[2:])[:, :length]


def reference(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """The kernels' math in plain torch: per split of SPLIT positions a softmax over the row's positions in it
    (float32, probabilities rounded to the values' dtype before they weight them, as the kernel's product does),
    then the splits combined by their log-sum-exp. Shapes as for ``SplitKv.attend``."""
    B, nh, hd = q.shape
    nkv, S = cache_k.shape[1], cache_k.shape[2]
    n = splits(S)
    pad = n * SPLIT - S
    k = torch.nn.functional.pad(cache_k.float(), (0, 0, 0, pad))  # (B, nkv, n * SPLIT, hd)
    v = torch.nn.functional.pad(cache_v.float(), (0, 0, 0, pad))
    qf = q.float().view(B, nkv, nh // nkv, hd)
    scores = torch.einsum("bkgd,bksd->bkgs", qf, k) * scale  # (B, nkv, g, n * SPLIT)
    valid = torch.arange(n * SPLIT, device=q.device) < lengths.to(q.device)[:, None]  # (B, n * SPLIT)
    scores = scores.masked_fill(~valid[:, None, None], float("-inf")).unflatten(-1, (n, SPLIT))
    top = scores.amax(-1)  # (B, nkv, g, n): -inf for a split with no position
    held = torch.isfinite(top)
    p = torch.exp(scores - torch.where(held, top, 0.0)[..., None])  # 0 where masked
    total = p.sum(-1)
    p = p.to(cache_v.dtype).float()
    out = torch.einsum("bkgns,bknsd->bkgnd", p, v.unflatten(2, (n, SPLIT))) / torch.where(held, total, 1.0)[..., None]
    lse = torch.where(held, top + torch.log(total), float("-inf"))  # (B, nkv, g, n)
    weight = torch.exp(lse - lse.amax(-1, keepdim=True))  # 0 for the splits with no position
    combined = (weight[..., None] * out).sum(-2) / weight.sum(-1)[..., None]  # (B, nkv, g, hd)
    return combined.reshape(B, nh, hd).to(q.dtype)
