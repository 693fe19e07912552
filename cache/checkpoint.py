"""Reads and validates a Hugging Face checkpoint before anything slow happens.

Every problem a user can hit (missing or truncated files, a bad index, a tensor whose shape does
not match config.json, a refused quantization method) is found here, from the JSON files and the
safetensors headers alone, and reported as a ``CheckpointError`` that names the file and tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from hotweights import quant
from hotweights.dtypes import CONFIG_DTYPES, FLOAT_DTYPES, SAFETENSORS_DTYPES
from hotweights.errors import CheckpointError
from hotweights.layout import ModelConfig, checkpoint_tensors
from hotweights.paths import INDEX_FILE

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as its safetensors header describes it: its row-major bytes are ``nbytes`` at ``offset`` of ``file``."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file: past the 8-byte length and the header, plus data_offsets' start

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """The bytes of one row (one index of the first dimension)."""
        return math.prod(self.shape[1:]) * self.dtype.itemsize


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint: its config and where each Hugging Face tensor lives."""

    path: Path
    config: ModelConfig
    dtype: torch.dtype
    tensors: dict[str, TensorInfo]  # empty when read with ``headers=False``
    config_json: dict[str, Any]
    files: tuple[Path, ...]  # the shards, sorted

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())


def read_checkpoint(model_dir: str | Path, *, headers: bool = True) -> Checkpoint:
    """Validate ``model_dir`` from its JSON files and safetensors headers; raise CheckpointError. With
    ``headers=False`` no shard is opened (``tensors`` stays empty): the config, the index and the shards'
    existence are checked, which is all the fingerprint needs (a daemon that re-adopts reads no shard)."""
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist or is not a directory")
    path = path.resolve()
    config_json = _read_json(path / "config.json")
    config, dtype = parse_config(config_json, path / "config.json")
    shards = _weight_map(path)
    tensors = _read_headers(path, shards) if headers else {}
    if headers:
        _check_expected_tensors(config, tensors)
    files = tuple(sorted(path / name for name in shards.by_file))
    return Checkpoint(path=path, config=config, dtype=dtype, tensors=tensors, config_json=config_json, files=files)


