"""``hotweights engine --tp-size 2`` on CPU (gloo): a group of two rank processes, each attached to its own
rank's daemon, serving the same outputs as one rank, and living and dying as one."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hotweights.cli import main
from hotweights.contract import Endpoint
from hotweights.controller.supervisor import read_identity
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, ProcessDaemon, wait_until
from tests.enginehelpers import SAMPLINGS, EngineProcess, Reference, check_equal_to_reference, reference_completer

FLAGS = ("--kv-cache-tokens", "512", "--max-batch", "4", "--tp-size", "2", "--weight-cache", "client")


@pytest.fixture(scope="module")
def sockets(tiny_model: Path) -> Iterator[str]:
    """A daemon per rank (``cache serve --tp-size 2 --tp-rank r``); yields the ``--socket`` template."""
    run = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp"))  # socket paths must stay short
    try:
        with contextlib.ExitStack() as daemons:
            for rank in (0, 1):
                flags = ("--tp-size", "2", "--tp-rank", str(rank))
                daemons.enter_context(ProcessDaemon(tiny_model, run / f"r{rank}.sock", *flags))
            yield str(run / "r{rank}.sock")
    finally:
        shutil.rmtree(run, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Reference:
    return reference_completer(tiny_model)


def group(model: Path, sockets: str, *extra: str) -> EngineProcess:
    return EngineProcess(model, *FLAGS, "--socket", sockets, *extra)


def rank_pids(engine: EngineProcess) -> list[int]:
    return engine.client.get(Endpoint.LIVE).json()["rank_pids"]


def gone(pid: int) -> bool:
    return read_identity(pid) is None


def test_a_standby_group_attaches_every_rank_and_serves_one_ranks_outputs_once_promoted(
    tiny_model: Path, sockets: str, reference: Reference
) -> None:
    with group(tiny_model, sockets, "--role", "standby") as engine:
        health = engine.client.get(Endpoint.STANDBY).json()
        assert health["weight_cache"]["source"] == "cache" and health["kv_cache_bytes"] == 0
        ranks = health["rank_pids"]
        assert len(ranks) == 2 and ranks[0] == engine.process.pid
        assert engine.complete(prompt="x", max_tokens=2).status_code == 503

        os.kill(ranks[1], signal.SIGSTOP)  # a hung rank: rank 0 says so on its readiness page
        try:
            reply = wait_until(lambda: (r := engine.client.get(Endpoint.READY)).status_code == 503 and r, what="503")
            assert f"rank 1 (pid {ranks[1]}) of the tensor-parallel group is stopped" in reply.json()["reason"]
        finally:
            os.kill(ranks[1], signal.SIGCONT)
        wait_until(lambda: engine.client.get(Endpoint.READY).status_code == 200, what="ready again")

        promoted = engine.post(Endpoint.PROMOTE).json()
        assert (promoted["role"], promoted["kv_cache_bytes"] > 0) == ("primary", True)
        for sampling in SAMPLINGS:
            check_equal_to_reference(engine, reference, sampling.values[0])
        demoted = engine.post(Endpoint.DEMOTE).json()
        assert demoted["kv_cache_bytes_released"] == promoted["kv_cache_bytes"]

        engine.post(Endpoint.PROMOTE)  # the follower allocates again after its FREE
        check_equal_to_reference(engine, reference, {"temperature": 0.0})
        assert engine.stop(signal.SIGTERM) == 0
    assert gone(ranks[1]), "SIGTERM to rank 0 stops every rank"


def test_rank_0_killed_mid_step_takes_every_rank_of_the_group_with_it(tiny_model: Path, sockets: str) -> None:
    """The other way round, a rank killed under its rank 0, is tests/test_controller_tp.py's failover."""
    with group(tiny_model, sockets) as engine:
        ranks = rank_pids(engine)
        body = {"prompt": "x", "max_tokens": 400, "temperature": 0, "stream": True}
        with engine.client.stream("POST", Endpoint.COMPLETIONS, json=body) as response:
            assert next(response.iter_lines()).startswith("data: ")  # the group is mid-step when rank 0 dies
            os.kill(ranks[0], signal.SIGKILL)
            wait_until(lambda: all(map(gone, ranks)), timeout=30, what="every rank gone")


def run_refused(*args: str) -> str:
    """stderr of an engine that must refuse to start with exit code 2 (and leave no rank behind)."""
    command = hotweights_command("engine", "--port", str(free_port()), "--engine-id", "g7", *args)
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    return result.stderr


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (("--tp-size", "3"), "engine g7 rank 0: config.json num_attention_heads=4 is not divisible by --tp-size 3"),
        (("--tp-size", "2", "--device", "cuda:1"), "engine g7 rank 0: --device cuda:1 is not this rank's GPU"),
        (
            ("--tp-size", "2", "--weight-cache", "client", "--socket", "/tmp/one.sock"),
            "--socket /tmp/one.sock names one daemon, but --tp-size 2 needs one per rank",
        ),
    ],
)
def test_a_bad_group_is_one_line_before_any_rank_starts(
    tiny_model: Path, flags: tuple[str, ...], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["engine", "--model", str(tiny_model), "--port", str(free_port()), "--engine-id", "g7", *flags]) == 2
    stderr = capsys.readouterr().err
    assert len(stderr.splitlines()) == 1 and line in stderr, stderr


def test_a_rank_attached_to_another_ranks_daemon_is_refused(tiny_model: Path, sockets: str, tmp_path: Path) -> None:
    """Rank 1 given rank 0's daemon: its fingerprint differs in tp_rank; rank 1 says so, rank 0 follows."""
    run = Path(sockets).parent
    wrong = run / "w{rank}.sock"
    (run / "w0.sock").symlink_to(run / "r0.sock")
    (run / "w1.sock").symlink_to(run / "r0.sock")
    try:
        stderr = run_refused("--model", str(tiny_model), *FLAGS, "--socket", str(wrong))
    finally:
        for name in ("w0.sock", "w1.sock"):
            (run / name).unlink()
    assert "error: engine g7 rank 1: daemon on " in stderr and "tp_rank: daemon has 0, engine expects 1" in stderr
    assert "engine g7: rank 1 exited with code 2; the whole group goes down" in stderr


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_group_on_two_gpus_serves_one_ranks_outputs_with_cuda_graphs(tiny_model: Path) -> None:
    """NCCL, rank r on cuda:r, decode graphs captured on every rank (with their all-reduces)."""
    reference = reference_completer(tiny_model, "cuda:0")
    with EngineProcess(tiny_model, "--kv-cache-tokens", "256", "--tp-size", "2", "--device", "cuda") as engine:
        health = engine.client.get(Endpoint.READY).json()
        assert len(health["rank_pids"]) == 2 and health["cuda_graph_bytes"] > 0
        check_equal_to_reference(engine, reference, {"temperature": 0.0})
        assert engine.stop(signal.SIGTERM) == 0
    assert gone(health["rank_pids"][1])
