"""``hotweights make-model``: seeded synthetic checkpoints in the Hugging Face Llama layout.

The project needs checkpoints of every size (a few MB for CI, tens of GB for load-time drills)
without downloading anything. Every tensor comes from its own generator seeded by (seed, name),
so values do not depend on shard size and any tensor can be regenerated alone; shards are
generated and written one at a time, so memory stays bounded by the shard size. The tokenizer is
a real byte-level BPE trained on ``cache/corpus.txt``, so prompts round-trip as text.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from hotweights.cache.maketokenizer import BOS_TOKEN, EOS_TOKEN, MAX_TOKENIZER_VOCAB, tokenizer_json
from hotweights.dtypes import MODEL_DTYPES, config_name
from hotweights.errors import CheckpointError, ConfigError
from hotweights.layout import ROLE_LINES_TEMPLATE, ModelConfig, TensorSpec, checkpoint_tensors
from hotweights.paths import INDEX_FILE, default_model_dir, made_default_model
from hotweights.quant import FP8_BLOCK, FP8_DTYPE, QUANT_CONFIG, QUANT_METHODS, SCALE_SUFFIX, quantize, scale_shape
from hotweights.stats import human_bytes

VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")  # one row per token id
MIN_VOCAB = 300  # 256 byte tokens + 2 specials + room for some merges
DEFAULT_SHARD_SIZE = 2 * 10**9

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),  # ~3.4 MB bf16; CI
    "small": ModelConfig(  # ~34 MB bf16
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
    "medium": ModelConfig(  # ~1.7 GB bf16
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
    ),
    "large": ModelConfig(  # Llama-3-8B shape, ~16 GB bf16
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "xl": ModelConfig(  # Qwen2.5-14B-like with a wider MLP, ~32 GB bf16
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
    ),
}

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def count_params(config: ModelConfig) -> int:
    """Parameters of the unquantized model (FP8 scales not counted)."""
    return sum(spec.numel for spec in checkpoint_tensors(config))


def is_quantized(spec: TensorSpec, quant: str | None) -> bool:
    return quant == FP8_BLOCK and spec.quantizable


def tensor_names(config: ModelConfig, quant: str | None) -> Iterator[str]:
    """Every tensor name a checkpoint of this shape holds, FP8 scales included."""
    for spec in checkpoint_tensors(config):
        yield spec.name
        if is_quantized(spec, quant):
            yield scale_name(spec.name)


def scale_name(weight_name: str) -> str:
    """``...q_proj.weight`` -> ``...q_proj.weight_scale_inv``, the name FP8 checkpoints use."""
    return weight_name + SCALE_SUFFIX


def tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed, so each tensor is independent of the others and of the shard layout.

    Hashed rather than packed: the CPU generator keeps only the low 32 bits of a seed.
    """
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little")


def init_tensor(spec: TensorSpec, *, seed: int, device: str = "cpu") -> torch.Tensor:
    """The float32 value of one weight (before casting or quantizing), on ``device``.

    Scales keep a random model lively: unit-variance embeddings, 1/sqrt(fan_in) linears (so
    attention scores and logits have unit spread and greedy decoding does not lock onto one
    token), and norm weights near 1. Rows of the embeddings and the output head past the
    tokenizer's MAX_TOKENIZER_VOCAB ids are zero: their logit is then 0, far below the best of
    thousands of unit-spread ones, so greedy decoding writes text at every token instead of ids
    that decode to nothing (as a real model never generates its padding ids).
    """
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, spec.name))
    x = torch.randn(spec.shape, generator=gen, device=device, dtype=torch.float32)
    if spec.name in VOCAB_ROWS:
        x[MAX_TOKENIZER_VOCAB:] = 0.0
    if spec.kind == "linear":
        return x.mul_(spec.shape[1] ** -0.5)
    if spec.kind == "norm":
        return x.mul_(0.1).add_(1.0)
    return x


def output_tensors(
    spec: TensorSpec, *, dtype: torch.dtype, quant: str | None, seed: int, device: str
) -> dict[str, torch.Tensor]:
    """The tensor(s) written for one spec, on the CPU: the weight, plus its scale when FP8."""
    x = init_tensor(spec, seed=seed, device=device)
    if is_quantized(spec, quant):
        q, s = quantize(x)
        return {spec.name: q.cpu(), scale_name(spec.name): s.cpu()}
    return {spec.name: x.to(dtype).cpu()}


def spec_nbytes(spec: TensorSpec, dtype: torch.dtype, quant: str | None) -> int:
    """Bytes the spec takes on disk, scale included."""
    if is_quantized(spec, quant):
        return spec.numel * FP8_DTYPE.itemsize + math.prod(scale_shape(*spec.shape)) * 4
    return spec.numel * dtype.itemsize


