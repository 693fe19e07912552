"""``python -m hotweights.standby.checker CHECKS``: the controller's checks that need torch or the checkpoint
parser, in a short-lived process of their own, so the controller never imports either.

``CHECKS`` is a JSON list of ``{"op": OP, ...arguments}``; each is run in order and the process prints one JSON
object on its last stdout line, ``{"results": [...]}``, one entry per check: ``{"value": V}``, or ``{"error":
MESSAGE}`` when the check refused with a HotweightsError (its one line). Anything else is a crash: a traceback on
stderr and a non-zero exit. ``controller.checks`` starts it and reads the answer.

| op                | arguments                     | value                                               |
| ----------------- | ----------------------------- | --------------------------------------------------- |
| `tensor_parallel` | model, spec, device           | null: the split fits the model and this host's GPUs  |
| `arena_bytes`     | model, spec                   | the bytes of the model's arena for ``spec``         |
| `serving`         | model, spec                   | ``{"arena_bytes", "kv_token_bytes"}``: see below     |
| `device`          | device                        | null: this torch has the device                      |
| `default_model`   |                               | the embedded tiny model's path, generated if needed |

``spec`` is a ``LoadSpec``'s fields. ``serving`` checks the model as a group's daemon and engines read it (config,
index, safetensors headers, ``spec``'s checks, tokenizer) and gives its arena's bytes and the bytes one token
position takes in one sequence slot of the reference engine's KV cache (keys and values of every layer, on rank 0).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hotweights.cache.arena import plan_layout
from hotweights.cache.checkpoint import Checkpoint, read_checkpoint
from hotweights.cache.daemon import pipeline_source
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.makemodel import ensure_default_model
from hotweights.cache.pipeline import check_spec, processed_config, processed_dtype
from hotweights.errors import ConfigError, HotweightsError
from hotweights.standby.model import KVCache, TensorParallel
from hotweights.standby.tpgroup import check_group
from hotweights.tokenizer import load_tokenizer, stop_token_ids


def tensor_parallel(model: str, spec: dict[str, Any], device: str) -> None:
    """The split ``spec`` asks for divides the model (``check_spec``) and this host has a GPU per rank of a group on
    ``device`` (``check_group``)."""
    load_spec = LoadSpec(**spec)
    check_spec(read_checkpoint(Path(model)), load_spec)
    check_group(load_spec.tp_size, device, None)


def arena_bytes(model: str, spec: dict[str, Any]) -> int:
    """The bytes of ``model``'s arena as a daemon loads it for ``spec``, once the checkpoint passed the daemon's
    checks (``pipeline_source``)."""
    return _arena_bytes(read_checkpoint(Path(model)), LoadSpec(**spec))


def _arena_bytes(checkpoint: Checkpoint, spec: LoadSpec) -> int:
    return plan_layout(pipeline_source(checkpoint, spec).specs())[1]


def serving(model: str, spec: dict[str, Any]) -> dict[str, int]:
    """``model`` as a group's daemon loads it for ``spec`` and its engines read it: the arena's bytes and one KV
    token position's bytes (the module docstring). ``spec``'s device must exist (``device``): the fingerprint asks
    a CUDA device for its properties."""
    load_spec = LoadSpec(**spec)
    device(load_spec.device)
    checkpoint = read_checkpoint(Path(model))
    load_tokenizer(checkpoint.path)
    stop_token_ids(checkpoint.path)
    config, tp = processed_config(checkpoint, load_spec), TensorParallel(load_spec.tp_size)
    token_bytes = KVCache.position_bytes(config, tp, processed_dtype(checkpoint, load_spec))
    return {"arena_bytes": _arena_bytes(checkpoint, load_spec), "kv_token_bytes": token_bytes}


def device(device: str) -> None:
    """``device`` exists for this torch: ``cpu``, or ``cuda:N`` with a CUDA build that sees more than N devices."""
    if device == "cpu":
        return
    if torch.version.cuda is None:
        raise ConfigError(f"{device} is not available: this torch ({torch.__version__}) was built without CUDA")
    count = torch.cuda.device_count()
    if int(device.split(":")[1]) >= count:
        raise ConfigError(f"{device} is not available: torch {torch.__version__} sees {count} CUDA device(s) here")


def default_model() -> str:
    return str(ensure_default_model())


CHECKS: dict[str, Callable[..., Any]] = {
    "tensor_parallel": tensor_parallel,
    "arena_bytes": arena_bytes,
    "serving": serving,
    "device": device,
    "default_model": default_model,
}


def run(check: dict[str, Any]) -> dict[str, Any]:
    """One check's entry of the answer: its value, or the one line it refused with."""
    arguments = {key: value for key, value in check.items() if key != "op"}
    try:
        return {"value": CHECKS[check["op"]](**arguments)}
    except HotweightsError as exc:
        return {"error": str(exc)}


def main(argv: list[str]) -> int:
    checks = json.loads(argv[0])
    print(json.dumps({"results": [run(check) for check in checks]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
