"""The Triton kernels of ``standby.fused`` (which says what they compute, when they run and how they are cached).

Imported only where they run (CUDA with Triton; Triton's interpreter in the tests). Each wrapper allocates its output
at the call's shape and launches one kernel on the current stream of the current CUDA device (which must hold the
tensors: an engine sets its device), with no host sync: capturable in a CUDA graph. What varies per call (rows, batch,
tokens) is only the grid, or a stride marked ``do_not_specialize``; the constexprs (hidden size, head dim, blocks)
are fixed per model, so a model's kernels are one compile each, cached on disk by Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hotweights.standby.fused import ROPE_DIMS, broadcast

try:
    from triton.runtime.cache import triton_key
except ImportError:  # a Triton that keeps it elsewhere: taken on the first kernel's load instead
    triton_key = None

MAX_NORM_BLOCK = 4096  # RMSNorm's tile: a wider row is read in tiles of this many (summed in a fixed order)
MAX_SILU_BLOCK = 1024  # SwiGLU's columns per program
ELEMENTS_PER_THREAD = 8  # 16 bytes of a 16-bit dtype: one vector load per thread per tile
MAX_WARPS = 16

if triton_key is not None:
    # Triton's key of itself, part of every kernel's cache key: a hash of its compiler and its ~500 MB library (some
    # 0.3 s, kept for the process), which a process's first kernel load would pay. Taken at import, so a process
    # that imports this module before it forks engines (``standby.launcher``) pays it once for them all.
    triton_key()


@triton.jit
def _rms_norm(
    x_ptr,
    delta_ptr,
    weight_ptr,
    y_ptr,
    out_ptr,
    eps,
    x_row,
    delta_row,
    y_row,
    out_row,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    """One row: y = x (+ delta, written to y_ptr, when ADD), then y / rms(y) * weight in float32. The sum of squares
    runs over BLOCK lanes, tile after tile, then one tree over the lanes: an order fixed by HIDDEN and BLOCK alone."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    squares = tl.zeros([BLOCK], tl.float32)
    for start in range(0, HIDDEN, BLOCK):
        at = start + cols
        inside = at < HIDDEN
        y = tl.load(x_ptr + row * x_row + at, mask=inside, other=0.0)
        if ADD:
            delta = tl.load(delta_ptr + row * delta_row + at, mask=inside, other=0.0)
            y = (y.to(tl.float32) + delta.to(tl.float32)).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + row * y_row + at, y, mask=inside)
        y = y.to(tl.float32)
        squares += y * y
    scale = tl.rsqrt(tl.sum(squares, 0) / HIDDEN + eps)
    for start in range(0, HIDDEN, BLOCK):  # y again (read, or added again with the same rounding), now normalized
        at = start + cols
        inside = at < HIDDEN
        y = tl.load(x_ptr + row * x_row + at, mask=inside, other=0.0)
        if ADD:
            delta = tl.load(delta_ptr + row * delta_row + at, mask=inside, other=0.0)
            y = (y.to(tl.float32) + delta.to(tl.float32)).to(y_ptr.dtype.element_ty)
        weight = tl.load(weight_ptr + at, mask=inside, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + row * out_row + at, (y.to(tl.float32) * scale * weight).to(out_ptr.dtype.element_ty), mask=inside
        )


