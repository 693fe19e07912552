"""The engine launcher (``standby.launcher``) through the supervisor that uses it: a real launcher process, engines
forked from it as the controller would start them (passed fds at their numbers, the log, the stack's marker, the
command line /proc shows), their exit statuses reported, bad requests refused with one line, and Popen whenever
the launcher cannot start one."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

import pytest

from hotweights.cache.protocol import recv_message, send_message
from hotweights.chaos.hosts import pids_naming
from hotweights.controller import supervisor
from hotweights.controller.launcherclient import LAUNCHER_SOCKET, Launched
from hotweights.controller.spares import is_waiting
from hotweights.spawn import SparePipes, hotweights_command, read_message
from hotweights.standby.launcher import env_refusal
from hotweights.standby.launchwire import TITLE_ROOM, BadRequest, LaunchRequest
from hotweights.waiting import wait_until
from tests.controllerhelpers import ControllerStack

MARKER = "/tmp/a-stack-of-its-own"


def refused_engine(*extra: str) -> list[str]:
    """An engine command that exits 2 at once (a bad flag value), after its imports."""
    return hotweights_command("engine", "--kv-cache-tokens", "1", *extra)


def spare_engine(pipes: SparePipes, engine_id: str) -> list[str]:
    """A spare engine with nothing to prepare (no model there): it says ready on one pipe and waits on the other."""
    model = "/nonexistent/model"
    return hotweights_command("engine", "--model", model, "--engine-id", engine_id, *pipes.flags)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("message", "passed", "why"),
    [
        ({"op": "run"}, 1, "op must be 'launch'"),
        ({"op": "launch", "argv": "engine", "env": {}, "fds": []}, 1, "argv must be a list of strings"),
        ({"op": "launch", "argv": ["x\0"], "env": {}, "fds": []}, 1, "without NUL"),
        ({"op": "launch", "argv": ["python"], "env": {"A": 1}, "fds": []}, 1, "env must be an object of strings"),
        ({"op": "launch", "argv": ["python"], "env": {}, "fds": [2]}, 2, "fds must be a list of distinct fd numbers"),
        ({"op": "launch", "argv": ["python"], "env": {}, "fds": [5, 5]}, 3, "distinct"),
        ({"op": "launch", "argv": ["python"], "env": {}, "fds": [5]}, 1, "expected 2 passed fds"),
        ({"op": "launch", "argv": ["python", "-c", ""], "env": {}, "fds": []}, 1, "argv must start with"),
        ({"op": "launch", "argv": refused_engine("x" * TITLE_ROOM), "env": {}, "fds": []}, 1, "at most 8192 bytes"),
    ],
)
def test_a_malformed_request_names_its_field(message: dict, passed: int, why: str) -> None:
    with pytest.raises(BadRequest, match=why):
        LaunchRequest.parse(message, passed)


@pytest.mark.unit
def test_a_child_runs_with_the_launchers_environment_only() -> None:
    assert env_refusal({"A": "1"}, {"A": "1"}) is None
    refusal = env_refusal({"A": "1", "OMP_NUM_THREADS": "4"}, {"A": "2"})
    assert refusal == "env differs from the launcher's in A, OMP_NUM_THREADS: expected the launcher's environment"


@pytest.mark.unit
def test_an_identity_ignores_the_padding_after_a_launched_command() -> None:
    assert supervisor.command_identity(["python", "-m", "hotweights", "", "", ""]) == ("python", "-m", "hotweights")
    assert supervisor.command_identity(["a", "", "b"]) == ("a", "", "b")
    assert supervisor.command_identity([]) == ()


def test_engines_forked_by_the_launcher_are_the_processes_a_fresh_start_makes(tmp_path: Path) -> None:
    """Through ``Supervisor.spawn``: an engine that refuses its flags exits 2 (reported, its line in its log); a
    spare gets its pipes at the numbers its flags name, says ready, waits (``is_waiting``), shows its own command line
    and the stack's marker in /proc, leads its own session, and exits 0 when released; one SIGKILLed is reported so;
    the launcher refuses another environment (that engine starts with Popen) and a malformed request, each with one
    line in its log."""
    exits: list[supervisor.Process] = []
    watcher = supervisor.Supervisor(tmp_path / "logs", exits.append, MARKER, tmp_path / "run")
    launcher = watcher.launcher
    assert launcher is not None

    async def run() -> None:
        launcher.ensure()
        await asyncio.to_thread(wait_until, launcher.socket_path.exists, 120, "the launcher to listen")

        refused = watcher.spawn("refused", refused_engine())
        assert isinstance(refused.popen, Launched)
        await asyncio.wait_for(refused.exited.wait(), 60)
        assert refused.exit_reason == "exited with code 2"
        assert "--kv-cache-tokens must be >= 2" in (tmp_path / "logs" / "refused.log").read_text()

        pipes = SparePipes.open()
        command = spare_engine(pipes, "g0-e1")
        try:
            spare = watcher.spawn("spare", command, pass_fds=pipes.theirs)
        finally:
            pipes.close_theirs()
        assert isinstance(spare.popen, Launched)
        assert await asyncio.to_thread(read_message, pipes.ready_fd) == {}
        os.close(pipes.ready_fd)
        assert supervisor.read_identity(spare.pid) == spare.identity
        assert spare.identity.command == tuple(command) and is_waiting(spare.pid, command)
        assert supervisor.carries_marker(spare.pid, MARKER) and os.getsid(spare.pid) == spare.pid
        assert ("leftover engine g0-e1", spare.identity) in supervisor.stack_orphans(MARKER)
        os.close(pipes.start_fd)  # released: it exits 0 without starting
        await asyncio.wait_for(spare.exited.wait(), 60)
        assert spare.exit_reason == "exited with code 0"

        pipes = SparePipes.open()
        try:
            killed = watcher.spawn("killed", spare_engine(pipes, "g0-e2"), pass_fds=pipes.theirs)
        finally:
            pipes.close_theirs()
        assert await asyncio.to_thread(read_message, pipes.ready_fd) == {}
        await watcher.fence(killed)
        assert killed.exit_reason == "exited (signal 9, SIGKILL)"
        os.close(pipes.start_fd)
        os.close(pipes.ready_fd)

        other = watcher.spawn("other-env", refused_engine(), env={"PATH": os.environ.get("PATH", "")})
        assert not isinstance(other.popen, Launched)
        await asyncio.wait_for(other.exited.wait(), 60)
        assert other.exit_reason == "exited with code 2"

        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(launcher.socket_path))
            send_message(conn, {"op": "launch", "argv": ["python"], "env": {}, "fds": []})
            reply, _ = await asyncio.to_thread(recv_message, conn)
        assert reply["ok"] is False and reply["error"] == "refused"
        launcher.close()

    try:
        asyncio.run(run())
    finally:
        launcher.kill()
    log = (tmp_path / "logs" / "launcher.log").read_text()
    assert log.count("refused a request") == 2, log
    assert "env differs from the launcher's in" in log and "expected 1 passed fds" in log
    wait_until(lambda: launcher.popen is not None and launcher.popen.poll() is not None, 30, "the launcher's exit")


def test_a_dead_launcher_leaves_engines_startable(tmp_path: Path) -> None:
    """Killed, the launcher is started again at once; meanwhile engines start with Popen, one log line saying so."""
    watcher = supervisor.Supervisor(tmp_path / "logs", lambda _: None, MARKER, tmp_path / "run")
    launcher = watcher.launcher
    assert launcher is not None

    async def run() -> None:
        launcher.ensure()
        await asyncio.to_thread(wait_until, launcher.socket_path.exists, 120, "the launcher to listen")
        first = launcher.popen
        assert first is not None
        first.send_signal(signal.SIGKILL)
        started = watcher.spawn("meanwhile", refused_engine())
        await asyncio.wait_for(started.exited.wait(), 60)
        assert started.exit_reason == "exited with code 2"
        await asyncio.to_thread(wait_until, launcher.socket_path.exists, 120, "the launcher to listen again")
        assert launcher.popen is not first
        again = watcher.spawn("again", refused_engine())
        assert isinstance(again.popen, Launched)
        await asyncio.wait_for(again.exited.wait(), 60)
        launcher.close()

    try:
        asyncio.run(run())
    finally:
        launcher.kill()


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def test_a_stack_replaces_its_primary_from_the_launcher_and_down_leaves_nothing(tiny_model: Path) -> None:
    """``up`` with the shipped ``cluster.launcher``: once the launcher listens, a SIGKILLed primary's slot is started
    again as a child of the launcher and becomes a ready standby; ``down`` then stops every process of the stack,
    the launcher and what it forked included (no spare: the slot's own restart is the replacement)."""
    stack = ControllerStack(tiny_model, engines=2, group_extra="spare = false")
    socket_path = stack.config.state_dir / "run" / LAUNCHER_SOCKET
    try:
        stack.start_controller("up")
        stack.wait_steady()
        wait_until(socket_path.exists, 120, "the launcher to listen")
        launcher = next(pid for pid in pids_naming(str(socket_path)) if "hotweights.standby.launcher" in _argv(pid))
        primary = stack.primary()
        os.kill(primary["pid"], signal.SIGKILL)
        replaced = wait_until(
            lambda: (m := stack.members()[primary["id"]])["pid"] not in (None, primary["pid"]) and m, 60, "a restart"
        )
        assert _parent(replaced["pid"]) == launcher, "the replacement was not forked by the launcher"
        stack.wait_steady()
        assert stack.members()[primary["id"]]["role"] == "standby"
        pids = [*stack.recorded_pids(), launcher]
        down = stack.down()
        assert down.returncode == 0, down.stderr
        assert stack.controller is not None and stack.controller.wait(timeout=30) == 0
        assert [pid for pid in pids if supervisor.read_identity(pid)] == []
        assert supervisor.stack_orphans(supervisor.stack_marker(stack.config.state_dir)) == []
    finally:
        stack.close()


def _argv(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
