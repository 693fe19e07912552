"""A tensor-parallel group under ``hotweights up`` (CPU, gloo, ``tp_size = 2``): a daemon per rank, a primary
engine group and a standby engine group sharing the per-rank arenas, behind the gateway under load."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from hotweights.contract import Endpoint
from hotweights.controller.config import load_config
from hotweights.controller.stack import Layout
from hotweights.controller.supervisor import read_identity
from hotweights.errors import ConfigError
from tests.controllerhelpers import ControllerStack, gateway_load, split_brain_watch, wait_until

RPS = 10.0


def rank_pids(url: str) -> list[int]:
    return httpx.get(url + Endpoint.LIVE, timeout=5).json()["rank_pids"]


def test_a_group_of_two_ranks_runs_a_daemon_per_rank_and_engines_that_name_each(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The command lines the controller would start (nothing is started here); a split the model does not allow
    is refused before anything starts."""
    path = tmp_path / "cluster.toml"
    path.write_text(f'[cluster]\nstate_dir = "{tmp_path}"\n[model]\npath = "{tiny_model}"\n[[groups]]\ntp_size = 2\n')
    layout = Layout.create(load_config(path), path)
    daemon = layout.daemon_command(0, 1)
    assert daemon[daemon.index("--tp-rank") + 1] == "1" and daemon[daemon.index("--socket") + 1] == str(
        tmp_path / "run" / "g0.r1.sock"
    )
    engine = layout.engine_command(layout.config.engines()[0])
    assert engine[engine.index("--tp-size") + 1] == "2"
    assert engine[engine.index("--socket") + 1] == str(tmp_path / "run" / "g0.r{rank}.sock")
    path.write_text(path.read_text().replace("tp_size = 2", "tp_size = 4"))
    with pytest.raises(ConfigError, match=r"groups\[0\].tp_size = 4: config.json num_key_value_heads=2 is not"):
        Layout.create(load_config(path), path)


def test_sigkill_of_rank_1_of_the_primary_group_fails_over_with_no_client_error(tiny_model: Path) -> None:
    # Six rank processes and two daemons on two shared cores: starts starve the primary for seconds, so 4
    # checks of 500 ms (as in the rollout test) before a primary counts as hung.
    stack = ControllerStack(tiny_model, engines=2, failure_threshold=4, group_extra="tp_size = 2\n")
    try:
        stack.start_controller("up")
        members = stack.wait_steady(timeout=180)
        daemons = {s["id"]: s for s in stack.cluster()["services"] if s["kind"] == "daemon"}
        assert sorted(daemons) == ["g0-cache", "g0-cache-r1"] and [d["rank"] for d in daemons.values()] == [0, 1]
        old = stack.primary()
        ranks = rank_pids(old["url"])
        assert len(ranks) == 2 and ranks[0] == old["pid"]

        gateway = f"http://127.0.0.1:{stack.config.gateway.port}"
        urls = [m["url"] for m in members.values()]
        with gateway_load(gateway, RPS) as load, split_brain_watch(urls) as detector:
            wait_until(lambda: len(load.records) >= 10, 60, "load through the gateway")
            os.kill(ranks[1], signal.SIGKILL)
            new = wait_until(lambda: (p := stack.primary())["id"] != old["id"] and p, 30, "a new primary group")
            replaced = wait_until(
                lambda: (m := stack.members()[old["id"]])["status"] == "healthy" and m["pid"] != old["pid"] and m,
                120,
                "a replacement standby group in the old slot",
            )
            served = len(load.records)
            wait_until(lambda: len(load.records) >= served + 10, 60, "load served by the new primary group")
        errors = [r.error for r in load.records if r.error]
        assert errors == [] and all(r.correct for r in load.records), errors[:3]
        assert detector.sweeps > 50 and detector.samples == [], f"split brain: {detector.samples}"
        assert all(read_identity(pid) is None for pid in ranks), "a rank of the failed group outlived it"
        assert replaced["role"] == "standby" and len(rank_pids(replaced["url"])) == 2
        assert rank_pids(new["url"])[0] == new["pid"]
        assert stack.events("failover")[-1]["old"] == old["id"]
    finally:
        stack.close()
