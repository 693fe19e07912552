"""Real daemons and engine processes for the cache tests, always cleaned up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.paths import DaemonPaths
from hotweights.spawn import hotweights_command
from hotweights.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
# The live environment (not a copy): tests/conftest.py gives every test its own HOTWEIGHTS_HOME and runtime
# dir there, and the children a test starts with ``env=ENV`` must see this test's, not the first one's.
ENV = os.environ

# A process busy on the CPU as an engine computing is: two threads hashing, which releases the GIL, so that on cores the
# rest of the suite keeps busy it still gets its share of a check's wait in /proc's 10 ms ticks (``busy_process``).
BUSY = """
import hashlib, threading
block = bytes(1 << 20)
def spin():
    while True:
        hashlib.sha256(block).digest()
for _ in range(2):
    threading.Thread(target=spin).start()
"""


def busy_process() -> subprocess.Popen:
    """A process that runs on the CPU until killed (``BUSY``)."""
    return subprocess.Popen([sys.executable, "-c", BUSY])


if TYPE_CHECKING:  # the daemon and the checkpoint reader import torch: on first use only (tests/conftest.py)
    from hotweights.cache.daemon import CacheDaemon
    from hotweights.cache.fingerprint import Fingerprint


class ThreadDaemon:
    """A CacheDaemon running in this (test) process, so the test can look at its arena."""

    def __init__(self, model: Path, socket_path: Path, spec: LoadSpec | None = None, **kwargs: Any) -> None:
        from hotweights.cache.checkpoint import read_checkpoint
        from hotweights.cache.daemon import CacheDaemon, pipeline_source

        checkpoint = read_checkpoint(model)
        kwargs.setdefault("allowed_uids", frozenset([os.getuid()]))
        kwargs.setdefault("backend", "cpu-shm")
        self.paths = DaemonPaths(socket_path)
        self.daemon = CacheDaemon(pipeline_source(checkpoint, spec or LoadSpec()), self.paths, **kwargs)
        self.thread = threading.Thread(target=self.daemon.run, daemon=True)

    def __enter__(self) -> CacheDaemon:
        self.thread.start()
        wait_until(lambda: self.serving() or not self.thread.is_alive(), what="daemon ready")
        assert self.thread.is_alive(), "daemon thread died during load"
        return self.daemon

    def serving(self) -> bool:
        """The ready marker is ours (a SIGKILLed predecessor leaves a stale one behind)."""
        try:
            return json.loads(self.paths.ready.read_text())["pid"] == os.getpid()
        except (FileNotFoundError, json.JSONDecodeError):
            return False

    def __exit__(self, *exc: object) -> None:
        self.daemon.request_exit()
        self.thread.join(timeout=10)


class ProcessDaemon:
    """``hotweights cache serve`` as a real child process."""

    def __init__(self, model: Path, socket_path: Path, *extra: str) -> None:
        self.paths = DaemonPaths(socket_path)
        command = hotweights_command("cache", "serve", "--model", str(model))
        self.command = [*command, "--socket", str(socket_path), *extra]
        self.process: subprocess.Popen | None = None

    def start(self) -> ProcessDaemon:
        self.process = subprocess.Popen(self.command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_until(lambda: self.serving() or self.process.poll() is not None, what="daemon ready")
        assert self.process.poll() is None, self.process.stderr.read().decode()
        return self

    def serving(self) -> bool:
        """The ready marker is ours (a SIGKILLed predecessor leaves a stale one behind)."""
        try:
            return json.loads(self.paths.ready.read_text())["pid"] == self.process.pid
        except (FileNotFoundError, json.JSONDecodeError):
            return False

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        return self.process.wait(timeout=30)

    def __enter__(self) -> ProcessDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


class Engine:
    """tests/attach_worker.py: attaches through standby.weights.load_model and takes commands."""

    def __init__(self, model: Path, socket_path: Path, mode: str = "client", device: str = "cpu") -> None:
        worker = str(REPO / "tests" / "attach_worker.py")
        self.process = subprocess.Popen(
            [sys.executable, worker, str(model), str(socket_path), mode, device],
            env=ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"engine failed to start: {self.process.stderr.read()}")
        self.hello = json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            stream.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def fingerprint_of(model: Path, device: str = "cpu") -> Fingerprint:
    from hotweights.cache.checkpoint import read_checkpoint
    from hotweights.cache.fingerprint import compute_fingerprint

    return compute_fingerprint(read_checkpoint(model), LoadSpec(device=device))


def engine_python(engine: str, wanted: str) -> str:
    """``HOTWEIGHTS_TEST_<ENGINE>_PYTHON``: a Python with that engine and hotweights (``.ci/run`` builds it); the
    test is skipped without one, or fails when ``HOTWEIGHTS_REQUIRE_<ENGINE>=1`` says it must run."""
    variable, required = f"HOTWEIGHTS_TEST_{engine.upper()}_PYTHON", f"HOTWEIGHTS_REQUIRE_{engine.upper()}"
    python = os.environ.get(variable, "")
    if not python:
        if os.environ.get(required) == "1":
            pytest.fail(f"{required}=1 but {variable} is not set")
        pytest.skip(f"no {engine}: set {variable} to a Python with {wanted} and hotweights")
    return python


def bench_result(command: list[str], timeout: float) -> dict:
    """A bench's result: its last stdout line, one JSON object (printed, for the test's log), once it exited 0
    (``run_to_the_end``)."""
    bench = run_to_the_end(command, timeout)
    assert bench.returncode == 0, bench.stderr[-3000:]
    result = json.loads(bench.stdout.strip().splitlines()[-1])
    print(f"\n{json.dumps(result)}")
    return result


def run_to_the_end(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a drill or bench to its end. Past ``timeout`` (or on any interruption) it gets SIGTERM, on which it
    tears its stack down, and is waited for, so a slow run fails the test without leaving processes behind."""
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:
        process.terminate()
        process.communicate(timeout=60)
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
