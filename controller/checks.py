"""The controller's checks of a model that need torch or the checkpoint parser, run by a short-lived process
(``standby.checker``) so the controller itself never imports them: the model, device and KV cache that ``up``
checks before it starts anything (``controller.preflight``), a tensor-parallel split, a model update's arena bytes,
the embedded tiny model made on first use.

Each call blocks until that process answers (a second or two: it imports torch); call it off the event loop.
A check's refusal comes back as a HotweightsError with the check's own one line; a process that crashes, times
out or answers something else, as a HotweightsError that says so. A caller that may be asked to stop meanwhile
(``up`` at its start, on a signal) passes ``stopped``: once it answers true, the process is killed and the call
raises ``Stopped``.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hotweights.cache.loadspec import LoadSpec
from hotweights.errors import HotweightsError
from hotweights.paths import made_default_model
from hotweights.spawn import module_command

CHECKER = "hotweights.standby.checker"
CHECK_TIMEOUT_S = 120.0  # imports torch, reads a checkpoint's headers, or makes the tiny model
POLL_S = 0.05  # how often a wait for the checking process looks at ``stopped``


class Stopped(Exception):
    """The caller asked to stop (``stopped`` answered true) before the checking process answered; it was killed."""


def never() -> bool:
    return False


def run_checks(
    checks: list[dict[str, Any]], timeout: float = CHECK_TIMEOUT_S, stopped: Callable[[], bool] = never
) -> list[Any]:
    """Each check's value, or the HotweightsError it refused with, in order (``standby.checker``'s ops).
    HotweightsError when the checking process fails to answer; Stopped (module docstring)."""
    command = module_command(CHECKER, json.dumps(checks))
    what = f"the model check (python -m {CHECKER})"
    stdout, stderr, returncode = _answer(command, timeout, stopped, what)
    lines = stdout.strip().splitlines()
    try:
        results = json.loads(lines[-1])["results"] if returncode == 0 and lines else None
    except (json.JSONDecodeError, KeyError, TypeError):
        results = None
    if not isinstance(results, list) or len(results) != len(checks):
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        raise HotweightsError(f"{what} exited with code {returncode} without an answer: {last}")
    return [HotweightsError(r["error"]) if "error" in r else r.get("value") for r in results]


def _answer(command: list[str], timeout: float, stopped: Callable[[], bool], what: str) -> tuple[str, str, int]:
    """Run ``command`` to its end: its stdout, stderr and exit status. Killed (and waited for) on a timeout
    (HotweightsError) or once ``stopped()`` (Stopped), which is asked every POLL_S and at the end: a Ctrl-C at a
    terminal reaches the checking process too, which then ends without an answer."""
    deadline = time.monotonic() + timeout
    with subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as child:
        while True:
            try:
                stdout, stderr = child.communicate(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                if stopped() or time.monotonic() > deadline:
                    child.kill()
                    child.communicate()
                    if stopped():
                        raise Stopped from None
                    raise HotweightsError(f"{what} did not answer within {timeout:.0f} s") from None
    if stopped():
        raise Stopped
    return stdout, stderr, child.returncode


def check(op: str, stopped: Callable[[], bool] = never, **arguments: Any) -> Any:
    """One check's value; HotweightsError with its refusal; Stopped (module docstring)."""
    [outcome] = run_checks([{"op": op, **arguments}], stopped=stopped)
    if isinstance(outcome, HotweightsError):
        raise outcome
    return outcome


def tensor_parallel_refusals(
    model_dir: Path, groups: list[tuple[LoadSpec, str]], stopped: Callable[[], bool] = never
) -> list[HotweightsError | None]:
    """Per group (its rank 0's load spec, its device): why its tensor-parallel split cannot run here, or None.
    One checking process for all of them."""
    checks = [{"op": "tensor_parallel", "model": str(model_dir), "spec": asdict(s), "device": d} for s, d in groups]
    outcomes = run_checks(checks, stopped=stopped) if checks else []
    return [o if isinstance(o, HotweightsError) else None for o in outcomes]


@dataclass(frozen=True)
class Serving:
    """What a group's model takes on its device (``standby.checker``'s ``serving``): its arena, and one token
    position of one sequence slot of an engine's KV cache."""

    arena_bytes: int
    kv_token_bytes: int


def serving_checks(
    model_dir: Path, groups: list[tuple[LoadSpec, str]], stopped: Callable[[], bool] = never
) -> list[tuple[Serving | HotweightsError, HotweightsError | None]]:
    """Per group (its rank 0's load spec, its device): what its model takes (or why it cannot be served), and why
    its device is not there (or None). One checking process for all of them."""
    checks: list[dict[str, Any]] = []
    for spec, device in groups:
        checks += [{"op": "device", "device": device}, {"op": "serving", "model": str(model_dir), "spec": asdict(spec)}]
    outcomes = run_checks(checks, stopped=stopped) if checks else []
    pairs = zip(outcomes[1::2], outcomes[::2], strict=True)
    return [(o if isinstance(o, HotweightsError) else Serving(**o), d) for o, d in pairs]


def arena_bytes(model_dir: Path, spec: LoadSpec) -> int:
    """The bytes of ``model_dir``'s arena for ``spec``; HotweightsError when a daemon would refuse the checkpoint."""
    return check("arena_bytes", model=str(model_dir), spec=asdict(spec))


def default_model(stopped: Callable[[], bool] = never) -> Path:
    """The embedded tiny model: made already (no process started), else made now by the checking process (processes
    that race to make it are safe: ``cache.makemodel.ensure_default_model``)."""
    made = made_default_model()
    return made if made is not None else Path(check("default_model", stopped))
