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
| `default_model`   |                               | the embedded tiny model's path, generated if needed |

``spec`` is a ``LoadSpec``'s fields.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hotweights.cache.arena import plan_layout
from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.daemon import pipeline_source
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.makemodel import ensure_default_model
from hotweights.cache.pipeline import check_spec
from hotweights.errors import HotweightsError
from hotweights.standby.tpgroup import check_group


def tensor_parallel(model: str, spec: dict[str, Any], device: str) -> None:
    """The split ``spec`` asks for divides the model (``check_spec``) and this host has a GPU per rank of a group on
    ``device`` (``check_group``)."""
    load_spec = LoadSpec(**spec)
    check_spec(read_checkpoint(Path(model)), load_spec)
    check_group(load_spec.tp_size, device, None)


def arena_bytes(model: str, spec: dict[str, Any]) -> int:
    """The bytes of ``model``'s arena as a daemon loads it for ``spec``, once the checkpoint passed the daemon's
    checks (``pipeline_source``)."""
    source = pipeline_source(read_checkpoint(Path(model)), LoadSpec(**spec))
    return plan_layout(source.specs())[1]


def default_model() -> str:
    return str(ensure_default_model())


CHECKS: dict[str, Callable[..., Any]] = {
    "tensor_parallel": tensor_parallel,
    "arena_bytes": arena_bytes,
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
