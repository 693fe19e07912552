"""The compatibility fingerprint: everything that decides what the processed tensors are.

An engine may map the daemon's arena only if both computed the same fingerprint. The environment
is part of it (device kind, compute capability, torch version) because different archs or torch
versions take different post-processing paths: weights would map cleanly and compute garbage.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from hotweights.cache.checkpoint import Checkpoint
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.pipeline import processed_config, processed_dtype
from hotweights.paths import INDEX_FILE

ARENA_FORMAT_VERSION = 1
REFERENCE_LAYOUT = "hotweights-reference"


@dataclass(frozen=True)
class Fingerprint:
    """Field names are shown to operators in refusals; keep them self-explanatory."""

    model_path: str
    config_hash: str
    weights_index_hash: str
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    quantization: str
    quantization_config_hash: str
    dtype: str
    device_kind: str
    compute_capability: str
    torch_version: str
    arena_format: int
    layout: str  # whose processed layout: REFERENCE_LAYOUT, or vLLM's (version and architecture)

    def digest(self) -> str:
        """A short stable id, used in socket names and health endpoints."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> Fingerprint:
        """Strict: every field present with the right type, nothing extra (raises ValueError)."""
        if not isinstance(data, dict):
            raise ValueError(f"fingerprint must be an object, found {type(data).__name__}")
        expected = {f.name: f.type for f in fields(cls)}
        missing, extra = expected.keys() - data.keys(), data.keys() - expected.keys()
        if missing or extra:
            raise ValueError(f"fingerprint fields missing {sorted(missing)}, unexpected {sorted(extra)}")
        for name, kind in expected.items():
            want = int if kind == "int" else str
            if type(data[name]) is not want:
                raise ValueError(f"fingerprint field {name!r} must be {want.__name__}, found {data[name]!r}")
        return cls(**data)

    def differences(self, other: Fingerprint) -> list[tuple[str, object, object]]:
        """(field, ours, theirs) for each field that differs."""
        return [
            (f.name, getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def describe_differences(differences: list[tuple[str, object, object]]) -> str:
    """The operator's sentence for ``daemon_fingerprint.differences(engine_fingerprint)``."""
    listed = "; ".join(f"{name}: daemon has {ours!r}, engine expects {theirs!r}" for name, ours, theirs in differences)
    return f"fingerprint differs in {len(differences)} field(s): {listed}"


def compute_fingerprint(checkpoint: Checkpoint, spec: LoadSpec) -> Fingerprint:
    """What an engine expects, and what the daemon serves, for this checkpoint and spec."""
    config = processed_config(checkpoint, spec)
    quant_config = checkpoint.config_json.get("quantization_config")
    if spec.quantize and checkpoint.config.quant is None:
        quant_config = {"quantized_at_load": spec.quantize}
    config_blob = (checkpoint.path / "config.json").read_bytes()
    device = torch.device(spec.device)
    return Fingerprint(
        model_path=str(checkpoint.path),
        config_hash=sha256_hex(config_blob),
        weights_index_hash=weights_index_hash(checkpoint.path, checkpoint.files),
        tp_size=spec.tp_size,
        tp_rank=spec.tp_rank,
        pp_size=1,
        pp_rank=0,
        dp_size=1,
        dp_rank=0,
        quantization=config.quant or "none",
        quantization_config_hash=sha256_hex(json.dumps(quant_config, sort_keys=True).encode()),
        dtype=str(processed_dtype(checkpoint, spec)).removeprefix("torch."),
        device_kind=device_kind(device),
        compute_capability=compute_capability(device),
        torch_version=torch.__version__,
        arena_format=ARENA_FORMAT_VERSION,
        layout=REFERENCE_LAYOUT,
    )


def weights_index_hash(model_dir: Path, files: Iterable[Path]) -> str:
    """The index plus each shard's name, size and mtime: a rewritten checkpoint never matches."""
    h = hashlib.sha256()
    index = model_dir / INDEX_FILE
    if index.exists():
        h.update(index.read_bytes())
    for file in files:
        stat = Path(file).stat()
        h.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def compute_capability(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{major}.{minor}"
    return "none"


def sha256_hex(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()[:32]


def engine_layout_fingerprint(
    model_dir: Path, model_config: Any, layout: str, tp_size: int, tp_rank: int, device: torch.device
) -> Fingerprint:
    """The fingerprint of an engine's own processed weights (``--format vllm`` or ``sglang``): the checkpoint in
    ``model_dir``, the quantization and dtype of the engine's ``model_config`` (its ``quantization``, ``dtype``
    and ``hf_config``), the device, and ``layout``, whose processed weights they are (engine, release and
    architecture)."""
    model_dir = model_dir.resolve()
    hf_quant = getattr(model_config.hf_config, "quantization_config", None)
    return Fingerprint(
        model_path=str(model_dir),
        config_hash=sha256_hex((model_dir / "config.json").read_bytes()),
        weights_index_hash=weights_index_hash(model_dir, sorted(model_dir.glob("*.safetensors"))),
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=1,
        pp_rank=0,
        dp_size=1,
        dp_rank=0,
        quantization=str(model_config.quantization or "none"),
        quantization_config_hash=sha256_hex(json.dumps(hf_quant, sort_keys=True, default=str).encode()),
        dtype=str(model_config.dtype).removeprefix("torch."),
        device_kind=device_kind(device),
        compute_capability=compute_capability(device),
        torch_version=torch.__version__,
        arena_format=ARENA_FORMAT_VERSION,
        layout=layout,
    )