@triton.jit
def _rotation(x, cos, sin, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """The halves (x1, x2) of the head at pointer ``x`` rotated by the angles at ``cos`` and ``sin``, in float32:
    (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2, x1, x2), the halves as loaded last."""
    d = tl.arange(0, BLOCK)
    inside = d < HALF
    x1 = tl.load(x + d, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF + d, mask=inside, other=0.0).to(tl.float32)
    cos1 = tl.load(cos + d, mask=inside, other=0.0).to(tl.float32)
    cos2 = tl.load(cos + HALF + d, mask=inside, other=0.0).to(tl.float32)
    sin1 = tl.load(sin + d, mask=inside, other=0.0).to(tl.float32)
    sin2 = tl.load(sin + HALF + d, mask=inside, other=0.0).to(tl.float32)
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2, x1, x2


@triton.jit(do_not_specialize=["x_s0", "cos_s0", "sin_s0", "out_s0"])
def _rope(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    x_s0,
    x_s1,
    x_s2,
    cos_s0,
    cos_s1,
    cos_s2,
    sin_s0,
    sin_s1,
    sin_s2,
    out_s0,
    out_s1,
    out_s2,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One head of one token, (i0, i1, i2) = program ids (1, 0, 2): its halves (x1, x2) become
    (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2) in float32. The outermost strides vary with a prefill's length."""
    i0 = tl.program_id(1).to(tl.int64)
    i1 = tl.program_id(0).to(tl.int64)
    i2 = tl.program_id(2).to(tl.int64)
    d = tl.arange(0, BLOCK)
    inside = d < HALF
    x = x_ptr + i0 * x_s0 + i1 * x_s1 + i2 * x_s2
    cos = cos_ptr + i0 * cos_s0 + i1 * cos_s1 + i2 * cos_s2
    sin = sin_ptr + i0 * sin_s0 + i1 * sin_s1 + i2 * sin_s2
    y1, y2, _, _ = _rotation(x, cos, sin, HALF, BLOCK)
    out = out_ptr + i0 * out_s0 + i1 * out_s1 + i2 * out_s2
    tl.store(out + d, y1.to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(out + HALF + d, y2.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["qkv_row", "cos_row", "sin_row"])
def _rope_store(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_ptr,
    offset_ptr,
    qkv_row,
    cos_row,
    sin_row,
    block_row,
    offset_row,
    k_s0,
    k_s1,
    k_s2,
    v_s0,
    v_s1,
    v_s2,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One head of one row's token, (head, row) = program ids (0, 1): a q or k head rotated as ``_rope`` does
    (``_rotation``), a q head stored into q, a k head into k's blocks at the row's (block, offset), a v head copied
    into v's."""
    head = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK)
    inside = d < HALF
    x = qkv_ptr + row * qkv_row + head * (2 * HALF)
    y1, y2, x1, x2 = _rotation(x, cos_ptr + row * cos_row, sin_ptr + row * sin_row, HALF, BLOCK)
    y1, y2 = y1.to(q_ptr.dtype.element_ty), y2.to(q_ptr.dtype.element_ty)
    block = tl.load(block_ptr + row * block_row).to(tl.int64)
    offset = tl.load(offset_ptr + row * offset_row).to(tl.int64)
    is_q, is_v = head < Q_HEADS, head >= Q_HEADS + KV_HEADS
    is_k = (head >= Q_HEADS) & (head < Q_HEADS + KV_HEADS)
    q = q_ptr + (row * Q_HEADS + head) * (2 * HALF)
    tl.store(q + d, y1, mask=inside & is_q)
    tl.store(q + HALF + d, y2, mask=inside & is_q)
    k = k_ptr + block * k_s0 + offset * k_s1 + (head - Q_HEADS) * k_s2
    tl.store(k + d, y1, mask=inside & is_k)
    tl.store(k + HALF + d, y2, mask=inside & is_k)
    v = v_ptr + block * v_s0 + offset * v_s1 + (head - Q_HEADS - KV_HEADS) * v_s2
    tl.store(v + d, x1.to(v_ptr.dtype.element_ty), mask=inside & is_v)
    tl.store(v + HALF + d, x2.to(v_ptr.dtype.element_ty), mask=inside & is_v)


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, in_row, out_row, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK columns of one row: silu(gate) * up in float32, gate and up the row's halves of WIDTH each."""
    row = tl.program_id(0).to(tl.int64)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = at < WIDTH
    gate = tl.load(gate_up_ptr + row * in_row + at, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * in_row + WIDTH + at, mask=inside, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * out_row + at, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=inside
    )


def _warps(block: int) -> int:
    """Warps for a tile of ``block`` elements: ELEMENTS_PER_THREAD each, within 1 .. MAX_WARPS."""
    return min(max(block // (32 * ELEMENTS_PER_THREAD), 1), MAX_WARPS)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (rows, its last dim), its last dim contiguous (a view where it can be)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor, dims: int) -> list[int]:
    """``t``'s strides as a tensor of ``dims`` dims: leading dims added, and every dim of size 1, of stride 0 (a size-1
    dim's stride is whatever its view made, which would otherwise select another specialization)."""
    strides = [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride(), strict=True)]
    return [0] * (dims - t.dim()) + strides


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """y = x (+ delta) and rms_norm(y): (y, out) with delta, (out,) without."""
    hidden = x.shape[-1]
    shape = x.shape if delta is None else broadcast(x.shape, delta.shape)
    dtype = x.dtype if delta is None else torch.promote_types(x.dtype, delta.dtype)
    out = torch.empty(shape, dtype=dtype, device=x.device)
    y = None if delta is None else torch.empty_like(out)
    xs = _rows(x.expand(shape))
    ds = xs if delta is None else _rows(delta.expand(shape))  # unread without delta, as is ys
    outs = out.view(-1, hidden)
    ys = outs if y is None else y.view(-1, hidden)
    if xs.shape[0]:
        block = min(triton.next_power_of_2(hidden), MAX_NORM_BLOCK)
        _rms_norm[(xs.shape[0],)](
            xs,
            ds,
            weight.reshape(hidden).contiguous(),
            ys,
            outs,
            eps,
            *(_strides(t, 2)[0] for t in (xs, ds, ys, outs)),
            HIDDEN=hidden,
            BLOCK=block,
            ADD=delta is not None,
            num_warps=_warps(block),
        )
    return (out,) if y is None else (y, out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``fused.rms_norm``: one program per row."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused.add_rms_norm``: one program per row."""
    y, out = _norm(x, delta, weight, eps)
    return y, out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``fused.rope`` for x of up to ROPE_DIMS dims, an even last dim: one program per head of a token."""
    shape = broadcast(x.shape, cos.shape, sin.shape)
    out = torch.empty(
        shape, dtype=torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype), device=x.device
    )
    parts = [t.expand(shape) for t in (x, cos, sin)]
    parts = [t if t.stride(-1) == 1 else t.contiguous() for t in parts]
    padded = [1] * (ROPE_DIMS - len(shape)) + list(shape)  # (d0, d1, d2, hd)
    if out.numel():
        half = shape[-1] // 2
        _rope[(padded[1], padded[0], padded[2])](
            *parts,
            out,
            *(s for t in (*parts, out) for s in _strides(t, ROPE_DIMS)[:3]),
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
            num_warps=1,
        )
    return out


def rope_store(
    qkv: torch.Tensor, q_heads: int, *tensors: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """``fused.rope_store``: one program per head of a row; ``tensors`` are cos, sin, cache_k and cache_v."""
    cos, sin, cache_k, cache_v = tensors
    rows, kv_heads, hd = qkv.shape[0], cache_k.shape[-2], cache_k.shape[-1]
    q = torch.empty((rows, q_heads, hd), dtype=qkv.dtype, device=qkv.device)
    block, offset = at
    if rows:
        _rope_store[(q_heads + 2 * kv_heads, rows)](
            qkv,
            cos,
            sin,
            q,
            cache_k,
            cache_v,
            block,
            offset,
            *(t.stride(0) for t in (qkv, cos, sin, block, offset)),
            *cache_k.stride()[:3],
            *cache_v.stride()[:3],
            Q_HEADS=q_heads,
            KV_HEADS=kv_heads,
            HALF=hd // 2,
            BLOCK=triton.next_power_of_2(hd // 2),
            num_warps=1,
        )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``fused.silu_mul`` for an even last dim: one program per row and MAX_SILU_BLOCK columns."""
    width = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        block = min(triton.next_power_of_2(width), MAX_SILU_BLOCK)
        _silu_mul[(rows.shape[0], triton.cdiv(width, block))](
            rows,
            out,
            _strides(rows, 2)[0],
            _strides(out.view(-1, width), 2)[0],
            WIDTH=width,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return out
