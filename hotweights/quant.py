"""The one quantization vocabulary: method names, the allowlist, why the rest is refused, and the
block-FP8 storage format (DeepSeek-V3 form).

Block FP8: float8_e4m3fn weights with one float32 scale per 128x128 block,
W = float(Wq) * S[i // 128, j // 128]; the scale is stored as ``weight_scale_inv`` (the name is
historical: it holds s, the multiplier, not 1/s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP8_BLOCK = "fp8-block"
QUANT_METHODS: tuple[str, ...] = (FP8_BLOCK,)
"""Quantization methods hotweights maps (besides unquantized); ``--quantize`` / ``[model] quantize``."""

# Why each quantization method other than block FP8 is refused: a raw mapping of its tensors
# would compute wrong values, because part of its effect lives outside the weights.
REFUSED_QUANTIZATION = {
    "fp8-per-tensor": "per-tensor FP8 keeps its activation and weight scales in Python-side module state",
    "awq": "AWQ packs int4 weights and re-lays them out at load time",
    "gptq": "GPTQ packs int4 weights with act-order permutations applied at load time",
    "marlin": "Marlin re-lays weights into a kernel-specific tile order at load time",
}

BLOCK = 128
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv
QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
"""The ``quantization_config`` of a block-FP8 ``config.json``."""


def __getattr__(name: str) -> torch.dtype:
    """``FP8_DTYPE``: torch's ``float8_e4m3fn``, imported on first use (the vocabulary above needs no torch: the
    controller's config and the gateway read it)."""
    if name != "FP8_DTYPE":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    return torch.float8_e4m3fn


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the scale grid for a [rows, cols] weight."""
    return (-(-rows // BLOCK), -(-cols // BLOCK))


def check_method(quant: str | None, where: str) -> None:
    """Raise ValueError naming ``where`` unless ``quant`` is None or an allowed method."""
    if quant is not None and quant not in QUANT_METHODS:
        raise ValueError(f"{where}: quantization {quant!r} is not supported; use none or one of {list(QUANT_METHODS)}")


def _blocked(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Pad [N, K] up to whole blocks and view it as [nb, BLOCK, kb, BLOCK]."""
    import torch

    rows, cols = x.shape
    nb, kb = scale_shape(rows, cols)
    padded = torch.nn.functional.pad(x, (0, kb * BLOCK - cols, 0, nb * BLOCK - rows))
    return padded.view(nb, BLOCK, kb, BLOCK), nb, kb


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight: s = amax(block) / 448, q = e4m3(x / s). Returns (q, s)."""
    import torch

    if weight.dim() != 2:
        raise ValueError(f"block FP8 needs a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    blocks, _, _ = _blocked(weight.float())
    amax = blocks.abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(blocks.shape[0] * BLOCK, blocks.shape[2] * BLOCK)[:rows, :cols].contiguous()
    return q, scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """W = float(q) * S[i // 128, j // 128] in ``dtype`` (float32 by default), computed without materialising the
    expanded scale twice."""
    rows, cols = q.shape
    expanded = scale.repeat_interleave(BLOCK, dim=0)[:rows].repeat_interleave(BLOCK, dim=1)[:, :cols]
    product = q.float() * expanded
    return product if dtype is None else product.to(dtype)
