"""The elementwise steps of a decoder layer, each one Triton kernel inside captured CUDA graphs.

A decode step at batch 1 reads every weight once, so its matrix products run near the memory bound;
measured on an H200 ("Measured facts" in ``docs/architecture.md``), what kept the ``xl`` step at 11.7 ms
of GPU time rather than 8 was some 40 small kernels per layer (RMSNorm's casts and reduction, RoPE's halves, SwiGLU,
the residual adds), each a few microseconds even inside a CUDA graph. The functions here are those steps in plain
torch; on a CUDA tensor within ``fusing()`` each runs as one hand-written Triton kernel instead
(``standby.fusedkernels``): residual add and RMSNorm (one program per row), RMSNorm alone (the same kernel), RoPE
on the q and k heads (one program per head of a token, the heads read through the fused projection's strides), in
a decode step RoPE with the write of k and v into each row's block at its position (``rope_store``: a program per
head of a row) and SwiGLU (a program per row and block of columns), every one in float32 and rounded once to the
output's dtype. The results are the plain ones up to float rounding.

Deterministic by construction: RMSNorm's sum over a row runs in an order fixed by the kernel and the hidden size
(no kernel is chosen by timing it), and one program computes one row, so two engines, and one row in any batch,
compute the same bits; a continuation decoding on another engine's keys and values (``standby.kvshare``) computes
the uncut text ("Migration" in ``docs/benchmarks.md``).

Cheap after the first engine of a host: the kernels are launched directly (no ``torch.compile``, no Dynamo
tracing, no guards), and Triton compiles a kernel once per (source, Triton version, GPU architecture, dtypes,
constexprs), caching the binary on disk (``TRITON_CACHE_DIR``, default ``~/.triton/cache``). The constexprs are
what a model fixes (hidden size, head dim, blocks); the rows, the batch and the prefill's length are the grid or
strides not specialized on, so a model meets one binary per kernel and dtype at every batch size. The first
engine of a host compiles each in its warm-up (the first decode graph's first run); every later engine, and every
later batch size, loads it from the cache. Engines compiling at once on a cold cache compile the same binary. Once
per process, before its first kernel, Triton's import and its key of itself (a hash of its compiler and its
~500 MB library) are paid where ``standby.fusedkernels`` is imported: once for all the engines a process forks,
where it imports the module before it forks.

Only where ``fusing()`` is in effect, though: a launch from Python costs some tens of microseconds of host time
(Triton's argument handling), which only a CUDA graph's replay does not pay. So ``standby.decoder`` fuses what it
captures, and everything run eagerly (prefill, steps without graphs, CPU, no Triton) stays plain torch, as do
shapes the kernels do not take (an odd last dim; rope's operands of more than ROPE_DIMS dims).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from types import ModuleType
from typing import TypeVar

import torch
import torch.nn.functional as F

TRITON = importlib.util.find_spec("triton") is not None
ROPE_DIMS = 4  # rope's kernel takes operands of up to (B, T, heads, hd)
T = TypeVar("T")
_FUSING: ContextVar[bool] = ContextVar("fusing", default=False)
_CHECKING: ContextVar[dict[str, float] | None] = ContextVar("checking", default=None)


@contextlib.contextmanager
def fusing() -> Iterator[None]:
    """Within it (this thread or task), the functions below run their Triton kernels on CUDA tensors."""
    token = _FUSING.set(True)
    try:
        yield
    finally:
        _FUSING.reset(token)


@contextlib.contextmanager
def checking() -> Iterator[dict[str, float]]:
    """Within it (and ``fusing()``), every kernel's call also runs plain torch on the same inputs, and the dict it
    yields takes each function's worst ``departure`` over its calls (``standby.kernelcheck``)."""
    worst: dict[str, float] = {}
    token = _CHECKING.set(worst)
    try:
        yield worst
    finally:
        _CHECKING.reset(token)


def departure(got: torch.Tensor, expected: torch.Tensor) -> float:
    """How far a kernel's result is from plain torch's: the largest difference over the largest plain value
    (rounding: a few units of the dtype's last place); inf where the result is not finite."""
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    worst = float((got.float() - expected.float()).abs().max()) if got.numel() else 0.0
    return worst / scale if scale else worst


def checked(name: str, got: T, plain: Callable[[], T]) -> T:
    """``got``, a kernel's result (a tensor or a tuple of them); within ``checking()`` ``plain`` (the same call in
    plain torch) runs too and ``name``'s worst departure is kept."""
    worst = _CHECKING.get()
    if worst is not None:
        token = _FUSING.set(False)
        try:
            expected = plain()
        finally:
            _FUSING.reset(token)
        pairs = zip(got, expected, strict=True) if isinstance(got, tuple) else [(got, expected)]
        worst[name] = max([worst.get(name, 0.0), *(departure(g, e) for g, e in pairs)])
    return got


