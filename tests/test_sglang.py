"""A real SGLang (CPU, in its own venv) under hotweights: the loader plugin, its fallback, and a failover group.

SGLang's Python comes from ``HOTWEIGHTS_TEST_SGLANG_PYTHON`` (``.ci/run`` builds that venv and sets it,
with ``HOTWEIGHTS_REQUIRE_SGLANG=1`` so that a missing SGLang fails CI instead of skipping). Where no
NVIDIA driver is installed, the servers run with the stand-in ``libcuda.so.1``
(``hotweights.standby.sglang_nodriver``). One pair of servers serves the loader tests: one maps the
daemon's arena, the other was pointed at a socket no daemon serves and fell back to SGLang's own loading.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from hotweights.cache.makemodel import PRESETS, write_checkpoint
from hotweights.chaos.faults import descendant_titled
from hotweights.contract import Endpoint
from hotweights.engines import KINDS, Engine
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command
from hotweights.standby import sglang_nodriver
from hotweights.standby.agentprogress import RelayWatch, metric_total
from tests.cachehelpers import ENV, engine_python, wait_until
from tests.controllerhelpers import ControllerStack
from tests.test_vllm import (
    LONG,
    PROMPT,
    STREAMS,
    Load,
    engine_core_stopped_under_load,
    engine_killed_under_load,
    ready_spare,
    reply_text,
)

pytestmark = pytest.mark.sglang
# --skip-server-warmup: SGLang's warm-up request takes 4 of a start's 28 s on CPU; the agent's readiness check
# generates a token anyway.
SERVER_ARGS = [
    "--device",
    "cpu",
    "--max-total-tokens",
    "8192",
    "--enable-metrics",
    "--sleep-on-idle",
    "--skip-server-warmup",
]
PROMPTS = ("The weather", "Once upon a time", "hello")
STEPS_SEEN = 6  # readings of the step counter (every 250 ms) that moved, longer than the stall bound (1 s at least)
START_S = 600  # two shared cores: SGLang's start-up takes 20-60 s, more with other servers starting


@pytest.fixture(scope="module")
def sglang_python() -> str:
    return engine_python("SGLang", "sglang")


@pytest.fixture(scope="module")
def sglang_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """SGLang's CPU engine on, the stand-in driver library first where no driver is installed."""
    return sglang_nodriver.environment(tmp_path_factory.mktemp("nodriver"), {"HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """float32: SGLang's bf16 CPU kernels round a prefill and decode steps differently, so a continuation of
    bf16 weights' greedy text, whose generated tokens are prefilled, can take another token at a near tie."""
    out = tmp_path_factory.mktemp("sglang") / "tiny"
    return write_checkpoint(out, PRESETS["tiny"], dtype=torch.float32, seed=0, progress=False)


class Server:
    """One SGLang server in a process group of its own (it forks a scheduler and a detokenizer)."""

    def __init__(self, python: str, model: Path, env: dict[str, str], log: Path, *extra: str) -> None:
        self.port, self.log = free_port(), log
        command = [python, "-m", KINDS[Engine.SGLANG].server_module, "--model-path", str(model), "--host", "127.0.0.1"]
        command += ["--port", str(self.port), *SERVER_ARGS, *extra]
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command, env={**ENV, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        assert self.process.poll() is None, self.log.read_text(errors="replace")[-3000:]
        try:
            return httpx.get(self.url + "/health_generate", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def greedy_ids(self, prompt: str) -> list[int]:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
        reply = httpx.post(self.url + "/generate", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["output_ids"]

    def terminate(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(60)
        with contextlib.suppress(ProcessLookupError):  # the scheduler and detokenizer, should they outlive it
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def stop_all(servers: list[Server]) -> None:
    """Stop the servers together: each takes seconds to shut down."""
    for server in servers:
        server.terminate()
    for server in servers:
        server.stop()


@pytest.fixture(scope="class")
def pair(
    sglang_python: str, sglang_env: dict[str, str], model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server, Path, Path]]:
    """(mapped, fallback, mapped's report, fallback's report): both servers started at once."""
    root = tmp_path_factory.mktemp("pair")
    socket_path = root / "run" / "s.sock"
    command = hotweights_command("cache", "serve", "--format", "sglang", "--model", str(model), python=sglang_python)
    daemon = subprocess.Popen(
        [*command, "--socket", str(socket_path)], env={**ENV, **sglang_env}, stderr=subprocess.PIPE, text=True
    )
    servers: list[Server] = []
    try:
        wait_until(lambda: socket_path.with_suffix(".ready").exists() or daemon.poll() is not None, START_S, "daemon")
        assert daemon.poll() is None, daemon.stderr.read()
        reports = root / "mapped.json", root / "fallback.json"
        for name, socket, report in (("mapped", socket_path, reports[0]), ("fallback", root / "none.sock", reports[1])):
            extra = json.dumps({"socket": str(socket), "report": str(report)})
            load = ["--load-format", "hotweights", "--model-loader-extra-config", extra]
            servers.append(Server(sglang_python, model, sglang_env, root / f"{name}.log", *load))
        for server in servers:
            wait_until(server.ready, START_S, f"SGLang on {server.log.name}", interval=0.5)
        yield servers[0], servers[1], *reports
    finally:
        stop_all(servers)
        daemon.terminate()
        daemon.wait(60)


class TestLoader:
    def test_sglang_on_the_arena_generates_what_its_own_loading_does(self, pair: tuple) -> None:
        mapped, fallback, report, _ = pair
        for prompt in PROMPTS:
            ids = mapped.greedy_ids(prompt)
            assert len(ids) == 24
            assert ids == fallback.greedy_ids(prompt), prompt
        sharing = json.loads(report.read_text())
        assert "model.layers.0.self_attn.qkv_proj.weight" in sharing["shared"]
        assert "model.layers.0.mlp.gate_up_proj.weight" in sharing["shared"]
        assert "model.embed_tokens.weight" in sharing["shared"]
        assert all(name.endswith("cos_sin_cache") for name in sharing["copied"]), sharing["copied"]
        assert sharing["shared_bytes"] > 4 * sharing["copied_bytes"]
        log = mapped.log.read_text(errors="replace")
        assert "hotweights: mapped 16 tensors from" in log
        assert "falling back" not in log

    def test_without_a_daemon_the_loader_says_so_in_one_line_and_sglang_loads_itself(self, pair: tuple) -> None:
        _, fallback, _, report = pair
        lines = [line for line in fallback.log.read_text(errors="replace").splitlines() if "hotweights:" in line]
        assert len(lines) == 1, lines
        assert "hotweights: falling back to SGLang's own loading: daemon on " in lines[0]
        assert "none.sock" in lines[0]
        assert "fallback" in json.loads(report.read_text())
        assert httpx.get(fallback.url + "/v1/models", timeout=30).json()["data"]

    def test_a_stopped_scheduler_is_a_stall_with_only_a_request_not_streamed_pending(self, pair: tuple) -> None:
        """The agent's progress check (``RelayWatch``, reading SGLang's step counter as the agent does) on the mapped
        server: a streamed completion times a first token, then, with only a completion that is not streamed pending,
        SGLang's scheduler SIGSTOPped while its HTTP server answers: the stall is reported with that one pending."""
        mapped = pair[0]
        scheduler = descendant_titled(mapped.process.pid, KINDS[Engine.SGLANG].core_title)
        assert scheduler is not None, f"no {KINDS[Engine.SGLANG].core_title} under {mapped.process.pid}"
        try:
            reason = asyncio.run(stall_with_one_request_not_streamed(mapped.url, scheduler))
        finally:
            os.kill(scheduler, signal.SIGCONT)
        print(f"\nthe reason: {reason}")
        assert re.fullmatch(
            r"the engine has made no progress for .* with 1 request\(s\) pending, in a first .*", reason
        )


async def until(predicate: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``predicate`` on the event loop until it holds, for ``timeout_s`` at most."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        await asyncio.sleep(0.05)


async def stall_with_one_request_not_streamed(url: str, scheduler: int) -> str | None:
    """The test above's run: the stall reason once ``scheduler`` stopped mid-way through a completion not streamed."""
    watch, metric, tasks = RelayWatch(), KINDS[Engine.SGLANG].step_metric, []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def read() -> float | None:
            return metric_total((await client.get(Endpoint.METRICS)).text, metric)

        try:
            tasks.append(asyncio.create_task(watch.watch(read)))
            streamed = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}
            relayed = watch.sent(streamed)
            async with client.stream("POST", "/v1/completions", json=streamed) as reply:
                async for _ in watch.relay(relayed, reply.aiter_raw(), streams=True):
                    pass
            whole = {"prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
            watch.sent(whole)
            tasks.append(asyncio.create_task(client.post("/v1/completions", json=whole)))
            await until(lambda: watch.counter is not None, "reading of the step counter")
            counted = [watch.counter]

            def moving() -> bool:  # the counter moved at STEPS_SEEN readings, no stall reported meanwhile
                assert watch.refusal is None, watch.refusal
                if watch.counter != counted[-1]:
                    counted.append(watch.counter)
                return len(counted) > STEPS_SEEN

            await until(moving, f"{STEPS_SEEN} readings of steps while the completion runs")
            os.kill(scheduler, signal.SIGSTOP)
            await until(lambda: watch.refusal, "stall reported")
            return watch.refusal
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def test_with_fallback_refuse_a_missing_daemon_stops_the_load(
    sglang_python: str, sglang_env: dict[str, str], model: Path, tmp_path: Path
) -> None:
    """SGLang's own LoadConfig and get_model_loader, as its model runner calls them, with the plugin loaded."""
    script = (
        "import sys\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.configs.device_config import DeviceConfig\n"
        "from sglang.srt.configs.load_config import LoadConfig\n"
        "from sglang.srt.configs.model_config import ModelConfig\n"
        "from sglang.srt.model_loader.loader import get_model_loader\n"
        "extra = {'socket': sys.argv[2], 'fallback': 'refuse'}\n"
        "loader = get_model_loader(LoadConfig(load_format='hotweights', model_loader_extra_config=extra))\n"
        "loader.load_model(model_config=ModelConfig(model_path=sys.argv[1]), device_config=DeviceConfig('cpu'))\n"
    )
    missing = tmp_path / "none.sock"
    result = subprocess.run(
        [sglang_python, "-c", script, str(model), str(missing)],
        env={**ENV, **sglang_env, "SGLANG_PLUGINS": "hotweights"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert f"ConfigError: hotweights: the daemon on {missing} gave no weights" in result.stderr


def engine_stopped_under_load(stack: ControllerStack, gateway: str) -> None:
    """SIGSTOP the primary's engine server under load through ``gateway``: the controller judges it hung, fences
    it and promotes a standby, with no client error."""
    old = stack.primary()
    load = Load(f"{gateway}/completions")
    engine_pid = httpx.get(old["url"] + Endpoint.PRIMARY).json()["engine"]["pid"]
    try:
        wait_until(lambda: load.ok >= 5, 120, "load flowing")
        os.kill(engine_pid, signal.SIGSTOP)
        wait_until(lambda: stack.primary()["id"] != old["id"], 60, "a standby promoted over the hung primary")
        served = load.ok
        wait_until(lambda: load.ok >= served + 5, 120, "load served by the new primary")
    finally:
        load.finish()
        with contextlib.suppress(ProcessLookupError):  # fenced by now; never leave a stopped process behind
            os.kill(engine_pid, signal.SIGCONT)
    assert load.errors == []


def completion(gateway: str) -> tuple[str, str]:
    """(the served model's name, its greedy completion of ``PROMPT``) through ``gateway``."""
    reply = httpx.post(
        f"{gateway}/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["model"], reply_text(reply.json())


@contextlib.contextmanager
def sglang_group(sglang_python: str, sglang_env: dict[str, str], model: Path) -> Iterator[tuple[ControllerStack, str]]:
    """A 2-engine SGLang group (and its spare) up and steady behind the gateway: (its stack, the gateway's /v1
    URL)."""
    group = (
        f'engine = "sglang"\nengine_python = "{sglang_python}"\nengine_args = {json.dumps(SERVER_ARGS)}\n'
        f"engine_env = {{ {', '.join(f'{k} = {json.dumps(v)}' for k, v in sglang_env.items())} }}\n"
    )
    # Three SGLang servers share two cores here: a promotion under load has taken longer than the default hold.
    stack = ControllerStack(
        model, engines=2, group_extra=group, failure_threshold=3, gateway_extra="hold_timeout_s = 60"
    )
    try:
        stack.start_controller("up")
        stack.wait_up(900, "an SGLang primary and standby")
        stack.wait_steady(900)
        yield stack, f"http://127.0.0.1:{stack.config.gateway.port}/v1"
    finally:
        stack.close()


@pytest.fixture(scope="module")
def group(sglang_python: str, sglang_env: dict[str, str], model: Path) -> Iterator[tuple[ControllerStack, str]]:
    """``sglang_group``, shared by the tests that fail its primaries over."""
    with sglang_group(sglang_python, sglang_env, model) as up:
        yield up


@pytest.mark.timeout(600)  # the group's start and its spare's: server starts on shared cores
def test_an_sglang_primary_whose_scheduler_stops_is_failed_over_within_its_bound(group: tuple) -> None:
    """SGLang's scheduler process SIGSTOPped while its HTTP server answers (a gray failure): the agent's progress
    check reports it, the controller fails over, a stream cut there continues on a standby. It runs first, once the
    spare is ready: the fenced slot starts as the spare, so the next test waits only for the spare's refill."""
    stack, gateway = group
    standby = lambda: any(m["role"] == "standby" and m["status"] == "healthy" for m in stack.members().values())  # noqa: E731
    wait_until(standby, 900, "a standby back")
    wait_until(lambda: ready_spare(stack), 900, "the group's spare ready", interval=0.5)  # its start would slow this
    uncut = reply_text(httpx.post(f"{gateway}/completions", json={"prompt": PROMPT, **LONG}, timeout=60).json())
    engine_core_stopped_under_load(stack, gateway, Engine.SGLANG, uncut)


@pytest.mark.timeout(600)  # the spare's refill after the test before: a server start on shared cores
def test_an_sglang_group_fails_over_twice_under_load_with_no_client_errors(group: tuple) -> None:
    """Two SGLang engines and a spare behind the gateway: the primary's server SIGKILLed under load once the spare
    is ready (cut streams continued on the next primary, the killed slot back from the spare in seconds), then the
    new primary's SIGSTOPped: the slot the spare took serves, no client error."""
    stack, gateway = group
    stack.wait_steady(900)  # the slot fenced by the test before is back
    name, before = completion(gateway)
    uncut = [reply_text(httpx.post(f"{gateway}{path[3:]}", json=body, timeout=60).json()) for path, body in STREAMS]
    engine_killed_under_load(stack, gateway, uncut)  # the chat through the agent's bridge
    engine_stopped_under_load(stack, gateway)  # the spare's turn, as the killed slot's engine
    assert completion(gateway) == (name, before)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HOTWEIGHTS_TEST_SLOW") != "1", reason="minutes long: HOTWEIGHTS_TEST_SLOW=1")
@pytest.mark.timeout(900)
def test_an_sglang_group_updates_its_weights_under_load_with_no_client_errors(
    sglang_python: str, sglang_env: dict[str, str], model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A weight update of a 3-engine SGLang group to a second checkpoint under load (a second generation: its own
    daemon, every engine restarted onto it, one at a time): no client error, the new weights' answer under the
    name the clients use. Three SGLang starts, then three more one at a time: minutes on two cores, so it runs
    only with ``HOTWEIGHTS_TEST_SLOW=1``."""
    tuned = write_checkpoint(
        tmp_path_factory.mktemp("sglang") / "tuned", PRESETS["tiny"], dtype=torch.float32, seed=1, progress=False
    )
    with sglang_group(sglang_python, sglang_env, model) as (stack, gateway):
        name, before = completion(gateway)
        load = Load(f"{gateway}/completions")
        try:
            update = stack.client.post(Endpoint.ROLLOUT, json={"model": str(tuned)}, timeout=900)
        finally:
            load.finish()
        assert update.status_code == 200, update.text
        assert load.errors == [] and load.ok > 0
        assert all(m["generation"] == 1 for m in stack.wait_steady(900).values())
        assert stack.daemon()["id"] == "g0-cache-gen1"
        served, after = completion(gateway)
        assert served == name and after != before  # the new weights, under the name the clients use
