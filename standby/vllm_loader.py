"""vLLM's ``--load-format hotweights``: a vLLM engine maps its weights from a hotweights daemon.

Registered in every vLLM process through the ``vllm.general_plugins`` entry point. The daemon
(``hotweights cache serve --format vllm``) ran vLLM's own loader and post-processing once; this
loader builds the model on the meta device, binds zero-copy views of the arena as its parameters and
buffers (tied names bound to one tensor), and re-runs post-processing as already processed.

``--model-loader-extra-config`` keys:

- ``socket`` (required): the daemon's socket.
- ``linear``: ``shared`` (default) computes every linear layer on the arena's weight (on CPU: plain
  ``F.linear``, no oneDNN packing); ``packed`` lets vLLM pack the linear weights on CPU, which
  copies them into this process (faster GEMMs, no sharing of those weights).
- ``report``: a file to write ``{"shared": [...], "copied": [...], "shared_bytes", "copied_bytes"}``
  to, naming which parameters point into the arena.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hotweights.cache.client import Attachment, attach
from hotweights.cache.connection import request
from hotweights.cache.vllm_format import skip_cpu_packing, vllm_fingerprint
from hotweights.engines import LOAD_FORMAT
from hotweights.errors import ConfigError

log = logging.getLogger(__name__)

LINEAR_MODES = ("shared", "packed")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``--load-format hotweights`` known to vLLM."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_loader_class())


def parse_extra_config(extra: dict[str, Any] | None) -> dict[str, Any]:
    """The loader's options, checked: one ConfigError naming the key for anything wrong."""
    options = dict(extra or {})
    unknown = sorted(options.keys() - {"socket", "linear", "report"})
    if unknown:
        raise ConfigError(f"--model-loader-extra-config: unknown key(s) {unknown} for --load-format {LOAD_FORMAT}")
    if not isinstance(options.get("socket"), str) or not options["socket"]:
        raise ConfigError("--model-loader-extra-config: 'socket' (the hotweights daemon's socket) is required")
    options.setdefault("linear", "shared")
    if options["linear"] not in LINEAR_MODES:
        raise ConfigError(f"--model-loader-extra-config: 'linear' must be one of {list(LINEAR_MODES)}")
    return options


def bind_arena(model: nn.Module, attachment: Attachment) -> None:
    """Replace the meta model's parameters by the arena's views and its buffers by private copies
    (tied names: one object)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    bound: dict[str, torch.Tensor] = {}
    aliases = attachment.manifest.get("aliases", {})
    if not isinstance(aliases, dict) or not all(
        isinstance(alias, str) and canonical in attachment.tensors for alias, canonical in aliases.items()
    ):
        raise ConfigError("the daemon's manifest names tied tensors that it does not hold")
    names = {**{n: n for n in attachment.tensors}, **aliases}
    for name, canonical in names.items():
        module_name, _, leaf = name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise ConfigError(f"arena tensor {name!r} has no module {module_name!r} in this vLLM model")
        tensor = bound[canonical] if canonical in bound else attachment.tensors[canonical]
        if leaf in module._buffers:
            # vLLM writes some buffers after loading (attention scales: fill_(1.0)); the arena is
            # read-only, so buffers (small: scales, rotary tables) get a private copy.
            tensor = tensor if canonical in bound else tensor.clone()
            module._buffers[leaf] = tensor
        else:
            if not isinstance(tensor, nn.Parameter):
                tensor = nn.Parameter(tensor, requires_grad=False)
            module._parameters[leaf] = tensor
        bound[canonical] = tensor
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise ConfigError(f"the arena lacks {len(missing)} tensor(s) of this vLLM model, first {missing[0]!r}")


def sharing_report(model: nn.Module, attachment: Attachment) -> dict[str, Any]:
    """Which of the model's parameters and buffers point into the arena, and which were copied."""
    start = attachment.arena.tensor.data_ptr()
    end = start + attachment.arena.tensor.numel()
    shared, copied, shared_bytes, copied_bytes = [], [], 0, 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        nbytes = tensor.numel() * tensor.element_size()
        if start <= tensor.data_ptr() < end:
            shared.append(name)
            shared_bytes += nbytes
        else:
            copied.append(name)
            copied_bytes += nbytes
    return {"shared": shared, "copied": copied, "shared_bytes": shared_bytes, "copied_bytes": copied_bytes}


def _loader_class() -> type:
    from vllm.logger import init_logger

    vllm_log = init_logger(__name__)  # vLLM's processes log through vLLM's handlers, not ours
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.model_executor.utils import weights_already_processed
    from vllm.utils.torch_utils import set_default_torch_dtype

    class HotweightsModelLoader(BaseModelLoader):
        """Maps the processed weights from a hotweights daemon instead of reading the checkpoint."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.options = parse_extra_config(load_config.model_loader_extra_config)
            self.socket = Path(self.options["socket"])

        def download_model(self, model_config: Any) -> None:
            """Nothing to download: the daemon read the checkpoint."""

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            raise ConfigError(f"--load-format {LOAD_FORMAT} maps weights at start; reloading them is not supported")

        def get_external_weight_memory(self, vllm_config: Any) -> int:
            reply = request(self.socket, {"op": "status"})
            return int(reply["status"]["arena_bytes"]) if reply.get("ok") else 0

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            device = torch.device(vllm_config.device_config.device)
            tp = (get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())
            fingerprint = vllm_fingerprint(model_config, *tp, device)
            attachment = attach(self.socket, fingerprint, str(device), offer_handover=True)
            with set_default_torch_dtype(model_config.dtype):
                with torch.device("meta"):
                    model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
                bind_arena(model, attachment)
                if self.options["linear"] == "shared":
                    skip_cpu_packing(model)
                with weights_already_processed():
                    process_weights_after_loading(model, model_config, device)
            report = sharing_report(model, attachment)
            vllm_log.info(
                "hotweights: mapped %d tensors in %.1f ms; %d shared (%d bytes), %d copied (%d bytes)",
                len(attachment.tensors),
                attachment.seconds * 1000,
                len(report["shared"]),
                report["shared_bytes"],
                len(report["copied"]),
                report["copied_bytes"],
            )
            if self.options.get("report"):
                Path(self.options["report"]).write_text(json.dumps(report, indent=1))
            model._hotweights_attachment = attachment  # the views and the arena live as long as the model
            return model.eval()

    return HotweightsModelLoader
