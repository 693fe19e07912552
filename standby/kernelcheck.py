"""The engine's Triton kernels checked against plain torch at warm-up, on the device that will run them.

Triton compiles each kernel for the GPU and the Triton release it meets; a kernel that fails to compile there, or
computes something else, would fail every graph capture or serve wrong tokens. So before a graphed decoder captures
its steps (``standby.decoder``), one decode step of every slot, at positions spread over the whole cache (so across
the split-KV kernels' splits), runs three ways: plain torch with masked SDPA (the reference), split-KV attention
(``standby.decodeattention``), and split-KV with the fused elementwise kernels (``standby.fused``). A way that
raises, gives a logit that is not finite, or departs from the reference by more than TOLERANCE of the reference's
largest logit is not used: the decoder captures a graph per KV length instead, or unfused steps, and says so in
one warning line. Rounding differs between the ways (sums in other orders), which the tolerance leaves room for;
a miscompiled kernel gives other numbers altogether.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

TOLERANCE = 0.05  # of the reference's largest logit: rounding passes, a wrong kernel does not

# One decode step of the probe: (KV length read by every row, None for each row's own; fused) -> (B, V) logits.
Step = Callable[[int | None, bool], torch.Tensor]


@dataclass(frozen=True)
class KernelVerdict:
    """Which of the kernels a decoder may use, and the warning line of each it may not."""

    split_kv: bool
    fused: bool
    warnings: tuple[str, ...] = ()


def probe_inputs(rows: int, positions: int, vocab: int, device: torch.device) -> torch.Tensor:
    """(2, rows) tokens and positions of the probe step: positions spread evenly over 0 .. positions - 1."""
    where = torch.linspace(0, positions - 1, rows).long() if rows > 1 else torch.tensor([positions - 1])
    tokens = (torch.arange(rows) * 7919 + 1) % vocab
    return torch.stack([tokens, where]).to(device)


def disagreement(candidate: torch.Tensor, reference: torch.Tensor) -> str | None:
    """Why ``candidate`` logits are not ``reference``'s up to rounding; None when they are."""
    if not bool(torch.isfinite(candidate).all()):
        return "a logit is not finite"
    scale = float(reference.abs().max())
    worst = float((candidate.float() - reference.float()).abs().max())
    if worst > TOLERANCE * scale:
        return f"a logit differs by {worst:.4g} where the largest is {scale:.4g}"
    return None


def verdict(step: Step, split_kv: bool, positions: int) -> KernelVerdict:
    """Try the kernels the decoder would use (split-KV attention where ``split_kv``, then the fused elementwise
    kernels on top of what passed) against the reference step over ``positions`` KV positions."""
    reference = step(positions, False)
    warnings: list[str] = []
    attention = split_kv and _passes("split-KV attention", lambda: step(None, False), reference, warnings)
    fused = _passes("the fused kernels", lambda: step(None if attention else positions, True), reference, warnings)
    return KernelVerdict(attention, fused, tuple(warnings))


def _passes(what: str, run: Callable[[], torch.Tensor], reference: torch.Tensor, warnings: list[str]) -> bool:
    try:
        reason = disagreement(run(), reference)
    except Exception as exc:  # a compile error of Triton's takes many types
        reason = f"it failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if reason is not None:
        warnings.append(f"{what} on this device do not compute what plain torch does ({reason}): not used")
        log.warning("%s", warnings[-1])
    return reason is None
