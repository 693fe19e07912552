"""Co-located batch engines (``[[groups]] batch_port``) on a real stack: serving beside the group, yielding before
the group starts an engine, back once it is settled, 503 with ``Retry-After`` meanwhile; refusals of bad configs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from hotweights.chaos.load import completion_body
from hotweights.contract import Endpoint
from hotweights.controller.config import load_config
from hotweights.errors import ConfigError
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV
from tests.controllerhelpers import ControllerStack, wait_until

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


@dataclass
class BatchClient:
    """One client of the batch engine, a request at a time, each bounded by ``timeout_s``: (sent, answered,
    status, Retry-After) per request, or (sent, answered, error, None) for one that got no answer."""

    url: str
    timeout_s: float = 20.0
    results: list[tuple[float, float, int | str, str | None]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self.stop.is_set():
                sent = time.time()
                try:
                    response = client.post(self.url + Endpoint.COMPLETIONS, json=completion_body())
                    outcome: tuple[int | str, str | None] = (response.status_code, response.headers.get("retry-after"))
                except httpx.HTTPError as exc:
                    outcome = (f"{type(exc).__name__}: {exc}", None)
                self.results.append((sent, time.time(), *outcome))
                if outcome[0] != 200:
                    self.stop.wait(0.02)  # pacing: a refusal comes back at once


def _at(event: dict) -> float:
    return datetime.fromisoformat(event["time"]).timestamp()


def _text(url: str) -> str:
    response = httpx.post(url + Endpoint.COMPLETIONS, json=completion_body(), timeout=30)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


def test_a_batch_engine_yields_for_a_replacement_standby_and_is_back_once_the_group_settled(tiny_model: Path) -> None:
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
        assert _text(batch_url) == _text(gateway)  # the group's arena: the same weights, the same greedy text
        assert batch_url not in [m["url"] for m in stack.members().values()]  # none of the group's members

        client = BatchClient(batch_url)
        thread = threading.Thread(target=client.run, daemon=True)
        thread.start()
        wait_until(lambda: any(status == 200 for *_, status, _ in client.results), 30, "a batch answer")
        primary = stack.primary()
        os.kill(primary["pid"], signal.SIGKILL)
        returned = wait_until(lambda: stack.events("batch_return")[1:], 120, "the batch engine's return")[0]
        client.stop.set()
        thread.join(timeout=30)

        (yielded,) = stack.events("batch_yield")
        assert f"starting {primary['id']}" in yielded["message"]  # for the replacement standby of the fenced slot
        (failover,) = stack.events("failover")
        assert _at(failover) <= _at(yielded) <= _at(returned)
        assert returned["back_ms"] is not None and returned["back_ms"] > 0
        print(f"batch engine: yielded in {yielded['yield_ms']} ms, back {returned['back_ms']} ms after settling")
        for *_, status, retry_after in client.results:
            assert status == 200 or (status == 503 and retry_after == "1"), (status, retry_after)
        away = [
            status for sent, answered, status, _ in client.results if sent > _at(yielded) and answered < _at(returned)
        ]
        assert away and set(away) == {503}, away  # while it was away: refused at once, never held
        after = stack.cluster()["batch"][0]
        assert (after["pid"], after["serving"], after["yields"]) == (batch["pid"], True, 1)  # the same process
        assert _text(batch_url) == _text(gateway)

        stack.kill_controller()  # a new controller adopts it, and `down` stops it
        stack.start_controller("up")
        stack.wait_steady()
        adopted = wait_until(lambda: next((b for b in stack.cluster()["batch"] if b["serving"]), None), 60, "adopted")
        assert adopted["pid"] == batch["pid"]
        down = subprocess.run(
            hotweights_command("down", "--config", str(stack.config_path)), env=ENV, capture_output=True, text=True
        )
        assert down.returncode == 0, down.stderr
        wait_until(lambda: _gone(batch["pid"]), 30, "the batch engine's exit")
    finally:
        stack.close()
