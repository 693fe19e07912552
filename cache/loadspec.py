"""``LoadSpec``: everything besides the checkpoint that decides what the load pipeline produces, without torch.

The controller builds one per daemon it starts (``controller.stack``) and never imports torch; the pipeline turns
its dtype name into torch's (``torch_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hotweights import dtypes

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LoadSpec:
    """Everything besides the checkpoint that decides what the pipeline produces."""

    device: str = "cpu"
    dtype: str | None = None  # a --dtype name of MODEL_DTYPE_NAMES (bf16); None: the checkpoint's torch_dtype
    tp_size: int = 1
    tp_rank: int = 0
    quantize: str | None = None  # a method of QUANT_METHODS: quantize an unquantized checkpoint at load

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as torch's (importing torch); None for the checkpoint's."""
        return dtypes.MODEL_DTYPES[self.dtype] if self.dtype else None
