"""SGLang's ``--load-format hotweights``: an SGLang engine maps its weights from a hotweights daemon.

Registered through the ``sglang.srt.plugins`` entry point, which SGLang loads in its launcher and its
scheduler process: the plugin adds ``hotweights`` to ``--load-format``'s choices and, through SGLang's
hook registry, turns that name into this loader's class when SGLang builds its ``LoadConfig``
(SGLang builds a loader given as a class directly). The daemon (``hotweights cache serve --format
sglang``) ran SGLang's own loader and post-processing once; this loader builds the model on the meta
device and binds zero-copy views of the arena as its parameters (buffers: private copies), checked
by the daemon's fingerprint and content hash as every hotweights client is.

``--model-loader-extra-config`` keys (removed before SGLang's own loader sees the rest):

- ``socket`` (required): the daemon's socket.
- ``fallback``: ``load`` (default): when the daemon is absent or refuses, one warning line and
  SGLang's own loading of the checkpoint; ``refuse``: the engine does not start.
- ``report``: a file to write ``{"shared": [...], "copied": [...], "shared_bytes", "copied_bytes"}``
  to, naming which parameters point into the arena (or ``{"fallback": reason}``).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch

from hotweights.cache.client import attach
from hotweights.cache.connection import AttachRefused, DaemonUnavailable
from hotweights.cache.sglang_format import sglang_fingerprint
from hotweights.engines import LOAD_FORMAT
from hotweights.errors import ConfigError
from hotweights.standby.vllm_loader import bind_arena, sharing_report

log = logging.getLogger(__name__)

KEYS = ("socket", "fallback", "report")
FALLBACKS = ("load", "refuse")


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: make ``--load-format hotweights`` known to SGLang."""
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    HookRegistry.register("sglang.srt.configs.load_config.LoadConfig._verify_load_format", _verify, HookType.AROUND)


def _verify(original: Any, load_config: Any) -> None:
    """``LoadConfig._verify_load_format``: our name becomes our loader's class; any other goes to SGLang."""
    if isinstance(load_config.load_format, str) and load_config.load_format.lower() == LOAD_FORMAT:
        load_config.load_format = _loader_class()
        return None
    return original(load_config)


def parse_extra_config(extra: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Our options, checked, and the rest of the extra config (SGLang's)."""
    extra = dict(extra or {})
    options = {key: extra.pop(key) for key in KEYS if key in extra}
    if not isinstance(options.get("socket"), str) or not options["socket"]:
        raise ConfigError("--model-loader-extra-config: 'socket' (the hotweights daemon's socket) is required")
    options.setdefault("fallback", "load")
    if options["fallback"] not in FALLBACKS:
        raise ConfigError(f"--model-loader-extra-config: 'fallback' must be one of {list(FALLBACKS)}")
    return options, extra


@functools.cache
def _loader_class() -> type:
    from sglang.srt.configs.load_config import LoadFormat
    from sglang.srt.model_loader.loader import DefaultModelLoader, _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    class HotweightsModelLoader(DefaultModelLoader):
        """Maps the processed weights from a hotweights daemon; SGLang's own loading as the fallback."""

        def __init__(self, load_config: Any) -> None:
            self.options, rest = parse_extra_config(load_config.model_loader_extra_config)
            own = copy.copy(load_config)  # SGLang's loading (the fallback, weight updates) reads the checkpoint
            own.load_format, own.model_loader_extra_config = LoadFormat.AUTO, rest
            super().__init__(own)
            self.socket = Path(self.options["socket"])

        def load_model(self, *, model_config: Any, device_config: Any) -> torch.nn.Module:
            device = torch.device(device_config.device)
            try:
                attachment = attach(self.socket, sglang_fingerprint(model_config, 1, 0, device), str(device))
            except (DaemonUnavailable, AttachRefused) as exc:
                if self.options["fallback"] == "refuse":
                    raise ConfigError(f"hotweights: the daemon on {self.socket} gave no weights: {exc}") from exc
                log.warning("hotweights: falling back to SGLang's own loading: daemon on %s: %s", self.socket, exc)
                self.write_report({"fallback": str(exc)})
                return super().load_model(model_config=model_config, device_config=device_config)
            quant_config = _get_quantization_config(model_config, self.load_config)
            with set_default_torch_dtype(model_config.dtype):
                with torch.device("meta"):
                    model = _initialize_model(model_config, self.load_config, quant_config)
                bind_arena(model, attachment)
            report = sharing_report(model, attachment)
            log.info(
                "hotweights: mapped %d tensors from %s in %.1f ms; %d shared (%d bytes), %d copied (%d bytes)",
                len(attachment.tensors),
                self.socket,
                attachment.seconds * 1000,
                len(report["shared"]),
                report["shared_bytes"],
                len(report["copied"]),
                report["copied_bytes"],
            )
            self.write_report(report)
            model._hotweights_attachment = attachment  # the views and the arena live as long as the model
            return model.eval()

        def write_report(self, report: dict[str, Any]) -> None:
            if self.options.get("report"):
                Path(self.options["report"]).write_text(json.dumps(report, indent=1))

    return HotweightsModelLoader