def parse_config(raw: dict[str, Any], source: Path) -> tuple[ModelConfig, torch.dtype]:
    """Map config.json onto ModelConfig, naming the field and file of anything wrong."""
    architectures = raw.get("architectures") or []
    if not any(arch in SUPPORTED_ARCHITECTURES for arch in architectures):
        raise CheckpointError(
            f"{source}: unsupported architecture {architectures or '(none)'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def field(name: str, kind: type, default: Any = None) -> Any:
        value = raw.get(name, default)
        if value is None:
            raise CheckpointError(f"{source}: required field {name!r} is missing")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CheckpointError(
                f"{source}: field {name!r} must be {kind.__name__}, found {type(value).__name__} {value!r}"
            )
        if kind in (int, float) and value <= 0:
            raise CheckpointError(f"{source}: field {name!r} must be positive, found {value!r}")
        return value

    # Llama variants the reference model does not implement: mapping their weights would load
    # cleanly and compute wrong values (biases left out, another activation, scaled RoPE).
    unsupported = {
        "hidden_act": raw.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(raw.get("attention_bias", False)),
        "mlp_bias": bool(raw.get("mlp_bias", False)),
        "rope_scaling": raw.get("rope_scaling") not in (None, {"rope_type": "default"}, {"type": "default"}),
    }
    for name, bad in unsupported.items():
        if bad:
            raise CheckpointError(
                f"{source}: field {name!r}={raw[name]!r} is not supported (the model implements Llama with "
                "silu, no biases and plain RoPE), so its weights would compute wrong values"
            )
    heads = field("num_attention_heads", int)
    hidden = field("hidden_size", int)
    torch_dtype = raw.get("torch_dtype", "bfloat16")
    if torch_dtype not in CONFIG_DTYPES:
        raise CheckpointError(
            f"{source}: field 'torch_dtype' must be one of {sorted(CONFIG_DTYPES)}, found {torch_dtype!r}"
        )
    config = ModelConfig(
        vocab_size=field("vocab_size", int),
        hidden_size=hidden,
        intermediate_size=field("intermediate_size", int),
        num_hidden_layers=field("num_hidden_layers", int),
        num_attention_heads=heads,
        num_key_value_heads=field("num_key_value_heads", int, heads),
        head_dim=field("head_dim", int, hidden // heads),
        rms_norm_eps=field("rms_norm_eps", float, 1e-5),
        rope_theta=field("rope_theta", float, 10000.0),
        max_position_embeddings=field("max_position_embeddings", int, 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        quant=parse_quantization(raw.get("quantization_config"), source),
    )
    if heads % config.num_key_value_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )
    return config, CONFIG_DTYPES[torch_dtype]


def parse_quantization(qc: dict[str, Any] | None, source: Path) -> str | None:
    """Return None or ``quant.FP8_BLOCK``; refuse every other method with the reason."""
    if qc is None:
        return None
    method = str(qc.get("quant_method", "unknown")).lower()
    if method == "fp8":
        if qc.get("weight_block_size") is None:
            method = "fp8-per-tensor"
        elif list(qc["weight_block_size"]) != [quant.BLOCK, quant.BLOCK] or qc.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(
                f"{source}: quantization fp8 with weight_block_size={qc['weight_block_size']} "
                f"fmt={qc.get('fmt')!r} is refused: only 128x128 blocks of e4m3 are supported"
            )
        else:
            return quant.FP8_BLOCK
    reason = quant.REFUSED_QUANTIZATION.get(method, "it is not on the allowlist (unquantized, block-wise FP8)")
    raise CheckpointError(
        f"{source}: quantization method {method!r} is refused: {reason}, so mapping its raw tensors "
        "would compute wrong values. Supported: unquantized, and block-wise FP8 (128x128, e4m3)."
    )


def expected_hf_tensors(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Hugging Face name -> (shape, kind) where kind is "weight", "fp8" or "scale"."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for spec in checkpoint_tensors(config):
        if config.quant == quant.FP8_BLOCK and spec.quantizable:
            out[spec.name] = (spec.shape, "fp8")
            out[spec.name + quant.SCALE_SUFFIX] = (quant.scale_shape(*spec.shape), "scale")
        else:
            out[spec.name] = (spec.shape, "weight")
    return out


def _check_expected_tensors(config: ModelConfig, tensors: dict[str, TensorInfo]) -> None:
    for name, (shape, kind) in expected_hf_tensors(config).items():
        info = tensors.get(name)
        if info is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint (no shard holds it)")
        if info.shape != shape:
            raise CheckpointError(
                f"{info.file.name}: tensor {name!r} has shape {list(info.shape)} but config.json implies {list(shape)}"
            )
        allowed = {"fp8": (quant.FP8_DTYPE,), "scale": (torch.float32,), "weight": FLOAT_DTYPES}[kind]
        if info.dtype not in allowed:
            raise CheckpointError(
                f"{info.file.name}: tensor {name!r} has dtype {info.dtype}, expected one of {[str(d) for d in allowed]}"
            )


@dataclass(frozen=True)
class _Shards:
    """What the index says: the tensors each shard holds, and the shard each tensor is placed in."""

    index_path: Path
    by_file: dict[str, list[str]]
    placed: dict[str, str]


def _weight_map(path: Path) -> _Shards:
    """The index's weight map (or the single-file layout), every shard checked to exist; no shard opened."""
    index_path = path / INDEX_FILE
    if index_path.exists():
        index = _read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: 'weight_map' is missing or empty")
        by_file: dict[str, list[str]] = {}
        placed = {name: _shard_name(index_path, name, file) for name, file in weight_map.items()}
        for name, file in placed.items():
            by_file.setdefault(file, []).append(name)
    elif (path / SINGLE_FILE).exists():
        by_file, placed = {SINGLE_FILE: []}, {}
    else:
        raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
    for file_name in by_file:
        if not (path / file_name).is_file():
            raise CheckpointError(f"{index_path.name} names {file_name}, which does not exist in {path}")
        _check_inside(path, file_name)
    return _Shards(index_path, by_file, placed)


def _check_inside(path: Path, file_name: str) -> None:
    """CheckpointError unless shard ``file_name`` (symbolic links, its own or its directories', resolved)
    lies inside the checkpoint directory ``path``, or, for a Hugging Face cache snapshot
    (``<repo>/snapshots/<revision>``), inside that repository's ``blobs`` directory."""
    roots = [path]
    if path.parent.name == "snapshots":
        roots.append(path.parent.parent / "blobs")
    target = (path / file_name).resolve()
    if not any(target.is_relative_to(root) for root in roots):
        raise CheckpointError(
            f"{path / file_name}: a symbolic link to {target}, outside the checkpoint directory {path}; "
            "copy the shard into it or link only within it"
        )


def _read_headers(path: Path, shards: _Shards) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for file_name, indexed_names in shards.by_file.items():
        header = read_safetensors_header(path / file_name)
        for name in indexed_names:
            if name not in header:
                raise CheckpointError(f"{shards.index_path.name} places tensor {name!r} in {file_name}, which lacks it")
        # The index decides: a stale copy of a tensor in another shard must not win by file order.
        placed = shards.placed
        tensors.update({name: info for name, info in header.items() if placed.get(name, file_name) == file_name})
    return tensors


def _shard_name(index_path: Path, tensor: str, file: object) -> str:
    """A weight_map entry must name a file inside the checkpoint: a relative path without ``..``.
    (Where symbolic links may lead: ``_check_inside``.)"""
    if not isinstance(file, str) or not file:
        raise CheckpointError(f"{index_path}: weight_map entry {tensor!r} must be a file name, found {file!r}")
    parts = PurePosixPath(file).parts
    if PurePosixPath(file).is_absolute() or ".." in parts:
        raise CheckpointError(
            f"{index_path}: weight_map entry {tensor!r} -> {file!r} points outside the checkpoint directory; "
            "shards must be named relative to it, without '..'"
        )
    return file


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header ourselves, so truncation and corruption get a clear message."""
    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointError(
                f"{file}: corrupt or truncated safetensors header (claims {header_len} bytes, file has {size})"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{file}: corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header: not a JSON object")
    data_size = size - 8 - header_len
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if not all(type(v) is int and v >= 0 for v in (*shape, start, end)) or not isinstance(dtype_name, str):
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{file}: corrupt header entry for tensor {name!r}") from None
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {dtype_name}")
        if end - start != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{file}: tensor {name!r} byte range does not match its shape {list(shape)}")
        if end > data_size:
            raise CheckpointError(
                f"{file}: truncated: tensor {name!r} ends at byte {end} of the data section, "
                f"but the file holds only {data_size} data bytes"
            )
        out[name] = TensorInfo(file=file, dtype=dtype, shape=shape, offset=8 + header_len + start)
    return out


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    try:
        data = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return data
