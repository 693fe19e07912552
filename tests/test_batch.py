"""Co-located batch engines (``[[groups]] batch_port``) on a real stack: serving beside the group, yielding before
the group starts an engine, back once it is settled, 503 with ``Retry-After`` meanwhile, restarted onto the group's
new weights after a model update; refusals of bad configs."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from hotweights.chaos.clusterview import event_time
from hotweights.chaos.load import BatchClient
from hotweights.contract import Endpoint
from hotweights.controller.config import load_config
from hotweights.controller.supervisor import read_identity
from hotweights.errors import ConfigError
from hotweights.ports import free_port
from tests.conftest import make_checkpoint
from tests.controllerhelpers import ControllerStack, completion_text, running_on_a_thread, wait_until

BAD_BATCH = [
    ("batch_port = 8200", "groups[0].batch_port 8200 collides with engine g0-e0 port (groups[0].base_port)"),
    ("batch_port = 70000", "groups[0].batch_port must be 1..65535 (0: no batch engine), found 70000"),
    ("batch_port = 8300\nbatch_yield_timeout_s = 0", "groups[0].batch_yield_timeout_s must be > 0, found 0.0"),
    ("batch_port = 8300\ntp_size = 2", "groups[0].batch_port: a batch engine needs tp_size = 1, found tp_size = 2"),
    (
        f'batch_port = 8300\nengine = "vllm"\nengine_python = "{sys.executable}"',
        "groups[0].batch_port: a batch engine needs engine = \"reference\", found engine = 'vllm'",
    ),
]


@pytest.mark.parametrize(("keys", "message"), BAD_BATCH)
def test_a_bad_batch_engine_is_refused_naming_the_key(tmp_path: Path, keys: str, message: str) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(f"[[groups]]\nbase_port = 8200\n{keys}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value) == f"{path}: {message}"


def test_a_batch_engine_needs_one_host(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('[[groups]]\nbatch_port = 8300\n\n[dcs]\netcd = ["http://127.0.0.1:2379"]\n')
    with pytest.raises(ConfigError, match=r"batch_port: a batch engine needs one host \(no \[dcs\] etcd\)"):
        load_config(path)


def test_a_batch_engine_yields_for_a_replacement_standby_and_follows_a_model_update(
    tiny_model: Path, tmp_path: Path
) -> None:
    """It yields before the replacement of a killed primary starts and is back, the same process, once the group
    settled; a model update restarts it onto the new generation's weights; a new controller adopts it."""
    batch_port = free_port()
    # direct_io: the daemon reads the checkpoint with O_DIRECT (the text below is the same as without)
    stack = ControllerStack(tiny_model, engines=2, group_extra=f"batch_port = {batch_port}\ndirect_io = true\n")
    batch_url = f"http://127.0.0.1:{batch_port}"
    try:
        stack.start_controller("up")
        stack.wait_steady()
        batch = wait_until(lambda: next((b for b in stack.cluster()["batch"] if b["serving"]), None), 90, "batch")
        assert (batch["id"], batch["url"], batch["yields"]) == ("g0-batch", batch_url, 0)
        assert batch["kv_cache_bytes"] > 0
        gateway = f"http://127.0.0.1:{stack.config.gateway.port}"
        assert completion_text(batch_url) == completion_text(gateway)  # the group's arena: the same greedy text
        assert batch_url not in [m["url"] for m in stack.members().values()]  # none of the group's members

        with running_on_a_thread(BatchClient(batch_url, timeout_s=20.0), 30) as client:
            wait_until(lambda: any(a.status == 200 for a in client.answers), 30, "a batch answer")
            primary = stack.primary()
            os.kill(primary["pid"], signal.SIGKILL)
            returned = wait_until(lambda: stack.events("batch_return")[1:], 120, "the batch engine's return")[0]
            spares = wait_until(lambda: stack.cluster()["spares"], 30, "the new primary's spare listed")
            assert [s["ready"] for s in spares] == [True]  # warmed up before the batch engine came back

        (yielded,) = stack.events("batch_yield")
        assert f"starting {primary['id']}" in yielded["message"]  # for the replacement standby of the fenced slot
        (failover,) = stack.events("failover")
        assert event_time(failover) <= event_time(yielded) <= event_time(returned)
        assert returned["back_ms"] is not None and returned["back_ms"] > 0
        print(f"batch engine: yielded in {yielded['yield_ms']} ms, back {returned['back_ms']} ms after settling")
        for answer in client.answers:
            assert answer.status == 200 or (answer.status == 503 and answer.retry_after == "1"), answer
        away = [a.status for a in client.answers if a.sent > event_time(yielded) and a.answered < event_time(returned)]
        assert away and set(away) == {503}, away  # while it was away: refused at once, never held
        after = stack.cluster()["batch"][0]
        assert (after["pid"], after["serving"], after["yields"]) == (batch["pid"], True, 1)  # the same process
        old_text = completion_text(gateway)
        assert completion_text(batch_url) == old_text

        batch = updated(stack, make_checkpoint(tmp_path / "tiny-seed1", seed=1), batch["pid"])
        assert completion_text(batch_url) == completion_text(gateway) != old_text  # the new weights' answer

        stack.kill_controller()  # a new controller adopts it, and `down` stops it
        stack.start_controller("up")
        stack.wait_steady()
        adopted = wait_until(lambda: next((b for b in stack.cluster()["batch"] if b["serving"]), None), 60, "adopted")
        assert adopted["pid"] == batch["pid"]
        down = stack.down()
        assert down.returncode == 0, down.stderr
        wait_until(lambda: read_identity(batch["pid"]) is None, 30, "the batch engine's exit")
    finally:
        stack.close()


def updated(stack: ControllerStack, model: Path, old_pid: int) -> dict:
    """A model update of the stack's group to ``model`` (its next weight generation) through ``POST /rollout``; the
    group's batch engine once it serves that generation: restarted onto it, a process other than ``old_pid``."""
    response = stack.client.post(Endpoint.ROLLOUT, json={"model": str(model)}, timeout=300)
    assert response.status_code == 200, response.text
    assert {m["generation"] for m in stack.wait_steady().values()} == {1}

    def restarted() -> dict | None:
        return next((b for b in stack.cluster()["batch"] if b["serving"] and b["generation"] == 1), None)

    batch = wait_until(restarted, 120, "the batch engine serving the new generation")
    assert batch["pid"] != old_pid and stack.events("batch_restart"), batch
    return batch
