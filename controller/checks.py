"""The controller's checks of a model that need torch or the checkpoint parser, run by a short-lived process
(``standby.checker``) so the controller itself never imports them: a tensor-parallel split at ``up``, a model
update's arena bytes, the embedded tiny model made on first use.

Each call blocks until that process answers (a second or two: it imports torch); call it off the event loop.
A check's refusal comes back as a HotweightsError with the check's own one line; a process that crashes, times
out or answers something else, as a HotweightsError that says so.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hotweights.cache.loadspec import LoadSpec
from hotweights.errors import HotweightsError
from hotweights.paths import made_default_model
from hotweights.spawn import module_command

CHECKER = "hotweights.standby.checker"
CHECK_TIMEOUT_S = 120.0  # imports torch, reads a checkpoint's headers, or makes the tiny model


def run_checks(checks: list[dict[str, Any]], timeout: float = CHECK_TIMEOUT_S) -> list[Any]:
    """Each check's value, or the HotweightsError it refused with, in order (``standby.checker``'s ops).
    HotweightsError when the checking process fails to answer."""
    command = module_command(CHECKER, json.dumps(checks))
    what = f"the model check (python -m {CHECKER})"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise HotweightsError(f"{what} did not answer within {timeout:.0f} s") from None
    lines = done.stdout.strip().splitlines()
    try:
        results = json.loads(lines[-1])["results"] if done.returncode == 0 and lines else None
    except (json.JSONDecodeError, KeyError, TypeError):
        results = None
    if not isinstance(results, list) or len(results) != len(checks):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise HotweightsError(f"{what} exited with code {done.returncode} without an answer: {last}")
    return [HotweightsError(r["error"]) if "error" in r else r.get("value") for r in results]


def check(op: str, **arguments: Any) -> Any:
    """One check's value; HotweightsError with its refusal."""
    [outcome] = run_checks([{"op": op, **arguments}])
    if isinstance(outcome, HotweightsError):
        raise outcome
    return outcome


def tensor_parallel_refusals(model_dir: Path, groups: list[tuple[LoadSpec, str]]) -> list[HotweightsError | None]:
    """Per group (its rank 0's load spec, its device): why its tensor-parallel split cannot run here, or None.
    One checking process for all of them."""
    checks = [{"op": "tensor_parallel", "model": str(model_dir), "spec": asdict(s), "device": d} for s, d in groups]
    return [o if isinstance(o, HotweightsError) else None for o in run_checks(checks)] if checks else []


def arena_bytes(model_dir: Path, spec: LoadSpec) -> int:
    """The bytes of ``model_dir``'s arena for ``spec``; HotweightsError when a daemon would refuse the checkpoint."""
    return check("arena_bytes", model=str(model_dir), spec=asdict(spec))


def default_model() -> Path:
    """The embedded tiny model: made already (no process started), else made now by the checking process (processes
    that race to make it are safe: ``cache.makemodel.ensure_default_model``)."""
    made = made_default_model()
    return made if made is not None else Path(check("default_model"))
