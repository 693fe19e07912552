"""The one dtype table: every name a dtype goes by in hotweights, its files and its wire format.

A new dtype is one row here. Columns: the torch dtype; the short name of ``--dtype`` and
``cluster.toml`` (None: not a model dtype); the name ``config.json`` gives it (``torch_dtype``); the
name in safetensors headers; the arena manifest uses ``str(dtype)`` without ``torch.``.
"""

from __future__ import annotations

import torch

_TABLE: tuple[tuple[torch.dtype, str | None, str | None, str | None], ...] = (
    (torch.bfloat16, "bf16", "bfloat16", "BF16"),
    (torch.float16, "fp16", "float16", "F16"),
    (torch.float32, "fp32", "float32", "F32"),
    (torch.float8_e4m3fn, None, None, "F8_E4M3"),
    (torch.uint8, None, None, None),
    (torch.int64, None, None, None),
)

MODEL_DTYPES: dict[str, torch.dtype] = {short: dtype for dtype, short, _, _ in _TABLE if short}
"""``--dtype`` / ``[model] dtype`` name -> dtype: the dtypes a model's weights may have."""

CONFIG_DTYPES: dict[str, torch.dtype] = {hf: dtype for dtype, _, hf, _ in _TABLE if hf}
"""``config.json`` ``torch_dtype`` -> dtype."""

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {st: dtype for dtype, _, _, st in _TABLE if st}
"""safetensors header dtype -> dtype (the ones a checkpoint may hold)."""

ARENA_DTYPES: dict[str, torch.dtype] = {str(dtype).removeprefix("torch."): dtype for dtype, *_ in _TABLE}
"""Arena manifest dtype name -> dtype."""

FLOAT_DTYPES: tuple[torch.dtype, ...] = tuple(MODEL_DTYPES.values())


def short_name(dtype: torch.dtype) -> str:
    """The ``--dtype`` name of a model dtype (``bf16``); KeyError for others."""
    return next(short for candidate, short, _, _ in _TABLE if candidate == dtype and short)


def config_name(dtype: torch.dtype) -> str:
    """The ``config.json`` name of a model dtype (``bfloat16``)."""
    return next(hf for candidate, _, hf, _ in _TABLE if candidate == dtype and hf)


def arena_name(dtype: torch.dtype) -> str:
    """The arena manifest's name of a dtype (``float8_e4m3fn``)."""
    return str(dtype).removeprefix("torch.")
