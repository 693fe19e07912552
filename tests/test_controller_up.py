"""``hotweights up`` runs the whole stack (gateway included) in the foreground; ``hotweights down`` stops it."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import httpx
from hotweights.controller.supervisor import read_identity

from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, ProcessDaemon
from tests.controllerhelpers import ControllerStack, wait_until


def test_up_serves_through_the_gateway_and_down_stops_everything(tiny_model: Path) -> None:
    stack = ControllerStack(tiny_model, engines=2)
    try:
        stack.start_controller("up")
        wait_until(lambda: "is up" in stack.logs(), 90, "the ready summary", interval=0.1)
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
        assert len(pids) == 5  # three engines, the daemon, the gateway
        down = subprocess.run(
            hotweights_command("down", "--config", str(stack.config_path)),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert down.returncode == 0, down.stderr
        assert stack.controller.wait(timeout=30) == 0
        assert [pid for pid in pids if read_identity(pid)] == []  # gone (a zombie counts as gone)
        assert stack.recorded_pids() == []
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
        down = run_hotweights("down", "--config", str(stack.config_path))
        assert down.returncode == 0, down.stderr
        stack.controller.wait(timeout=30)
        assert list((own_world / "run").glob("*.sock")) == []
    finally:
        stack.close()
