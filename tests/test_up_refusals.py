"""``hotweights up`` refuses what cannot run before it starts anything, gives up on a slot that keeps failing to
start the same way, and stops at a signal from its first instant; each time in one line, with nothing left running.

Every test runs ``up`` as a process in a world of its own (its state dir under the test's directory, free ports).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hotweights.chaos.hosts import pids_naming
from hotweights.controller.config import load_config
from hotweights.controller.decide import GIVE_UP_AFTER
from hotweights.controller.supervisor import descendants, read_identity
from hotweights.ports import free_port, free_ports
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, wait_until

REFUSED_WITHIN_S = 30.0  # the target: a bad model path, device or KV size refused this soon


def write_config(root: Path, model: Path, *, cluster: str = "", group: str = "", engine: str = "") -> Path:
    """A cluster.toml of one group of two engines on free ports, its state dir under ``root``; ``cluster``,
    ``group`` and ``engine``: more keys for ``[cluster]``, ``[[groups]]`` and ``[engine]``."""
    base = free_ports(3, consecutive=True)[0]
    path = root / "cluster.toml"
    path.write_text(
        f'[cluster]\nport = {free_port()}\nstate_dir = "{root / "state"}"\n{cluster}\n[model]\npath = "{model}"\n\n'
        f"[[groups]]\nengines = 2\nbase_port = {base}\n{group}\n[engine]\nkv_cache_tokens = 256\n{engine}\n"
        f"[gateway]\nport = {free_port()}\n"
    )
    return path


def run_up(config: Path, timeout: float = 120.0) -> tuple[subprocess.CompletedProcess[str], float]:
    """``hotweights up --config CONFIG`` to its end: the result and how long it took. Past ``timeout`` (``up`` never
    stopped), whatever it started is killed before the test fails: nothing of it outlives the test."""
    started = time.monotonic()
    try:
        result = subprocess.run(
            hotweights_command("up", "--config", str(config)), env=ENV, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        for pid in pids_naming(str(config.parent)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise
    return result, time.monotonic() - started


def assert_nothing_started(root: Path) -> None:
    """No process names the stack's directory, and nothing ever wrote a log there (no process was started)."""
    assert pids_naming(str(root)) == []
    assert not (root / "state" / "logs").exists()


@pytest.fixture
def root(own_world: Path) -> Path:
    return own_world


@pytest.mark.parametrize(
    ("fault", "line"),
    [
        ("missing model", "model.path: {root}/nowhere does not exist"),
        ("no checkpoint", "model.path: {root}/config.json is missing"),
        ("no cuda", "groups[0].device: cuda:0 is not available: this torch ({torch}) was built without CUDA"),
        ("kv cache", "engine.kv_pool_tokens = 1000000000: one engine's KV pool (1000000000 positions x "),
    ],
)
def test_a_config_that_cannot_run_is_refused_in_one_line_naming_the_key(
    root: Path, tiny_model: Path, fault: str, line: str
) -> None:
    """Each refused within 30 s, with exit 2 and one line naming the key, before anything started."""
    if fault == "no cuda" and torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch has cuda:0 (or says so only once it looks)")
    model = {"missing model": root / "nowhere", "no checkpoint": root}.get(fault, tiny_model)
    group = 'device = "cuda:0"' if fault == "no cuda" else ""
    config = write_config(root, model, group=group, engine="kv_pool_tokens = 1000000000" if fault == "kv cache" else "")
    result, took = run_up(config)
    expected = f"hotweights up: error: {config}: " + line.format(root=root, torch=torch.__version__)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(expected), result.stderr
    assert took < REFUSED_WITHIN_S
    print(f"\n{fault}: refused in {took:.1f} s: {result.stderr.strip()}")
    assert_nothing_started(root)


