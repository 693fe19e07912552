"""The one dtype table: every name a dtype goes by in hotweights, its files and its wire format.

A new dtype is one row here. Columns: the torch dtype; the short name of ``--dtype`` and
``cluster.toml`` (None: not a model dtype); the name ``config.json`` gives it (``torch_dtype``); the
name in safetensors headers; the arena manifest uses ``str(dtype)`` without ``torch.``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# (the dtype's name in torch and in the arena manifest, --dtype name, config.json name, safetensors name)
_TABLE: tuple[tuple[str, str | None, str | None, str | None], ...] = (
    ("bfloat16", "bf16", "bfloat16", "BF16"),
    ("float16", "fp16", "float16", "F16"),
    ("float32", "fp32", "float32", "F32"),
    ("float8_e4m3fn", None, None, "F8_E4M3"),
    ("uint8", None, None, None),
    ("int64", None, None, None),
)

MODEL_DTYPE_NAMES: tuple[str, ...] = tuple(short for _, short, _, _ in _TABLE if short)
"""The ``--dtype`` / ``[model] dtype`` names, without importing torch (the controller's config and the gateway)."""


TORCH_TABLES = ("MODEL_DTYPES", "CONFIG_DTYPES", "SAFETENSORS_DTYPES", "ARENA_DTYPES", "FLOAT_DTYPES")


def _torch_tables() -> dict[str, Any]:
    """The tables of torch dtypes, built on first use (importing torch takes a second)."""
    import torch

    def by(column: int) -> dict[str, torch.dtype]:
        return {row[column]: getattr(torch, row[0]) for row in _TABLE if row[column]}

    model = by(1)
    return {
        "MODEL_DTYPES": model,  # --dtype / [model] dtype name -> dtype: the dtypes a model's weights may have
        "CONFIG_DTYPES": by(2),  # config.json torch_dtype -> dtype
        "SAFETENSORS_DTYPES": by(3),  # safetensors header dtype -> dtype (the ones a checkpoint may hold)
        "ARENA_DTYPES": by(0),  # arena manifest dtype name -> dtype
        "FLOAT_DTYPES": tuple(model.values()),
    }


def __getattr__(name: str) -> Any:
    """``MODEL_DTYPES``, ``CONFIG_DTYPES``, ``SAFETENSORS_DTYPES``, ``ARENA_DTYPES``, ``FLOAT_DTYPES``: torch's
    dtypes by each name, imported with torch on first use."""
    if name not in TORCH_TABLES:  # e.g. the import system's look for __path__: never worth importing torch
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    tables = _torch_tables()
    globals().update(tables)
    return tables[name]


def model_config_name(short: str) -> str:
    """The ``config.json`` name of a ``--dtype`` name (``bf16`` -> ``bfloat16``), without torch; StopIteration for
    others."""
    return next(hf for _, name, hf, _ in _TABLE if name == short and hf)


def config_name(dtype: torch.dtype) -> str:
    """The ``config.json`` name of a model dtype (``bfloat16``)."""
    return next(hf for name, _, hf, _ in _TABLE if name == arena_name(dtype) and hf)


def arena_name(dtype: torch.dtype) -> str:
    """The arena manifest's name of a dtype (``float8_e4m3fn``)."""
    return str(dtype).removeprefix("torch.")
