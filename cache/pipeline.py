"""The load pipeline: safetensors on disk -> tensor-parallel shard -> fused -> (block FP8) -> device.

Its output is deterministic for a given checkpoint and ``LoadSpec``, which is what lets the cache
daemon run it once and every engine map the result. The engine's ``off`` mode runs it in process.
Tensors are produced one at a time so that the daemon can copy each into its arena and memory
stays bounded by the largest fused tensor.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch

from hotweights import quant
from hotweights.cache.checkpoint import Checkpoint, read_checkpoint
from hotweights.cache.loader import Loader, progress_bar
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.makemodel import ensure_default_model
from hotweights.dtypes import MODEL_DTYPE_NAMES
from hotweights.errors import ConfigError
from hotweights.layout import ModelConfig, processed_tensors
from hotweights.quant import FP8_BLOCK, QUANT_METHODS


def processed_config(checkpoint: Checkpoint, spec: LoadSpec) -> ModelConfig:
    """The config of the model that binds the pipeline's output (quantized at load or not)."""
    if spec.quantize and checkpoint.config.quant is None:
        return replace(checkpoint.config, quant=spec.quantize)
    return checkpoint.config


def processed_dtype(checkpoint: Checkpoint, spec: LoadSpec) -> torch.dtype:
    return spec.torch_dtype or checkpoint.dtype


def check_spec(checkpoint: Checkpoint, spec: LoadSpec) -> None:
    """Refuse a request the pipeline cannot serve (bad quantize, a TP split that does not divide)."""
    if spec.quantize is not None and spec.quantize not in QUANT_METHODS:
        raise ConfigError(f"--quantize must be one of {list(QUANT_METHODS)}, found {spec.quantize!r}")
    config, tp = checkpoint.config, spec.tp_size
    if tp < 1:
        raise ConfigError(f"--tp-size must be >= 1, found {tp}")
    if not 0 <= spec.tp_rank < tp:
        raise ConfigError(f"--tp-rank must be in [0, {tp}) for --tp-size {tp}, found {spec.tp_rank}")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, field)
        if value % tp:
            raise ConfigError(f"config.json {field}={value} is not divisible by --tp-size {tp}")
    if config.quant == FP8_BLOCK:
        # Slicing and fusing pre-quantized weights must cut on 128-row/column block edges.
        hd = config.head_dim
        parts = {
            "q rows per rank (num_attention_heads*head_dim/tp)": config.num_attention_heads * hd // tp,
            "k rows per rank (num_key_value_heads*head_dim/tp)": config.num_key_value_heads * hd // tp,
            "gate rows per rank (intermediate_size/tp)": config.intermediate_size // tp,
        }
        for what, rows in parts.items():
            if rows % quant.BLOCK:
                raise ConfigError(
                    f"block-FP8 checkpoint cannot be split/fused with --tp-size {tp}: {what} = {rows} "
                    f"is not a multiple of {quant.BLOCK}"
                )


