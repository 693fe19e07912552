"""The Triton kernels of split-KV decode attention (``standby.decodeattention`` says what they compute and why).

Imported only where they run (CUDA with Triton; Triton's interpreter in the tests). Offsets that grow with the
cache (block and head bases) are 64-bit: a layer's pool of 8 kv heads x 128 dims per position is past 2**31 elements
beyond 2 million positions.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from hotweights.standby.decodeattention import BLOCK_N, SPLIT
from hotweights.standby.kvpool import BLOCK_SIZE

if TYPE_CHECKING:
    from hotweights.standby.decodeattention import SplitKv

# Triton's interpreter (the CPU tests) multiplies bfloat16 tiles as their bit patterns; there they are multiplied in
# float32 instead, the same products (one of two bfloat16 values is exact in float32), summed in float32 as on a GPU.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MIN_DOT = 16  # tl.dot's smallest M: the g query heads of a kv head are padded up to it
STAGE1_WARPS, STAGE1_STAGES, STAGE2_WARPS = 4, 2, 2


@triton.jit
def _partials(
    q_ptr,
    k_ptr,
    v_ptr,
    lengths_ptr,
    table_ptr,
    partial_ptr,
    lse_ptr,
    scale,
    positions,
    q_sb,
    q_sh,
    q_sd,
    k_sblock,
    k_ss,
    k_sh,
    k_sd,
    v_sblock,
    v_ss,
    v_sh,
    v_sd,
    t_sb,
    p_sb,
    p_sh,
    p_ss,
    l_sb,
    l_sh,
    GROUP: tl.constexpr,
    GROUP_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT_N: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (row, kv head, split): its GROUP q heads over the split's positions below the row's length, each read
    from the block of PAGE positions the row's table names."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    length = tl.minimum(tl.load(lengths_ptr + b).to(tl.int32), positions)
    start = split * SPLIT_N
    end = tl.minimum(start + SPLIT_N, length)
    g = tl.arange(0, GROUP_BLOCK)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK)
    heads = kv_head * GROUP + g  # (GROUP_BLOCK,) q heads; rows g >= GROUP are padding
    in_group = g < GROUP
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :] * q_sd, mask=in_group[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + kv_head * k_sh
    v_base = v_ptr + kv_head * v_sh
    table = table_ptr + b * t_sb
    top = tl.full([GROUP_BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_BLOCK], tl.float32)
    acc = tl.zeros([GROUP_BLOCK, HEAD_DIM], tl.float32)
    for first in range(start, end, BLOCK):  # no iteration where the split starts at or past the length
        pos = first + n
        held = pos < end  # the tile's first position always is
        block = tl.load(table + pos // PAGE, mask=held, other=0).to(tl.int64)  # (BLOCK,) each position's block
        offset = pos % PAGE
        k_at = k_base + block * k_sblock + offset * k_ss
        k = tl.load(k_at[:, None] + d[None, :] * k_sd, mask=held[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (GROUP_BLOCK, BLOCK) float32
        scores = tl.where(held[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        rescale = tl.exp(top - new_top)
        p = tl.exp(scores - new_top[:, None])
        total = total * rescale + tl.sum(p, 1)
        v_at = v_base + block * v_sblock + offset * v_ss
        v = tl.load(v_at[:, None] + d[None, :] * v_sd, mask=held[:, None], other=0.0)
        p = p.to(v_ptr.dtype.element_ty)  # the probabilities in the values' dtype, as flash attention multiplies them
        if UPCAST:
            v, p = v.to(tl.float32), p.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision=PRECISION)
        top = new_top
    wrote = in_group & (start < length)
    out = acc / total[:, None]
    tl.store(partial_ptr + b * p_sb + heads[:, None] * p_sh + split * p_ss + d[None, :], out, mask=wrote[:, None])
    tl.store(lse_ptr + b * l_sb + heads * l_sh + split, top + tl.log(total), mask=wrote)


@triton.jit
def _combine(
    partial_ptr,
    lse_ptr,
    lengths_ptr,
    out_ptr,
    positions,
    p_sb,
    p_sh,
    p_ss,
    l_sb,
    l_sh,
    o_sb,
    o_sh,
    o_sd,
    HEAD_DIM: tl.constexpr,
    SPLIT_N: tl.constexpr,
):
    """One (row, q head): the splits that hold positions, combined in order by their log-sum-exp."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    length = tl.minimum(tl.load(lengths_ptr + b).to(tl.int32), positions)
    d = tl.arange(0, HEAD_DIM)
    partial_base = partial_ptr + b * p_sb + head * p_sh
    lse_base = lse_ptr + b * l_sb + head * l_sh
    top = float("-inf")
    total = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for split in range(0, tl.cdiv(length, SPLIT_N)):
        lse = tl.load(lse_base + split)
        new_top = tl.maximum(top, lse)
        rescale = tl.exp(top - new_top)
        weight = tl.exp(lse - new_top)
        acc = acc * rescale + weight * tl.load(partial_base + split * p_ss + d)
        total = total * rescale + weight
        top = new_top
    tl.store(out_ptr + b * o_sb + head * o_sh + d * o_sd, (acc / total).to(out_ptr.dtype.element_ty))


def attend(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, reads: SplitKv) -> torch.Tensor:
    """``SplitKv.attend``: both stages launched on the current stream; (B, nh, hd) in q's dtype. ``cache_k`` and
    ``cache_v``: a layer's blocks (blocks, BLOCK_SIZE, nkv, hd)."""
    B, nh, hd = q.shape
    nkv, positions = cache_k.shape[2], reads.positions
    group = nh // nkv
    out = torch.empty((B, nh, hd), dtype=q.dtype, device=q.device)
    partial, lse = reads.partial, reads.lse
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"  # tf32 is unused for 16-bit inputs
    _partials[(B, nkv, partial.shape[2])](
        q,
        cache_k,
        cache_v,
        reads.lengths,
        reads.table,
        partial,
        lse,
        reads.scale,
        positions,
        *q.stride(),
        *cache_k.stride(),
        *cache_v.stride(),
        reads.table.stride(0),
        *partial.stride()[:3],
        *lse.stride()[:2],
        GROUP=group,
        GROUP_BLOCK=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=hd,
        SPLIT_N=SPLIT,
        BLOCK=BLOCK_N,
        PAGE=BLOCK_SIZE,
        PRECISION=precision,
        UPCAST=upcast,
        num_warps=STAGE1_WARPS,
        num_stages=STAGE1_STAGES,
    )
    _combine[(B, nh)](
        partial,
        lse,
        reads.lengths,
        out,
        positions,
        *partial.stride()[:3],
        *lse.stride()[:2],
        *out.stride(),
        HEAD_DIM=hd,
        SPLIT_N=SPLIT,
        num_warps=STAGE2_WARPS,
    )
    return out
