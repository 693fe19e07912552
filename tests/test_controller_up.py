"""``hotweights up`` runs the whole stack (gateway included) in the foreground; ``hotweights down`` stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hotweights.contract import Endpoint
from hotweights.controller.supervisor import read_identity
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, ProcessDaemon
from tests.controllerhelpers import ControllerStack, wait_until


def test_up_serves_through_the_gateway_and_down_stops_everything(tiny_model: Path) -> None:
    stack = ControllerStack(tiny_model, engines=2)
    try:
        stack.start_controller("up")
        stack.wait_up(90)
        summary = stack.logs()
        gateway = f"http://127.0.0.1:{stack.config.gateway.port}"
        assert f"controller  {stack.url}" in summary and f"gateway     {gateway}/v1" in summary
        response = httpx.post(f"{gateway}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
        assert response.status_code == 200, response.text
        # An engine added at runtime is not in cluster.toml: the gateway learns of it from the state file.
        added = stack.client.post("/engines", json={"group": 0})
        assert added.status_code == 201, added.text
        new_id, new_port = added.json()["id"], added.json()["port"]
        stack.wait_steady()
        failover = stack.client.post("/failover", json={"candidate": new_id})
        assert failover.status_code == 200, failover.text
        stack.wait_steady()
        response = httpx.post(f"{gateway}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
        assert response.status_code == 200, response.text
        assert response.headers["x-hotweights-upstream"] == f"http://127.0.0.1:{new_port}"
        pids = stack.recorded_pids()
        assert len(pids) == 6  # three engines, the daemon, two gateway workers
        down = stack.down()
        assert down.returncode == 0, down.stderr
        assert stack.controller.wait(timeout=30) == 0
        assert [pid for pid in pids if read_identity(pid)] == []  # gone (a zombie counts as gone)
        assert stack.recorded_pids() == []
    finally:
        stack.close()


class SteadyClients:
    """``THREADS`` clients sending completions through the gateway back to back, each on a fresh connection
    (so every request is a new connect), recording what each request ended with."""

    THREADS = 3

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.ok = 0
        self.refused: list[str] = []  # no connection: what a crash must never cause
        self.failed: list[str] = []  # connected, then no complete 200
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.THREADS)]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                response = httpx.post(self.url, json={"prompt": "hello", "max_tokens": 4}, timeout=60)
            except httpx.ConnectError as exc:
                self.refused.append(repr(exc))
            except httpx.TransportError as exc:
                self.failed.append(repr(exc))
            else:
                if response.status_code == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"{response.status_code}: {response.text[:200]}")

    def wait_successes(self, more: int) -> None:
        target = self.ok + more
        wait_until(lambda: self.ok >= target, 120, f"{more} more successful requests", interval=0.05)

    def __enter__(self) -> SteadyClients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=90)


def _gateway_workers(stack: ControllerStack) -> dict[str, dict]:
    return {s["id"]: s for s in stack.cluster()["services"] if s["kind"] == "gateway"}


def _respawned(stack: ControllerStack, killed: dict[str, int]) -> bool:
    """Every killed worker (id -> its pid) runs again under a new pid and serves."""
    workers = _gateway_workers(stack)
    return all(workers[i]["pid"] not in (None, pid) and workers[i]["serving"] for i, pid in killed.items())


def _worker_primaries(stack: ControllerStack) -> dict[str, list[str]]:
    """Each gateway worker's primaries, asked on its own Unix socket (the shared port reaches either)."""
    found = {}
    for path in sorted((stack.config.state_dir / "run").glob("gateway*.sock")):
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://gateway") as worker:
            found[path.stem] = worker.get(Endpoint.GATEWAY_HEALTH).json()["primaries"]
    return found


