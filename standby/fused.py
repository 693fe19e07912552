"""The elementwise steps of a decoder layer, each one kernel on CUDA.

A decode step at batch 1 reads every weight once, so its matrix products run near the memory bound;
measured on an H200 ("Measured facts" in ``docs/architecture.md``), what kept the ``xl`` step at 11.7 ms
of GPU time rather than 8 was some 40 small kernels per layer (RMSNorm's casts and reduction, RoPE's halves, SwiGLU,
the residual adds), each a few microseconds even inside a CUDA graph. The functions here are those
steps written once in plain torch; on a CUDA tensor each runs as ``torch.compile`` (Inductor) fuses
it, one kernel per call, compiled on first use (so during an engine's warm-up) and cached on disk by
Inductor for later processes. Elsewhere, or where Triton is missing, or with ``TORCHDYNAMO_DISABLE=1``,
the same code runs eagerly. The results are the eager ones up to float rounding order.

Only where ``fusing()`` is in effect, though: a compiled function costs some 0.25 ms of host time per
call (Dynamo's guards, Inductor's launcher), 50 ms per ``xl`` step of 193 calls, which only a CUDA
graph's replay does not pay. So ``standby.decoder`` fuses what it captures, and everything run
eagerly (prefill, steps without graphs, CPU) stays plain torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TypeVar

import torch
import torch.nn.functional as F

Fn = TypeVar("Fn", bound=Callable[..., object])

TRITON = importlib.util.find_spec("triton") is not None
_FUSING: ContextVar[bool] = ContextVar("fusing", default=False)


@contextlib.contextmanager
def fusing() -> Iterator[None]:
    """Within it (this thread or task), the functions below run compiled on CUDA tensors."""
    token = _FUSING.set(True)
    try:
        yield
    finally:
        _FUSING.reset(token)


def fused_on_cuda(fn: Fn) -> Fn:
    """``fn`` itself, except that a call within ``fusing()`` whose first argument is a CUDA tensor runs
    it compiled."""

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args: object) -> object:
        if not (TRITON and x.is_cuda and _FUSING.get()):
            return fn(x, *args)
        return _compiled(fn)(x, *args)

    return run  # type: ignore[return-value]


@functools.cache
def _compiled(fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` compiled once, on its first fused call (so CPU engines never import Dynamo). Inductor compiles in this
    process (``compile_threads = 1``) rather than starting a pool of compile workers per engine: with its on-disk
    cache warm a compile is a cache read, and a pool's start would take CPU time from the engines serving beside a
    warming spare. And deterministically, where this torch's Inductor has that mode: by default it times a
    reduction's candidate kernels on first use and keeps the fastest, so two engines that compiled at once (a cold
    cache) can sum RMSNorm in different orders, and a continuation from another engine's keys and values
    (``standby.kvshare``) would no longer compute the uncut text ("Migration" in ``docs/benchmarks.md``)."""
    import torch._inductor.config as inductor  # Inductor only where fusing runs

    inductor.compile_threads = 1
    if hasattr(inductor, "deterministic"):
        inductor.deterministic = True  # kernels chosen by heuristics alone: the same in every engine
    return torch.compile(fn, fullgraph=True)


@fused_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, in float32 so low-precision inputs keep the small terms."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


@fused_on_cuda
def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one pass: (x + delta, rms_norm(x + delta))."""
    y = x + delta
    yf = y.float()
    yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + eps)
    return y, (yf * weight.float()).to(y.dtype)


@fused_on_cuda
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (..., hd) by position, "rotate-half" convention: pairs are (i, i + hd/2); cos and sin
    broadcast against x."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@fused_on_cuda
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up, the two halves of the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