def plan_shards(
    specs: list[TensorSpec], dtype: torch.dtype, quant: str | None, shard_size: int
) -> list[list[TensorSpec]]:
    """Group specs into shards of at most ``shard_size`` bytes (a bigger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        size = spec_nbytes(spec, dtype, quant)
        if shards[-1] and used + size > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += size
    return shards


def shard_file(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_weights(
    out: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    quant: str | None,
    seed: int,
    shard_size: int,
    device: str,
    progress: bool,
) -> None:
    """Generate and save one shard at a time, then the index that maps every tensor to its file."""
    specs = checkpoint_tensors(config)
    shards = plan_shards(specs, dtype, quant, shard_size)
    total = sum(spec_nbytes(spec, dtype, quant) for spec in specs)
    weight_map: dict[str, str] = {}
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, file=sys.stderr) as bar:
        for n, shard in enumerate(shards):
            name = shard_file(n, len(shards))
            tensors: dict[str, torch.Tensor] = {}
            for spec in shard:
                tensors.update(output_tensors(spec, dtype=dtype, quant=quant, seed=seed, device=device))
                bar.update(spec_nbytes(spec, dtype, quant))
            try:
                save_file(tensors, out / name, metadata={"format": "pt"})
            except SafetensorError as exc:  # how the Rust writer reports ENOSPC, EFBIG, EIO
                raise OSError(f"{name}: {exc}") from None
            weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / INDEX_FILE, index)


def write_tokenizer(out: Path, config: ModelConfig) -> tuple[int, int]:
    """Write tokenizer.json and tokenizer_config.json; return (bos_id, eos_id)."""
    text = tokenizer_json(min(config.vocab_size, MAX_TOKENIZER_VOCAB))
    tokenizer = Tokenizer.from_str(text)
    write_text(out / "tokenizer.json", text)
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "model_max_length": config.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            "chat_template": "{{ bos_token }}" + ROLE_LINES_TEMPLATE,
        },
    )
    return tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)


def hf_config(config: ModelConfig, *, dtype: torch.dtype, quant: str | None, bos: int, eos: int) -> dict:
    """The ``config.json`` a Llama checkpoint carries."""
    data = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "vocab_size": config.vocab_size,
        "torch_dtype": config_name(dtype),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    if quant == FP8_BLOCK:
        data["quantization_config"] = dict(QUANT_CONFIG)
    return data


def write_json(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2) + "\n")


def write_text(path: Path, text: str) -> None:
    """``path.write_text`` whose OSError names the file (a failed write() alone carries no filename)."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def validate_config(config: ModelConfig, dtype: torch.dtype, quant: str | None) -> None:
    """Refuse shapes the model or the tokenizer cannot use, naming the CLI flag."""
    dims = {
        "--layers": config.num_hidden_layers,
        "--hidden": config.hidden_size,
        "--heads": config.num_attention_heads,
        "--kv-heads": config.num_key_value_heads,
        "--head-dim": config.head_dim,
        "--intermediate": config.intermediate_size,
    }
    for flag, value in dims.items():
        if value <= 0:
            raise ConfigError(f"{flag}: expected a positive integer, found {value}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConfigError(
            f"--heads: expected a multiple of --kv-heads ({config.num_key_value_heads}), "
            f"found {config.num_attention_heads}"
        )
    if config.vocab_size < MIN_VOCAB:
        raise ConfigError(
            f"--vocab: expected >= {MIN_VOCAB} (256 bytes + 2 specials + merges), found {config.vocab_size}"
        )
    if dtype not in MODEL_DTYPES.values():
        raise ConfigError(f"--dtype: expected one of {sorted(MODEL_DTYPES)}, found {dtype}")
    if quant not in (None, *QUANT_METHODS):
        raise ConfigError(f"--quant: expected one of {list(QUANT_METHODS)}, found {quant!r}")