def iter_processed(
    model_dir: str | Path | Checkpoint, spec: LoadSpec, *, progress: bool = True, direct_io: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (processed name, tensor on spec.device) in a fixed order. ``direct_io``: read the shards with
    O_DIRECT (``loader.Loader``); it changes how bytes are read, never what is produced. ``progress``: a bar
    in bytes produced, on a terminal only (``loader.progress_bar``)."""
    checkpoint = model_dir if isinstance(model_dir, Checkpoint) else read_checkpoint(model_dir)
    config = checkpoint.config
    check_spec(checkpoint, spec)
    fp8_on_disk = config.quant == FP8_BLOCK
    dtype = processed_dtype(checkpoint, spec)
    produced = processed_tensors(processed_config(checkpoint, spec), dtype, spec.tp_size)
    total = sum(math.prod(shape) * kind.itemsize for shape, kind in produced.values())
    with (
        Loader(spec.device, direct=direct_io, register=True) as loader,
        progress_bar(total, "loading", enabled=progress) as bar,
    ):
        reader = _ShardReader(checkpoint, loader, dtype)
        for name, tensor in _processed_tensors(reader, config, spec, fp8_on_disk):
            yield name, tensor
            bar.update(tensor.nbytes)


def load_processed(
    model_dir: str | Path | Checkpoint, spec: LoadSpec, *, progress: bool = True, direct_io: bool = False
) -> dict[str, torch.Tensor]:
    """The whole processed state dict; what the engine's ``off`` mode binds."""
    return dict(iter_processed(model_dir, spec, progress=progress, direct_io=direct_io))


def _processed_tensors(
    reader: _ShardReader, config: ModelConfig, spec: LoadSpec, fp8_on_disk: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    tp, rank = spec.tp_size, spec.tp_rank
    hd = config.head_dim
    q, kv = config.num_attention_heads * hd // tp, config.num_key_value_heads * hd // tp
    inter = config.intermediate_size // tp
    vocab = config.vocab_size // tp

    yield "embed_tokens.weight", reader.rows("model.embed_tokens.weight", rank * vocab, vocab)
    for layer in range(config.num_hidden_layers):
        hf, out = f"model.layers.{layer}", f"layers.{layer}"
        yield f"{out}.input_layernorm.weight", reader.whole(f"{hf}.input_layernorm.weight")
        attn = [
            (f"{hf}.self_attn.q_proj", rank * q, q),
            (f"{hf}.self_attn.k_proj", rank * kv, kv),
            (f"{hf}.self_attn.v_proj", rank * kv, kv),
        ]
        yield from _linear(reader, f"{out}.self_attn.qkv_proj", attn, spec, fp8_on_disk)
        yield from _linear(
            reader,
            f"{out}.self_attn.o_proj",
            [(f"{hf}.self_attn.o_proj", rank * q, q)],
            spec,
            fp8_on_disk,
            row_parallel=True,
        )
        yield f"{out}.post_attention_layernorm.weight", reader.whole(f"{hf}.post_attention_layernorm.weight")
        mlp = [(f"{hf}.mlp.gate_proj", rank * inter, inter), (f"{hf}.mlp.up_proj", rank * inter, inter)]
        yield from _linear(reader, f"{out}.mlp.gate_up_proj", mlp, spec, fp8_on_disk)
        yield from _linear(
            reader,
            f"{out}.mlp.down_proj",
            [(f"{hf}.mlp.down_proj", rank * inter, inter)],
            spec,
            fp8_on_disk,
            row_parallel=True,
        )
    yield "norm.weight", reader.whole("model.norm.weight")
    if not config.tie_word_embeddings:
        yield "lm_head.weight", reader.rows("lm_head.weight", rank * vocab, vocab)


def _linear(
    reader: _ShardReader,
    out: str,
    parts: list[tuple[str, int, int]],
    spec: LoadSpec,
    fp8_on_disk: bool,
    *,
    row_parallel: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """One processed linear layer: the parts (hf module, start, length) sliced, fused and quantized.

    Column-parallel parts are sliced along rows (output features) and fused by stacking rows;
    a row-parallel layer has one part, sliced along columns (input features).
    """
    take = reader.cols if row_parallel else reader.rows
    if fp8_on_disk:
        weight = torch.cat([take(f"{hf}.weight", start, n, keep_dtype=True) for hf, start, n in parts])
        scale = torch.cat(
            [
                take(f"{hf}.weight_scale_inv", start // quant.BLOCK, -(-n // quant.BLOCK), keep_dtype=True)
                for hf, start, n in parts
            ]
        )
    else:
        weight = torch.cat([take(f"{hf}.weight", start, n) for hf, start, n in parts])
        if spec.quantize != FP8_BLOCK:
            yield f"{out}.weight", weight
            return
        weight, scale = quant.quantize(weight)
    yield f"{out}.weight", weight
    yield f"{out}.weight_scale_inv", scale


class _ShardReader:
    """Reads rows of Hugging Face tensors from the checkpoint's shards onto the loader's device.

    A tensor's bytes are row-major at the offset its safetensors header gives, so a range of rows is one range
    of bytes: only those are read. A range of columns is cut from the whole rows once they are on the device.
    Results are contiguous, in the tensor's dtype on disk (``keep_dtype``) or the reader's.
    """

    def __init__(self, checkpoint: Checkpoint, loader: Loader, dtype: torch.dtype) -> None:
        self.checkpoint = checkpoint
        self.loader = loader
        self.dtype = dtype

    def _rows(self, name: str, start: int, n: int) -> torch.Tensor:
        """Rows ``start:start + n`` (clipped to the tensor, as a slice is), in the dtype on disk."""
        info = self.checkpoint.tensors[name]
        first, last = min(start, info.shape[0]), min(start + n, info.shape[0])
        raw = self.loader.read(info.file, info.offset + first * info.row_bytes, (last - first) * info.row_bytes)
        return raw.view(info.dtype).view(last - first, *info.shape[1:])

    def _finish(self, tensor: torch.Tensor, keep_dtype: bool) -> torch.Tensor:
        return tensor.to(dtype=tensor.dtype if keep_dtype else self.dtype).contiguous()

    def whole(self, name: str) -> torch.Tensor:
        return self._finish(self._rows(name, 0, self.checkpoint.tensors[name].shape[0]), keep_dtype=False)

    def rows(self, name: str, start: int, n: int, *, keep_dtype: bool = False) -> torch.Tensor:
        return self._finish(self._rows(name, start, n), keep_dtype)

    def cols(self, name: str, start: int, n: int, *, keep_dtype: bool = False) -> torch.Tensor:
        whole = self._rows(name, 0, self.checkpoint.tensors[name].shape[0])
        return self._finish(whole[:, start : start + n], keep_dtype)


def add_load_spec_arguments(parser: argparse.ArgumentParser, *, with_rank: bool = True) -> None:
    """The flags that decide what the pipeline produces, shared by daemon, engine and generate."""
    parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny model, made on first use)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    parser.add_argument("--dtype", choices=sorted(MODEL_DTYPE_NAMES), help="weights dtype (default: the checkpoint's)")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (default 1)")
    if with_rank:
        parser.add_argument("--tp-rank", type=int, default=0, help="tensor-parallel rank of this process (default 0)")
    parser.add_argument("--quantize", choices=QUANT_METHODS, help="quantize an unquantized checkpoint at load")


def add_read_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that decide how the checkpoint's (or a snapshot's) bytes are read, never what is produced:
    they stay out of the fingerprint."""
    parser.add_argument(
        "--direct-io",
        action="store_true",
        help="read with O_DIRECT, past the page cache: for cold files (default: buffered reads, which a warm page "
        "cache serves at memory speed; a file system that refuses O_DIRECT is read buffered, with one log line)",
    )


class LoadFlags(Protocol):
    """What ``add_load_spec_arguments``'s flags give a command: its ``argparse.Namespace``, or the engine's typed
    ``standby.engineoptions.EngineOptions`` (a layer above, so named here by what it holds). ``tp_rank`` too where
    the command has that flag."""

    @property
    def model(self) -> str | None: ...
    @property
    def device(self) -> str: ...
    @property
    def dtype(self) -> str | None: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def quantize(self) -> str | None: ...


def load_spec_from_args(args: LoadFlags, *, tp_rank: int | None = None) -> LoadSpec:
    """The ``LoadSpec`` the flags name; ``tp_rank`` overrides the flags' own (0 without that flag)."""
    return LoadSpec(
        device=args.device,
        dtype=args.dtype,
        tp_size=args.tp_size,
        tp_rank=getattr(args, "tp_rank", 0) if tp_rank is None else tp_rank,
        quantize=args.quantize,
    )


def model_dir_from_args(args: LoadFlags) -> Path:
    """--model, or the embedded tiny default (generated on first use)."""
    if args.model:
        return Path(args.model)

    return ensure_default_model()