def broadcast(*shapes: torch.Size) -> torch.Size:
    """``torch.broadcast_shapes``, without what its first call in a process costs: an import of ``torch._refs`` and
    sympy, ~2 s of a new engine's warm-up on an H100 host. ValueError where the shapes do not broadcast."""
    ndim = max(len(shape) for shape in shapes)
    result = []
    for sizes in zip(*((1,) * (ndim - len(shape)) + tuple(shape) for shape in shapes), strict=True):
        other = {size for size in sizes if size != 1}
        if len(other) > 1:
            raise ValueError(f"shapes {[tuple(shape) for shape in shapes]} do not broadcast")
        result.append(other.pop() if other else 1)
    return torch.Size(result)


def is_fused(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` runs its kernel: within ``fusing()``, on CUDA, with Triton."""
    return TRITON and x.is_cuda and _FUSING.get()


def _kernels() -> ModuleType:
    from hotweights.standby import fusedkernels  # Triton only where a kernel runs

    return fusedkernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim (weight (H,)), in float32 so low-precision inputs keep the small terms."""
    if is_fused(x):
        return checked("rms_norm", _kernels().rms_norm(x, weight, eps), lambda: rms_norm(x, weight, eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one pass: (x + delta, rms_norm(x + delta))."""
    if is_fused(x):
        fused = _kernels().add_rms_norm(x, delta, weight, eps)
        return checked("add_rms_norm", fused, lambda: add_rms_norm(x, delta, weight, eps))
    y = x + delta
    yf = y.float()
    yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + eps)
    return y, (yf * weight.float()).to(y.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (..., hd) by position, "rotate-half" convention: pairs are (i, i + hd/2); cos and sin
    broadcast against x."""
    if is_fused(x) and max(x.dim(), cos.dim(), sin.dim()) <= ROPE_DIMS and x.shape[-1] % 2 == 0:
        return checked("rope", _kernels().rope(x, cos, sin), lambda: rope(x, cos, sin))
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_store(
    qkv: torch.Tensor,
    q_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    at: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """A decode step's RoPE and KV write, one token per row: qkv (B, (q_heads + 2 kv heads) x hd) the fused
    projection's q, k and v heads, cos and sin (B, 1, hd); its q and k heads rotated (``rope``), k and v written into
    a layer's blocks cache_k and cache_v (blocks, BLOCK_SIZE, kv heads, hd) at each row's ``at`` ((block, offset),
    (B, 1) each: ``standby.model.slots``); returns q (B, q_heads, hd). Fused, one kernel instead of three (the two
    writes were 0.34 ms of an ``xl`` step's 11.9 on an H100)."""
    if is_fused(qkv) and _storable(qkv, cos, sin, cache_k, cache_v):
        q = _kernels().rope_store(qkv, q_heads, cos, sin, cache_k, cache_v, at=at)
        if _CHECKING.get() is not None:  # the written rows read back only to be checked
            written = (q, cache_k[at][:, 0], cache_v[at][:, 0])
            checked("rope_store", written, lambda: _rotated(qkv, q_heads, cos, sin, cache_k.shape[-2]))
        return q
    q, k, v = _rotated(qkv, q_heads, cos, sin, cache_k.shape[-2])
    cache_k.index_put_(at, k[:, None])
    cache_v.index_put_(at, v[:, None])
    return q


def _storable(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *caches: torch.Tensor) -> bool:
    """Whether ``rope_store``'s kernel takes these: one dtype, contiguous last dims, an even head dim."""
    tensors = (qkv, cos, sin, *caches)
    alike = len({t.dtype for t in tensors}) == 1 and all(t.stride(-1) == 1 for t in tensors)
    return alike and caches[0].shape[-1] % 2 == 0


def _rotated(
    qkv: torch.Tensor, q_heads: int, cos: torch.Tensor, sin: torch.Tensor, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rope_store``'s values, nothing written: q and k (B, heads, hd) rotated, v (B, kv_heads, hd)."""
    rows, hd = qkv.shape[0], qkv.shape[-1] // (q_heads + 2 * kv_heads)
    qk, v = qkv.split([(q_heads + kv_heads) * hd, kv_heads * hd], -1)
    qk = rope(qk.view(rows, q_heads + kv_heads, hd), cos, sin)
    return qk[:, :q_heads], qk[:, q_heads:], v.view(rows, kv_heads, hd)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up, the two halves of the last dim."""
    if is_fused(gate_up) and gate_up.shape[-1] % 2 == 0:
        return checked("silu_mul", _kernels().silu_mul(gate_up), lambda: silu_mul(gate_up))
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