def write_checkpoint(
    out_dir: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype = torch.bfloat16,
    quant: str | None = None,
    seed: int = 0,
    shard_size: int = DEFAULT_SHARD_SIZE,
    device: str = "cpu",
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write a seeded checkpoint to ``out_dir`` atomically and return its path.

    Everything is written into a hidden temporary directory beside ``out_dir`` and renamed into
    place at the end, so an interrupted run never leaves a half checkpoint at ``out_dir``. Raises
    ``ConfigError`` for a bad shape, or when ``out_dir`` is non-empty and ``overwrite`` is false;
    ``CheckpointError`` when a write fails (disk full, file too large), after removing the partial files.
    Values depend on (seed, tensor name, device): CPU and CUDA generators draw different numbers.
    """
    validate_config(config, dtype, quant)
    if shard_size <= 0:
        raise ConfigError(f"--shard-size: expected a positive size, found {shard_size}")
    out_dir = Path(out_dir)
    if is_nonempty_dir(out_dir) and not overwrite:
        raise ConfigError(f"{out_dir} exists and is not empty; pass --force to replace it")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} exists and is not a directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        bos, eos = write_tokenizer(tmp, config)
        write_json(tmp / "config.json", hf_config(config, dtype=dtype, quant=quant, bos=bos, eos=eos))
        generation = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
        write_json(tmp / "generation_config.json", generation | {"max_length": config.max_position_embeddings})
        write_weights(
            tmp,
            config,
            dtype=dtype,
            quant=quant,
            seed=seed,
            shard_size=shard_size,
            device=device,
            progress=progress,
        )
        apply_umask(tmp)
        move_into_place(tmp, out_dir, overwrite=overwrite)
    except OSError as exc:  # disk full, file too large, I/O error: one line, nothing left behind
        shutil.rmtree(tmp, ignore_errors=True)
        written = f"{Path(exc.filename).name}: {exc.strerror}" if exc.filename else str(exc)
        raise CheckpointError(f"cannot write the checkpoint {out_dir} ({written}); nothing was left behind") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def apply_umask(tmp: Path) -> None:
    """Give the checkpoint ordinary permissions: mkdtemp (and safetensors) create owner-only ones."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for path in tmp.iterdir():
        path.chmod(0o666 & ~umask)


def move_into_place(tmp: Path, out_dir: Path, *, overwrite: bool) -> None:
    """Rename ``tmp`` to ``out_dir``; an existing checkpoint is replaced only with ``overwrite``."""
    if overwrite and is_nonempty_dir(out_dir):
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
        return
    with contextlib.suppress(OSError):
        out_dir.rmdir()  # an empty directory may be replaced; rename() refuses a non-empty one
    try:
        os.rename(tmp, out_dir)
    except OSError as exc:
        raise ConfigError(f"{out_dir} appeared while writing ({exc.strerror}); pass --force to replace it") from exc


def ensure_default_model() -> Path:
    """The built-in tiny checkpoint, generated on first use; safe when processes race to create it."""
    made = made_default_model()
    if made is not None:
        return made
    try:
        return write_checkpoint(default_model_dir(), PRESETS["tiny"], progress=False)
    except ConfigError:
        made = made_default_model()  # another process won the rename
        if made is not None:
            return made
        raise


def parse_size(text: str) -> int:
    """``2GB`` -> 2_000_000_000, ``1GiB`` -> 2**30, ``500MB``, or plain bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and _SIZE_UNITS.get(match.group(2).lower())
    if not match or unit is None or float(match.group(1)) * unit < 1:
        raise ConfigError(f"--shard-size: expected a positive size like 2GB, 500MB, 1GiB or bytes, found {text!r}")
    return int(float(match.group(1)) * unit)


# CLI flag -> ModelConfig field, applied over the preset.
OVERRIDES = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
    "tie_embeddings": "tie_word_embeddings",
}


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The preset with every given flag applied on top."""
    changes = {field: getattr(args, flag) for flag, field in OVERRIDES.items() if getattr(args, flag) is not None}
    return dataclasses.replace(PRESETS[args.preset], **changes)


def summarize(out: Path, config: ModelConfig, seconds: float) -> str:
    """One line for stderr: parameters, bytes and shards actually written."""
    index = json.loads((out / INDEX_FILE).read_text(encoding="utf-8"))
    shards = len(set(index["weight_map"].values()))
    params = count_params(config) / 1e6
    size = human_bytes(index["metadata"]["total_size"])
    return f"make-model: {params:.1f}M params, {size}, {shards} shard(s) in {seconds:.1f} s"


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    started = time.monotonic()
    out = write_checkpoint(
        Path(args.out),
        config,
        dtype=MODEL_DTYPES[args.dtype],
        quant=args.quant,
        seed=args.seed,
        shard_size=parse_size(args.shard_size),
        device=args.device,
        progress=not args.quiet,
        overwrite=args.force,
    )
    print(out)
    print(summarize(out, config, time.monotonic() - started), file=sys.stderr)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-model",
        help="write a seeded synthetic checkpoint (Hugging Face Llama layout)",
        description="Write a seeded random Llama checkpoint with a BPE tokenizer. Shape flags override the preset.",
    )
    p.add_argument("out", metavar="OUT", help="output directory (must be absent or empty unless --force)")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny", help="base shape (default tiny)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab"):
        p.add_argument(f"--{flag}", type=int, metavar="N", help="override the preset")
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, help="share embed and lm_head")
    p.add_argument("--dtype", choices=list(MODEL_DTYPES), default="bf16", help="weight dtype (default bf16)")
    p.add_argument("--quant", choices=QUANT_METHODS, help="quantize the projections (block FP8)")
    p.add_argument("--seed", type=int, default=0, help="weights are a function of (seed, tensor name)")
    p.add_argument("--shard-size", default="2GB", help="max bytes per shard: 500MB, 2GB, 1GiB, ... (default 2GB)")
    p.add_argument("--device", default="cpu", help="where to generate (cuda is much faster for big models)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
