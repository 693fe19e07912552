"""The engine's Triton kernels checked against plain torch at warm-up, on the device that will run them.

Triton compiles each kernel for the GPU and the Triton release it meets; a kernel that fails to compile there, or
computes something else, would fail every graph capture or serve wrong tokens. So before a graphed decoder captures its
steps (``standby.decoder``), one decode step of every slot, at positions spread over the whole cache (so across the
split-KV kernels' splits), runs with split-KV attention (``standby.decodeattention``), then with the fused elementwise
kernels (``standby.fused``) on top of the attention that passed, each kernel's every call checked against plain torch on
the same inputs (``fused.checking``; split-KV attention against ``SplitKv.plain``, its math in plain torch). A kernel
that raises, returns a value that is not finite, or departs from plain torch by more than TOLERANCE of the largest plain
value is not used, and a warning line says so: without split-KV attention the decoder captures a graph per KV length,
without the fused kernels unfused graphed steps. Rounding differs between the ways (sums in other orders, one rounding
instead of several), which the tolerance leaves room for; a miscompiled kernel gives other numbers altogether. Why call
by call, not the whole step's logits: through 48 layers of a model the rounding of one kernel grows with every layer, so
that a right kernel and a wrong one cannot be told apart by the logits. Measured: on an H200 with ``xl`` fused kernels
that agree with plain torch call by call gave logits 5.2-5.9 % of the largest apart; on an H100, split-KV attention's
logits departed by 5.1-5.3 % of the largest in some engines and under the 5 % tolerance in others of the same host, so a
host's verdict (below) depended on which engine wrote it last, and without split-KV each engine held 3.7 GB of CUDA
graphs instead of 0.66 GB (63 graphs instead of 7), which left a group's spare no room to warm up.

The verdict depends only on the device, the software and the model's shapes, so it is remembered on the host
(``hotweights_home()/kernelchecks``, a file per key: the device's name and architecture, the torch and Triton versions,
the kernels' sources, the model's configuration and dtype, the cache's length): the first engine of a host pays the
check (on ``xl`` some seconds: two steps over every slot, each kernel call run in plain torch too, the kernels' first
compiles), every later one reads its file. A file that cannot be read is checked again and written over. With it goes
the time of the one warm-up prefill that depends on the same things alone, one prompt of the cache's whole length (what
the progress check expects of the longest prefills, ``standby.progress``): the host's first engine measures it, later
ones read it instead of running it (on ``xl`` 4096 tokens, the warm-up's heaviest work on the device, which a serving
primary beside it would share).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from hotweights.paths import hotweights_home, write_json
from hotweights.standby import fused

log = logging.getLogger(__name__)
# The modules whose code the verdict is about: a change to any of them checks again.
KERNEL_SOURCES = ("fused.py", "fusedkernels.py", "decodeattention.py", "decodekernels.py", "kernelcheck.py")

TOLERANCE = 0.05  # of the largest plain torch value of a call: rounding passes, a wrong kernel does not

# One decode step of the probe: (KV length read by every row, None for each row's own; fused) -> (B, V) logits.
Step = Callable[[int | None, bool], torch.Tensor]


@dataclass(frozen=True)
class KernelVerdict:
    """Which of the kernels a decoder may use, and the warning line of each it may not."""

    split_kv: bool
    fused: bool
    warnings: tuple[str, ...] = ()
    longest_prefill_s: float = 0.0  # one prompt of the whole cache length, by the host's first engine (0: not yet)


def probe_inputs(rows: int, positions: int, vocab: int, device: torch.device) -> torch.Tensor:
    """(2, rows) tokens and positions of the probe step: positions spread evenly over 0 .. positions - 1."""
    where = torch.linspace(0, positions - 1, rows).long() if rows > 1 else torch.tensor([positions - 1])
    tokens = (torch.arange(rows) * 7919 + 1) % vocab
    return torch.stack([tokens, where]).to(device)


def verdict(step: Step, split_kv: bool, positions: int) -> KernelVerdict:
    """Try the kernels the decoder would use (split-KV attention where ``split_kv``, then the fused elementwise
    kernels on top of what passed, over ``positions`` KV positions where split-KV attention is not used), each call
    against plain torch on its inputs."""
    warnings: list[str] = []
    split_step = functools.partial(step, None, False)
    attention = split_kv and _passes("split-KV attention", lambda: call_disagreement(split_step), warnings)
    fused_step = functools.partial(step, None if attention else positions, True)
    fusing = _passes("the fused kernels", lambda: call_disagreement(fused_step), warnings)
    return KernelVerdict(attention, fusing, tuple(warnings))


def call_disagreement(run: Callable[[], torch.Tensor]) -> str | None:
    """Why the checked kernels' calls in ``run`` (a step: its logits) are not plain torch's up to rounding, each call
    checked against plain torch on its own inputs (module docstring); None when they are."""
    with fused.checking() as worst:
        logits = run()
    if not bool(torch.isfinite(logits).all()):
        return "a logit is not finite"
    off = {name: departure for name, departure in sorted(worst.items()) if not departure <= TOLERANCE}
    if off:
        return ", ".join(f"{name} departs by {departure:.3g} of the largest value" for name, departure in off.items())
    return None


def _passes(what: str, reason_of: Callable[[], str | None], warnings: list[str]) -> bool:
    try:
        reason = reason_of()
    except Exception as exc:  # a compile error of Triton's takes many types
        reason = f"it failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if reason is not None:
        warnings.append(f"{what} on this device do not compute what plain torch does ({reason}): not used")
        log.warning("%s", warnings[-1])
    return reason is None


def host_key(device: torch.device, model_config: object, dtype: torch.dtype, positions: int) -> str:
    """The remembered verdict's key (module docstring): a hash of what the verdict depends on."""
    sources = Path(__file__).parent
    parts = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else [],
        "torch": torch.__version__,
        "triton": _version("triton"),
        "sources": [hashlib.sha256((sources / name).read_bytes()).hexdigest() for name in KERNEL_SOURCES],
        "model": repr(model_config),
        "dtype": str(dtype),
        "positions": positions,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def verdict_path(key: str) -> Path:
    return hotweights_home() / "kernelchecks" / f"{key}.json"


def remembered(key: str) -> KernelVerdict | None:
    """The verdict a host's earlier engine wrote for ``key``; None where there is none or it cannot be read."""
    path = verdict_path(key)
    try:
        found = json.loads(path.read_text())
        warnings = tuple(map(str, found["warnings"]))
        return KernelVerdict(bool(found["split_kv"]), bool(found["fused"]), warnings, float(found["longest_prefill_s"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("kernel check: %s cannot be read (%s): checking again", path, exc)
        return None


def remember(key: str, found: KernelVerdict) -> None:
    """Write ``found`` for the host's later engines, whole or not at all (a file renamed into place); a failure to
    write costs them the check, so it is logged, not raised."""
    path = verdict_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, dataclasses.asdict(found))
    except OSError as exc:
        log.warning("kernel check: its verdict could not be kept in %s (%s): later engines check again", path, exc)