def test_gateway_workers_learn_a_new_primary_by_push_not_by_their_poll(tiny_model: Path) -> None:
    """Workers that poll only every minute learn the primary a switchover made within seconds: the
    controller tells each of them to probe at once after a role change."""
    stack = ControllerStack(tiny_model, engines=2, gateway_extra="probe_interval_ms = 60000\n")
    try:
        stack.start_controller("up")
        stack.wait_up(90)
        old = stack.primary()["url"]
        wait_until(lambda: _worker_primaries(stack) == {"gateway": [old], "gateway-1": [old]}, 30, "both workers")
        switched = stack.client.post("/switchover", json={})
        assert switched.status_code == 200, switched.text
        new = stack.primary()["url"]
        assert new != old
        started = time.monotonic()
        wait_until(lambda: _worker_primaries(stack) == {"gateway": [new], "gateway-1": [new]}, 5, "the push")
        print(
            f"\nboth gateway workers routed to the new primary {(time.monotonic() - started) * 1000:.0f} ms after "
            "the switchover answered"
        )
    finally:
        stack.close()


def _complete(stack: ControllerStack) -> httpx.Response:
    gateway = f"http://127.0.0.1:{stack.config.gateway.port}"
    return httpx.post(f"{gateway}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)


def _up_serves(stack: ControllerStack, ups: int) -> None:
    """``ups`` ready summaries in the (appended) log, then a completion through the gateway."""
    wait_until(lambda: stack.logs(10**8).count("is up") >= ups, 60, f"ready summary number {ups}", interval=0.1)
    response = wait_until(lambda: (r := _complete(stack)).status_code == 200 and r, 30, "a completion")
    assert response.json()["choices"][0]["text"] is not None


def test_up_again_after_the_whole_stack_was_sigkilled(tiny_model: Path) -> None:
    """SIGKILL of the controller and every child at once leaves stale pids, sockets and locks behind."""
    stack = ControllerStack(tiny_model, engines=2)
    try:
        stack.start_controller("up")
        _up_serves(stack, 1)
        pids = [stack.controller.pid, *stack.recorded_pids()]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        stack.controller.wait(timeout=10)
        wait_until(lambda: not any(read_identity(pid) for pid in pids), 10, "the stack to be gone")
        assert list((stack.config.state_dir / "run").glob("*.sock")), "no socket left behind: a weaker test"
        stack.start_controller("up")
        _up_serves(stack, 2)
    finally:
        stack.close()


def test_up_from_a_corrupt_state_file_stops_the_leftovers_and_starts_fresh(tiny_model: Path) -> None:
    """The controller died, then state.json was damaged: the engines and daemon it left are found by their
    command lines and stopped, the file is kept aside, and the stack starts fresh."""
    stack = ControllerStack(tiny_model, engines=2)
    try:
        stack.start_controller()
        stack.wait_steady()
        leftovers = stack.recorded_pids()
        stack.kill_controller()
        stack.config.state_file.write_text('{"members": {"g0-e0": {"group": "zero"')
        stack.start_controller("up")
        _up_serves(stack, 1)
        assert [pid for pid in leftovers if read_identity(pid)] == []
        (aside,) = stack.config.state_dir.glob("state.json.corrupt-*")
        assert aside.read_text().startswith('{"members"')
        assert "unreadable controller state: not JSON" in stack.logs()
    finally:
        stack.close()


def test_up_refuses_a_state_file_of_an_unknown_version(tiny_model: Path) -> None:
    stack = ControllerStack(tiny_model, engines=2)
    try:
        stack.config.state_file.parent.mkdir(parents=True)
        stack.config.state_file.write_text('{"version": 7}')
        up = subprocess.run(
            hotweights_command("up", "--config", str(stack.config_path)),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert up.returncode == 2, up.stderr
        assert up.stderr.strip().splitlines() == [
            f"hotweights up: error: {stack.config.state_file}: controller state version 7, this hotweights reads "
            "version 1; run the hotweights that wrote it, or move the file away to start fresh"
        ]
        assert stack.config.state_file.read_text() == '{"version": 7}'
    finally:
        stack.close()


def run_hotweights(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(hotweights_command(*args), env=ENV, capture_output=True, text=True, timeout=120)


def test_cache_commands_find_a_running_stacks_daemon_and_a_stand_alone_one(tiny_model: Path, own_world: Path) -> None:
    """One discovery rule: the stack's daemon (socket under its state dir) publishes itself in the runtime dir,
    so ``cache status``, ``cache verify`` and ``generate --weight-cache client`` find it without --socket, next
    to a stand-alone daemon; once the stack is down its name is gone."""
    stack = ControllerStack(tiny_model, engines=1)
    try:
        stack.start_controller("up")
        stack.wait_steady()
        stack_socket = stack.root / "state" / "run" / "g0.sock"
        with ProcessDaemon(tiny_model, own_world / "run" / "alone.sock", "--dtype", "bf16") as alone:
            status = run_hotweights("cache", "status", "--json")
            assert status.returncode == 0, status.stderr
            assert sorted(s["socket"] for s in json.loads(status.stdout)) == sorted(
                [str(stack_socket), str(alone.paths.socket)]
            )
            assert alone.kill(signal.SIGTERM) == 0
        verify = run_hotweights("cache", "verify")
        assert verify.returncode == 0 and verify.stdout.startswith("OK: content hash"), verify.stderr
        prompt = ("--model", str(tiny_model), "--prompt", "The weather", "--max-tokens", "8")
        attached = run_hotweights("generate", *prompt, "--weight-cache", "client")
        assert attached.returncode == 0, attached.stderr
        assert "attached" in attached.stderr
        assert attached.stdout == run_hotweights("generate", *prompt).stdout
        down = stack.down()
        assert down.returncode == 0, down.stderr
        stack.controller.wait(timeout=30)
        assert list((own_world / "run").glob("*.sock")) == []
    finally:
        stack.close()


def _signal_at(stack: ControllerStack, start: int, event: str, sig: signal.Signals) -> None:
    """Send ``sig`` to ``up`` once ``event`` is in its log after offset ``start``."""
    wait_until(lambda: event in stack.logs(10**8)[start:], 90, repr(event), interval=0.005)
    stack.controller.send_signal(sig)


def _stopped_cleanly(stack: ControllerStack, start: int) -> None:
    assert stack.controller.wait(timeout=60) == 0, stack.logs()
    assert "Traceback" not in stack.logs(10**8)[start:], stack.logs()
    assert stack.recorded_pids() == []


@pytest.mark.timeout(300)
def test_signals_stop_up_cleanly_at_any_moment(tiny_model: Path) -> None:
    """SIGINT or SIGTERM before anything started, during the start-up, once the stack serves, during an adoption,
    during the stop (a second one escalates: what is left is killed) and after it: `up` exits 0, no traceback,
    nothing left. After the clean stop of a serving stack, `up` again is a start-up (no failover loop) and serves."""
    stack = ControllerStack(tiny_model, engines=2)
    try:
        stack.start_controller("up")  # before the event loop: the lock is taken, nothing started yet
        wait_until(lambda: (stack.config.state_dir / "controller.lock").exists(), 60, "the lock", interval=0.001)
        stack.controller.send_signal(signal.SIGINT)
        _stopped_cleanly(stack, 0)
        start = len(stack.logs(10**8))
        stack.start_controller("up")  # start-up, then a second signal while it stops
        _signal_at(stack, start, "starting g0-cache", signal.SIGTERM)
        _signal_at(stack, start, "Shutting down", signal.SIGINT)
        _stopped_cleanly(stack, start)
        stack.start_controller("up")
        _up_serves(stack, 1)
        start = len(stack.logs(10**8))
        stack.controller.send_signal(signal.SIGINT)
        _stopped_cleanly(stack, start)
        stack.start_controller("up")
        _up_serves(stack, 2)
        second = stack.logs(10**8)[start:]
        assert "failing over" not in second and "report it as a BUG" not in second
        stack.kill_controller()
        start = len(stack.logs(10**8))
        stack.start_controller("up")  # adopting the running stack, then a signal once all is stopped
        _signal_at(stack, start, "Started server process", signal.SIGINT)
        _signal_at(stack, start, "stopped g0-cache", signal.SIGTERM)
        _stopped_cleanly(stack, start)
    finally:
        stack.close()


@pytest.mark.parametrize(
    ("command", "directory", "fault"),
    [
        ("up", "runtime", "writable"),
        ("controller", "state", "writable"),
        ("up", "state", "owned"),
        ("down", "state", "writable"),
    ],
)
def test_a_directory_others_control_is_refused_in_one_line(
    tiny_model: Path, own_world: Path, command: str, directory: str, fault: str
) -> None:
    """A runtime or state directory someone else owns or may write to could have its sockets, pid records or
    state.json replaced: refused before anything starts, as `cache serve` refuses its socket directory."""
    if fault == "owned" and os.getuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    stack = ControllerStack(tiny_model, engines=1)
    try:
        path = own_world / "run" if directory == "runtime" else stack.config.state_dir
        path.mkdir(parents=True)
        if fault == "owned":
            os.chown(path, 65534, 65534)
        else:
            path.chmod(0o777)
        result = run_hotweights(command, "--config", str(stack.config_path))
        problem = "is owned by uid 65534" if fault == "owned" else "is writable by others (mode 777)"
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith(f"hotweights {command}: error: {directory} directory {path} {problem}")
    finally:
        stack.close()


@pytest.fixture(scope="module")
def gateway_stack(tiny_model: Path) -> Iterator[ControllerStack]:
    """A serving ``up`` stack of two engines whose gateway workers the crash tests kill or stop; each test ends
    once the controller has replaced them, so the next finds both workers serving."""
    stack = ControllerStack(tiny_model, engines=2)
    try:
        stack.start_controller("up")
        stack.wait_up(90)
        yield stack
    finally:
        stack.close()


def test_a_gateway_crash_refuses_no_connection(gateway_stack: ControllerStack) -> None:
    """The controller holds the gateway's listening socket and hands it to each worker it starts. SIGKILL of
    one worker under steady load: its peer accepts every new connection at once. SIGKILL of both: new
    connections wait in the kernel's queue until the respawned workers, on the same port, take them. No
    connection is ever refused; only requests in flight on a killed worker may fail."""
    stack = gateway_stack
    url = f"http://127.0.0.1:{stack.config.gateway.port}/v1/completions"
    with SteadyClients(url) as clients:
        clients.wait_successes(5)
        first = {"gateway": _gateway_workers(stack)["gateway"]["pid"]}
        os.kill(first["gateway"], signal.SIGKILL)
        clients.wait_successes(5)  # while it is being respawned: its peer serves
        wait_until(lambda: _respawned(stack, first), 60, "the killed worker respawned")
        both = {worker_id: s["pid"] for worker_id, s in _gateway_workers(stack).items()}
        assert len(both) == 2
        for pid in both.values():
            os.kill(pid, signal.SIGKILL)
        clients.wait_successes(5)
        wait_until(lambda: _respawned(stack, both), 60, "both workers respawned")
        clients.wait_successes(5)
    assert clients.refused == []
    assert len(clients.failed) <= 3 * SteadyClients.THREADS, clients.failed  # three kills, one request each


@pytest.mark.timeout(240)
def test_a_hung_gateway_costs_only_the_requests_it_had_accepted(gateway_stack: ControllerStack) -> None:
    """SIGSTOP of one worker under steady load: its peer accepts every new connection, and the controller
    replaces the stopped one after two unanswered probes. Only requests the stopped worker had accepted fail."""
    stack = gateway_stack
    earlier = len(stack.events("hung"))
    url = f"http://127.0.0.1:{stack.config.gateway.port}/v1/completions"
    with SteadyClients(url) as clients:
        clients.wait_successes(5)
        first = {"gateway": _gateway_workers(stack)["gateway"]["pid"]}
        os.kill(first["gateway"], signal.SIGSTOP)
        clients.wait_successes(5)  # while it is stopped: its peer serves
        wait_until(lambda: _respawned(stack, first), 60, "the hung worker replaced")
        clients.wait_successes(5)
    hung = [e["message"] for e in stack.events("hung")][earlier:]
    assert len(hung) == 1 and "answered none of 2 probes" in hung[0], hung
    assert clients.refused == []
    assert len(clients.failed) <= SteadyClients.THREADS, clients.failed  # at most one request per client