@contextlib.contextmanager
def listening(port: int) -> Iterator[None]:
    """A socket of this process listening on ``port``: another process, as ``up`` sees it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield


@pytest.mark.parametrize("taken", ["gateway.port", "groups[0].base_port (engine g0-e1)"])
def test_a_port_another_process_holds_is_refused_naming_the_process(root: Path, tiny_model: Path, taken: str) -> None:
    config = write_config(root, tiny_model)
    loaded = load_config(config)
    port = loaded.gateway.port if taken == "gateway.port" else loaded.engines()[1].port
    with listening(port):
        result, took = run_up(config)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(
        f"hotweights up: error: {config}: {taken}: 127.0.0.1:{port} is in use by another process (pid {os.getpid()}: "
    )
    assert result.stderr.rstrip().endswith("): stop it or choose another port")
    print(f"\n{taken}: refused in {took:.1f} s")
    assert_nothing_started(root)


@pytest.mark.timeout(300)
def test_an_engine_that_keeps_failing_to_start_the_same_way_stops_up(root: Path, tiny_model: Path) -> None:
    """Engines that can never be ready within their start timeout (no port or model fault to refuse up front): the
    first failure is told on the console, the third alike stops the stack; exit 2 with that reason, last. The engines
    start as fresh processes (imports of over a second): one forked by the launcher can be ready within 0.2 s."""
    config = write_config(root, tiny_model, cluster="launcher = false", group="start_timeout_s = 0.2")
    result, took = run_up(config, timeout=240)
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    reason = "killed: not ready 0.2 s after it started"
    assert lines[-1].startswith("hotweights up: error: gave up: g0-e"), lines[-1]
    assert f" failed to start {GIVE_UP_AFTER} times in a row, each time: {reason}" in lines[-1]
    assert lines[-1].endswith("; stopped everything it started")
    warned = [line for line in lines if "WARNING hotweights.controller.startfailures" in line]
    assert warned and f"could not start: {reason}" in warned[0]
    assert "Traceback" not in result.stderr
    assert pids_naming(str(root)) == []
    print(f"\ngave up after {took:.1f} s: {lines[-1]}")


def catches_sigint(pid: int) -> bool:
    """Whether ``pid`` has a handler of its own for SIGINT (``SigCgt`` in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & 1 << (signal.SIGINT - 1))


def start_up(config: Path) -> subprocess.Popen[str]:
    """``up`` as a shell's background job starts it: SIGINT ignored, so Python installs no KeyboardInterrupt and
    whatever ``up`` does not catch itself is lost."""
    ignore = functools.partial(signal.signal, signal.SIGINT, signal.SIG_IGN)
    command = hotweights_command("up", "--config", str(config))
    return subprocess.Popen(command, env=ENV, stderr=subprocess.PIPE, text=True, preexec_fn=ignore)


def test_sigint_from_the_first_instant_of_up_stops_it_with_nothing_started(root: Path, tiny_model: Path) -> None:
    """The SIGINT comes as soon as ``up`` catches it: before its command's module is imported."""
    config = write_config(root, tiny_model)
    with start_up(config) as up:
        wait_until(lambda: catches_sigint(up.pid), 30, "up to catch SIGINT", interval=0.001)
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
    assert up.returncode == 0, err
    assert "stopped by signal 2 before starting or adopting anything" in err and "Traceback" not in err
    assert_nothing_started(root)


def checker_of(pid: int) -> int | None:
    """The model check ``pid`` runs now (``controller.checks``' process), if any."""
    for child in descendants(pid):
        identity = read_identity(child)
        if identity and "hotweights.standby.checker" in identity.command:
            return child
    return None


def test_sigint_while_up_checks_the_model_ends_the_check_and_up(root: Path, tiny_model: Path) -> None:
    config = write_config(root, tiny_model)
    with start_up(config) as up:
        checker = wait_until(lambda: checker_of(up.pid), 60, "the model check", interval=0.005)
        up.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = up.communicate(timeout=60)
    assert up.returncode == 0, err
    assert "stopped by signal 2 before starting or adopting anything" in err and "Traceback" not in err
    assert read_identity(checker) is None
    print(f"\nup stopped {time.monotonic() - sent:.2f} s after the SIGINT, its model check killed")
    assert_nothing_started(root)
