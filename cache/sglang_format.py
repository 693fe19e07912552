"""The SGLang arena format: SGLang's own loader runs once, in the daemon; SGLang engines map the result.

``hotweights cache serve --format sglang``, run with a Python that has SGLang, resolves the server
arguments an engine started on the same model and dtype would resolve, runs SGLang's default loader
(build, load, ``process_weights_after_loading``) and lays every parameter and buffer, under SGLang's
names and fused layout (``qkv_proj``, ``gate_up_proj``), into one arena. SGLang engines load it
through the ``hotweights`` load format (``hotweights.standby.sglang_loader``).

Only unquantized weights that SGLang computes with as loaded are exported: a layer that SGLang
repacked after loading (its CPU AMX kernels: ``use_intel_amx_backend``) computes with state that is
not a tensor, so the daemon refuses it rather than export weights an engine would misread. The
fingerprint adds the SGLang version and architecture (``layout``): two SGLang releases, or two
architectures, never share an arena.
"""

from __future__ import annotations

import logging
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from hotweights.cache.daemon import ArenaSource
from hotweights.cache.fingerprint import Fingerprint, engine_layout_fingerprint
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.vllm_format import exported_source
from hotweights.dtypes import model_config_name
from hotweights.errors import ConfigError
from hotweights.ports import free_port

log = logging.getLogger(__name__)

TESTED_SGLANG = "0.5.23"  # the loader, plugin and runtime-context APIs this format relies on


def sglang_version() -> str:
    """The installed SGLang's version; ConfigError naming this Python when there is none, or another release."""
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise ConfigError(f"--format sglang needs SGLang, and {sys.executable} has none (pip install sglang)") from None
    if version != TESTED_SGLANG:
        raise ConfigError(
            f"--format sglang: {sys.executable} has SGLang {version}; hotweights supports {TESTED_SGLANG}"
        )
    return version


def sglang_fingerprint(model_config: Any, tp_size: int, tp_rank: int, device: torch.device) -> Fingerprint:
    """The fingerprint of SGLang's processed weights for ``model_config`` (``sglang...ModelConfig``)."""
    architecture = (model_config.hf_config.architectures or ["unknown"])[0]
    layout = f"sglang-{sglang_version()}:{architecture}"
    return engine_layout_fingerprint(Path(model_config.model_path), model_config, layout, tp_size, tp_rank, device)


def refuse_repacked(model: torch.nn.Module) -> None:
    """ConfigError when SGLang repacked a layer after loading (its weights are then not what it computes with)."""
    repacked = [name for name, module in model.named_modules() if getattr(module, "use_intel_amx_backend", False)]
    if repacked:
        raise ConfigError(
            f"--format sglang: SGLang repacked {len(repacked)} layer(s) for its CPU AMX kernels "
            f"(first {repacked[0]!r}); such weights cannot be shared"
        )


def server_args(model_dir: Path, spec: LoadSpec) -> Any:
    """The resolved ``ServerArgs`` of an engine started with ``--model-path model_dir --device ... --dtype ...``."""
    from sglang.srt.server_args import prepare_server_args

    if spec.tp_size != 1:
        raise ConfigError("--format sglang: tensor parallelism is not supported yet (use --tp-size 1)")
    if spec.quantize:
        raise ConfigError("--format sglang: --quantize does not apply (SGLang reads the checkpoint's quantization)")
    device = torch.device(spec.device)
    argv = ["--model-path", str(model_dir), "--device", device.type]
    argv += ["--dtype", model_config_name(spec.dtype)] if spec.dtype is not None else []
    args = prepare_server_args(argv)
    args.resolve_once()
    return args


def model_config_of(args: Any) -> Any:
    """The ``ModelConfig`` an engine builds from ``args``."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.configs.model_config import ModelConfig

    cfg = resolving_view(args)
    return ModelConfig(model_path=cfg.model_path, dtype=cfg.dtype, quantization=cfg.quantization)


def load_sglang_model(args: Any, device: torch.device) -> torch.nn.Module:
    """SGLang's default loader, once, in this process (the set-up SGLang's own weight cache daemon does)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import init_dp_gathered_buffer, initialize_dp_attention
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.runtime_context import SpawnRanks, publish

    publish(args, role="weight_cache_daemon", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    initialize_moe_config()
    model_config = model_config_of(args)
    if model_config.quantization:
        raise ConfigError(
            f"--format sglang: {model_config.quantization} checkpoints are not supported (their processed form "
            "keeps state outside the tensors an arena holds); use SGLang's own loading"
        )
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        local_rank=0,
        backend="gloo" if device.type == "cpu" else "nccl",
    )
    initialize_model_parallel()
    initialize_dp_attention(args)
    init_dp_gathered_buffer(model_config)
    loader = get_model_loader(load_config=LoadConfig(load_format="auto"), model_config=model_config)
    model = loader.load_model(model_config=model_config, device_config=DeviceConfig(device.type, device.index or 0))
    refuse_repacked(model)
    return model.eval()


def sglang_source(model_dir: Path, spec: LoadSpec) -> ArenaSource:
    """The daemon's ``ArenaSource`` for ``--format sglang``: the fingerprint now (SGLang's config), the model
    when the daemon loads (``vllm_format.exported_source``)."""
    sglang_version()
    args = server_args(model_dir, spec)
    device = torch.device(spec.device)
    fingerprint = sglang_fingerprint(model_config_of(args), spec.tp_size, spec.tp_rank, device)
    return exported_source(fingerprint, device, lambda: load_sglang_model(args, device), "SGLang", model_dir)
