"""A spare ``hotweights agent`` (``--start-fd``) with small real programs as its engine, driven through its pipes
as the controller drives it: ready message, start message, release. The real vLLM and SGLang spares are in
tests/test_vllm.py and tests/test_sglang.py; these run everywhere, in seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from hotweights.contract import Endpoint
from hotweights.controller.supervisor import read_identity
from hotweights.ports import free_port
from hotweights.proctree import descendants
from hotweights.spawn import SparePipes, hotweights_command, parse_message, readable, send_message
from hotweights.standby.agentengine import ENGINE_NICE
from hotweights.standby.pacing import narrowed
from tests.cachehelpers import ENV, wait_until

ENGINE = Path(__file__).with_name("dropping_engine.py")  # healthy, lists one model, answers completions
WAIT_S = 60.0


@dataclass
class SpareAgent:
    process: subprocess.Popen
    pipes: SparePipes
    log: Path  # where its output goes until its start (the group's spares' log)
    started: bool = False  # its start pipe closed

    def ready_message(self) -> dict | None:
        """Its ready message (None: its ready pipe closed without one)."""
        assert readable(self.pipes.ready_fd, WAIT_S), "no ready message"
        return parse_message(os.read(self.pipes.ready_fd, 4096))

    def engine_log(self, engine_id: str) -> Path:
        return self.log.parent / f"{engine_id}.{self.process.pid}.engine.log"

    def start(self, message: dict | None) -> None:
        """Send the start message (None: none, a release) and close the pipe, as the controller does."""
        if message is not None:
            send_message(self.pipes.start_fd, message)
        os.close(self.pipes.start_fd)
        self.started = True

    def close(self) -> None:
        os.close(self.pipes.ready_fd)
        if not self.started:
            os.close(self.pipes.start_fd)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["hotweights", "engine", "--port", "0"], ["hotweights", "engine", "--port", "0", "F"]),
        (["agent", "--port", "0", "--", "vllm", "--x"], ["agent", "--port", "0", "F", "--", "vllm", "--x"]),
        (["agent", "--", "sh", "-c", "x", "--", "y"], ["agent", "F", "--", "sh", "-c", "x", "--", "y"]),
    ],
)  # fmt: skip
def test_a_spares_pipe_flags_go_to_its_own_command_not_the_one_it_runs(command: list[str], expected: list[str]) -> None:
    pipes = SparePipes(("F",), (-1, -1), -1, -1)
    assert pipes.command(command) == expected


def spare(tmp_path: Path, *engine: str) -> SpareAgent:
    """An agent started as the controller starts a spare of a vLLM or SGLang group: port 0, id ``g0-spare``."""
    pipes = SparePipes.open()
    command = hotweights_command("agent", "--port", "0", "--engine-id", "g0-spare", "--log-dir", str(tmp_path))
    command = pipes.command([*command, "--ready-timeout", str(WAIT_S), "--", *engine])
    log = tmp_path / "g0-engines.log"
    with log.open("ab") as out:
        process = subprocess.Popen(command, env=ENV, stdout=out, stderr=out, pass_fds=pipes.theirs)
    pipes.close_theirs()
    return SpareAgent(process, pipes, log)


def thread_cpu_sets(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of ``pid`` and its descendants (one that ends meanwhile is skipped)."""
    found = set()
    for process in (pid, *descendants(pid)):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{process}/task"):
                with contextlib.suppress(OSError):
                    found.add(frozenset(os.sched_getaffinity(int(task))))
    return found


def test_a_ready_spare_reports_what_it_holds_then_serves_its_slot_ready_at_once(tmp_path: Path) -> None:
    """Its engine ready before any port of its own, the agent's and its engine's every thread on the spare's share
    of the CPUs (``standby.pacing``); the start message names the slot: it listens on the slot's port, ready without
    waiting for its engine again, every thread on every CPU, its output in the slot's log, its engine's named after
    it."""
    from hotweights.chaos.memory import stack_pids  # imports torch, which the fast tier's modules do only where used

    agent = spare(tmp_path, sys.executable, str(ENGINE), "{port}", str(tmp_path))  # its server names the stack too
    try:
        held = agent.ready_message()
        assert held is not None and held["host_bytes"] > 10 << 20, held  # a Python engine under its guard
        assert "device_bytes" not in held  # no process of it on a GPU
        assert agent.engine_log("g0-spare").exists()
        assert stack_pids((str(tmp_path),)) == []  # a drill counts a waiting spare, its server too, in no leak
        allowed = os.sched_getaffinity(0)
        assert thread_cpu_sets(agent.process.pid) == {frozenset(narrowed(allowed))}  # its share while it waits
        port, slot_log = free_port(), tmp_path / "g0-e1.log"
        agent.start({"port": port, "engine_id": "g0-e1", "log": str(slot_log)})
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(url + Endpoint.READY, timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, WAIT_S, "the started spare ready on the slot's port")
        health = httpx.get(url + Endpoint.LIVE, timeout=5).json()
        assert health["engine_id"] == "g0-e1"
        nice = os.getpriority(os.PRIO_PROCESS, health["engine"]["pid"]) - os.getpriority(os.PRIO_PROCESS, health["pid"])
        assert nice == min(ENGINE_NICE, 19 - os.getpriority(os.PRIO_PROCESS, health["pid"]))  # the agent before it
        assert agent.engine_log("g0-e1").exists() and not agent.engine_log("g0-spare").exists()
        assert len(stack_pids((str(tmp_path),))) == 3  # started: the agent, its guard, its server
        assert thread_cpu_sets(agent.process.pid) == {frozenset(allowed)}  # started: every thread on every CPU
        logged = slot_log.read_text()
        assert "spare started as g0-e1 (engine ready)" in logged and "engine ready in" not in logged
    finally:
        agent.close()


@pytest.mark.parametrize("release", ["pipe closed", "SIGTERM"])
def test_a_released_spare_stops_its_engine_and_everything_in_its_group_and_exits_0(
    tmp_path: Path, release: str
) -> None:
    """Its engine forked a child of its own (in the engine's process group): both go, and the spare's engine log."""
    script = f"sleep 1000 & exec {sys.executable} {ENGINE} $0"
    agent = spare(tmp_path, "sh", "-c", script, "{port}")
    try:
        assert agent.ready_message() is not None
        tree = descendants(agent.process.pid)
        assert len(tree) == 3, tree  # the guard, the engine, its sleep
        if release == "SIGTERM":
            agent.process.send_signal(signal.SIGTERM)
        else:
            agent.start(None)
        assert agent.process.wait(WAIT_S) == 0, agent.log.read_text()
        wait_until(lambda: not any(map(read_identity, tree)), WAIT_S, "the spare's engine and its child gone")
        assert not agent.engine_log("g0-spare").exists()
    finally:
        agent.close()


def test_a_spare_whose_engine_exits_fails_with_the_reason_and_sends_no_ready_message(tmp_path: Path) -> None:
    agent = spare(tmp_path, "sh", "-c", "echo cannot load the model >&2; exit 3", "{port}")
    try:
        assert agent.ready_message() is None
        assert agent.process.wait(WAIT_S) == 1
        (line,) = [line for line in agent.log.read_text().splitlines() if line.startswith("hotweights agent: error:")]
        assert "g0-spare" in line and "exited with code 3" in line and "cannot load the model" in line
    finally:
        agent.close()
