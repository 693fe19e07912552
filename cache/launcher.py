"""Start a detached cache daemon and wait until it serves (``--weight-cache daemon``).

The daemon is started in its own session, with its output in a log file beside its socket, so it
outlives the engine that started it: the next engine start attaches in milliseconds.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from pathlib import Path

from hotweights.cache.connection import AttachRefused, DaemonUnavailable, hello
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.paths import DaemonPaths, ensure_private_dir
from hotweights.pidlock import is_held
from hotweights.spawn import hotweights_command

log = logging.getLogger(__name__)

POLL_S = 0.05


def daemon_command(
    model_dir: Path, spec: LoadSpec, paths: DaemonPaths, backend: str | None = None, python: str | None = None
) -> list[str]:
    """The ``hotweights cache serve`` command line for this spec (run by ``python``, default ours)."""
    command = hotweights_command("cache", "serve", "--model", str(model_dir), python=python)
    command += ["--device", spec.device, "--tp-size", str(spec.tp_size), "--tp-rank", str(spec.tp_rank)]
    command += ["--socket", str(paths.socket)]
    if spec.dtype is not None:
        command += ["--dtype", spec.dtype]
    if spec.quantize:
        command += ["--quantize", spec.quantize]
    if backend:
        command += ["--backend", backend]
    return command


def spawn_daemon(command: list[str], paths: DaemonPaths) -> subprocess.Popen:
    """Start ``command`` detached (new session, no stdin, output appended to the log)."""
    ensure_private_dir(paths.socket.parent)
    with open(paths.log, "ab") as out:
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, close_fds=True
        )


def ensure_daemon(
    model_dir: Path, spec: LoadSpec, paths: DaemonPaths, *, timeout: float, backend: str | None = None
) -> None:
    """Return once a daemon answers on ``paths.socket``, starting one if none does."""
    if _answers(paths):
        return
    log.info("no weight cache daemon on %s: starting one (log: %s)", paths.socket, paths.log)
    process = spawn_daemon(daemon_command(model_dir, spec, paths, backend), paths)
    # The daemon outlives us in its own session; a waiting thread reaps it if it dies first (no zombie).
    threading.Thread(target=process.wait, name="reap-cache-daemon", daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _answers(paths):
            return
        if process.poll() is not None and not is_held(paths.lock):
            raise DaemonUnavailable(
                f"the weight cache daemon exited with code {process.returncode} before serving; "
                f"last log lines from {paths.log}:\n{_tail(paths.log)}"
            )
        time.sleep(POLL_S)
    raise DaemonUnavailable(
        f"the weight cache daemon did not serve on {paths.socket} within {timeout:.0f} s "
        f"(still loading? see {paths.log}); raise --weight-cache-timeout for big models"
    )


def _answers(paths: DaemonPaths) -> bool:
    try:
        hello(paths.socket, timeout=1.0)
    except (DaemonUnavailable, AttachRefused):
        return False
    return True


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
