"""The model's shape and its processed tensor layout, tensor-parallel split rules included.

What the load pipeline emits, the arena holds and the engine binds is decided here, once:
``processed_tensors`` lists every processed tensor (name, shape, dtype) for a config, dtype and
tensor-parallel size, so the cache daemon learns its tensor list without building an engine's model.
The table in ``docs/architecture.md`` ("Processed tensor names") documents the same rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hotweights import quant

if TYPE_CHECKING:
    import torch

TP_SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
"""Config fields every tensor-parallel size must divide."""

ROLE_LINES_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
"""A chat as one ``role: content`` line per message, then ``assistant:``: the generated checkpoints' chat
template (after their BOS token) and the one an engine uses for a checkpoint that has none."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a checkpoint, read from its Hugging Face ``config.json``."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    quant: str | None = None  # None (unquantized) or a method of hotweights.quant.QUANT_METHODS


@dataclass(frozen=True)
class TensorSpec:
    """One Hugging Face weight of a checkpoint: its name, shape and kind."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "embed", "linear" or "norm"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def quantizable(self) -> bool:
        """Block FP8 covers the seven projections; embeddings, norms and lm_head keep the model dtype."""
        return self.name.startswith("model.layers.") and self.kind == "linear"


def checkpoint_tensors(config: ModelConfig) -> list[TensorSpec]:
    """Every weight of a Llama checkpoint on disk (Hugging Face names), in the order Hugging Face writes
    them; block-FP8 checkpoints add a ``weight_scale_inv`` beside each quantizable weight."""
    h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * hd, config.num_key_value_heads * hd
    specs = [TensorSpec("model.embed_tokens.weight", (config.vocab_size, h), "embed")]
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        specs += [
            TensorSpec(p + "self_attn.q_proj.weight", (q_rows, h), "linear"),
            TensorSpec(p + "self_attn.k_proj.weight", (kv_rows, h), "linear"),
            TensorSpec(p + "self_attn.v_proj.weight", (kv_rows, h), "linear"),
            TensorSpec(p + "self_attn.o_proj.weight", (h, q_rows), "linear"),
            TensorSpec(p + "mlp.gate_proj.weight", (i, h), "linear"),
            TensorSpec(p + "mlp.up_proj.weight", (i, h), "linear"),
            TensorSpec(p + "mlp.down_proj.weight", (h, i), "linear"),
            TensorSpec(p + "input_layernorm.weight", (h,), "norm"),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
    specs.append(TensorSpec("model.norm.weight", (h,), "norm"))
    if not config.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (config.vocab_size, h), "linear"))
    return specs


def check_tensor_parallel(config: ModelConfig, size: int, rank: int) -> None:
    """Raise ValueError unless every split dimension divides evenly across ``size`` ranks."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is not in [0, {size})")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )
    for field in TP_SPLIT_FIELDS:
        value = getattr(config, field)
        if value % size:
            raise ValueError(f"{field}={value} is not divisible by tensor-parallel size {size}")
    quant.check_method(config.quant, "model config")


def projection_shapes(config: ModelConfig, tp_size: int) -> dict[str, tuple[int, int]]:
    """Processed projection name (within a layer) -> (out, in) features of one rank's shard."""
    h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size // tp_size
    nh, nkv = config.num_attention_heads // tp_size, config.num_key_value_heads // tp_size
    return {
        "self_attn.qkv_proj": ((nh + 2 * nkv) * hd, h),
        "self_attn.o_proj": (h, nh * hd),
        "mlp.gate_up_proj": (2 * inter, h),
        "mlp.down_proj": (h, inter),
    }


def processed_tensors(
    config: ModelConfig, dtype: torch.dtype, tp_size: int = 1
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every processed tensor one tensor-parallel rank holds (imports torch)."""
    import torch

    check_tensor_parallel(config, tp_size, 0)
    h, vocab = config.hidden_size, config.vocab_size // tp_size
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"embed_tokens.weight": ((vocab, h), dtype)}
    for layer in range(config.num_hidden_layers):
        prefix = f"layers.{layer}"
        out[f"{prefix}.input_layernorm.weight"] = ((h,), dtype)
        for name, shape in projection_shapes(config, tp_size).items():
            if config.quant == quant.FP8_BLOCK:
                out[f"{prefix}.{name}.weight"] = (shape, quant.FP8_DTYPE)
                out[f"{prefix}.{name}.weight{quant.SCALE_SUFFIX}"] = (quant.scale_shape(*shape), torch.float32)
            else:
                out[f"{prefix}.{name}.weight"] = (shape, dtype)
        out[f"{prefix}.post_attention_layernorm.weight"] = ((h,), dtype)
    out["norm.weight"] = ((h,), dtype)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = ((vocab, h), dtype)
    return out
