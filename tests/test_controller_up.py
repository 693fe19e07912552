"""``hotweights up`` runs the whole stack (gateway included) in the foreground; ``hotweights down`` stops it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
from hotweights.controller.supervisor import read_identity

from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV
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
