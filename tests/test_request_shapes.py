"""Every request shape is bounded by what it costs: large bodies and many prompts never stall an engine's health
checks, a list of prompts is admitted as its prompts, and the gateway refuses what an engine refuses, the same way.

Unit tests: the request schema's refusals by field, the gateway's checks against the engine's, slots taken several
at a time, admission counting prompts, the scheduler's waves of sequences without idle waits. Process tests: a
primary engine behind the gateway, each large shape sent through the gateway (a 2 MB chat and completion, 1M token
ids, 2,000 prompts) while the engine's ``/primary`` is checked every 20 ms and an ordinary client is served; and
``bench/request_shapes.py`` at a small scale, through ``hotweights up``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

from hotweights.admission import Admission, Held, Refusal, Slots
from hotweights.cache.loadspec import LoadSpec
from hotweights.contract import Endpoint
from hotweights.controller.config import HealthSection
from hotweights.gateway.migration import Migratable, plan
from hotweights.requestschema import (
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChatRequest,
    CompletionRequest,
    Invalid,
    validated,
)
from hotweights.standby.intake import bytes_per_token
from tests.cachehelpers import bench_result
from tests.enginehelpers import EngineProcess
from tests.gatewayhelpers import FLAGS, GatewayProcess, write_cluster

BENCH = Path(__file__).resolve().parent.parent / "bench" / "request_shapes.py"
MB = 1 << 20
HEALTH_TIMEOUT_S = HealthSection().timeout_ms / 1000  # a check slower than this counts as failed
PROBE_S = 0.02
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hi", "max_tokens": 4}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("schema", "body", "param"),
    [
        (CompletionRequest, COMPLETION, None),
        (CompletionRequest, COMPLETION | {"max_tokens": "5"}, "max_tokens"),
        (CompletionRequest, COMPLETION | {"max_tokens": 5.0}, "max_tokens"),
        (CompletionRequest, COMPLETION | {"max_tokens": True}, "max_tokens"),
        (CompletionRequest, COMPLETION | {"temperature": 1}, None),  # JSON writes 1.0 as 1
        (CompletionRequest, COMPLETION | {"temperature": "1"}, "temperature"),
        (CompletionRequest, COMPLETION | {"stream": 1}, "stream"),
        (CompletionRequest, COMPLETION | {"stop": ["a"] * MAX_STOP_STRINGS}, None),
        (CompletionRequest, COMPLETION | {"stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        (CompletionRequest, COMPLETION | {"stop": "a" * MAX_STOP_CHARS}, None),
        (CompletionRequest, COMPLETION | {"stop": "a" * (MAX_STOP_CHARS + 1)}, "stop"),
        (CompletionRequest, COMPLETION | {"stop": 5}, "stop"),
        (CompletionRequest, COMPLETION | {"prompt": [[1, 2], [3]]}, None),
        (CompletionRequest, COMPLETION | {"prompt": [[1, 2], []]}, "prompt"),
        (CompletionRequest, COMPLETION | {"prompt": [1, -2]}, "prompt"),
        (CompletionRequest, COMPLETION | {"prompt": [1, 2.0]}, "prompt"),
        (CompletionRequest, COMPLETION | {"prompt": ["a", 1]}, "prompt"),
        (CompletionRequest, COMPLETION | {"prompt": [["a"]]}, "prompt"),
        (CompletionRequest, COMPLETION | {"prompt": {"a": 1}}, "prompt"),
        (CompletionRequest, COMPLETION | {"n": 2}, "n"),
        (CompletionRequest, [COMPLETION], "body"),
        (ChatRequest, CHAT, None),
        (ChatRequest, CHAT | {"messages": CHAT["messages"] * (MAX_MESSAGES + 1)}, "messages"),
        (ChatRequest, CHAT | {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ],
)
def test_the_request_schema_names_the_field_it_refuses(schema: type, body: object, param: str | None) -> None:
    checked = validated(schema, body)
    assert (checked.param if isinstance(checked, Invalid) else None) == param, checked


@pytest.mark.unit
@pytest.mark.parametrize(("prompts", "limit", "refused"), [(4, 4, False), (5, 4, True), (2000, 4, True)])
def test_an_engine_refuses_more_prompts_than_it_generates_at_once(prompts: int, limit: int, refused: bool) -> None:
    checked = validated(CompletionRequest, {"prompt": [[1]] * prompts}, max_prompts=limit)
    if refused:
        assert isinstance(checked, Invalid) and checked.param == "prompt", checked
        assert f"{prompts} prompts" in checked.message and f"at most {limit}" in checked.message
    else:
        assert isinstance(checked, CompletionRequest) and checked.prompt_count == prompts


@pytest.mark.unit
def test_a_prompt_longer_than_the_kv_slot_is_refused_before_its_ids_are_read() -> None:
    checked = validated(CompletionRequest, {"prompt": [[1] * 10 + ["not an id"]]}, kv_slot=5)
    assert isinstance(checked, Invalid) and "10 token ids" not in checked.message and "11 token ids" in checked.message


def byte_level(*steps: pre_tokenizers.PreTokenizer, normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    """A BPE tokenizer whose longest entry is 4 bytes, with ``steps`` before it (ByteLevel alone by default)."""
    tokenizer = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "abab": 3}, merges=[("a", "b"), ("ab", "ab")]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(list(steps)) if steps else pre_tokenizers.ByteLevel()
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    return tokenizer


@pytest.mark.unit
@pytest.mark.parametrize(
    ("tokenizer", "expected"),
    [
        (byte_level(), 4),
        (byte_level(pre_tokenizers.Split(Regex(" "), "isolated"), pre_tokenizers.ByteLevel(use_regex=False)), 4),
        (byte_level(pre_tokenizers.Split(Regex(" "), "removed"), pre_tokenizers.ByteLevel(use_regex=False)), None),
        (byte_level(pre_tokenizers.Whitespace()), None),  # drops the spaces
        (byte_level(normalizer=normalizers.NFKC()), None),  # may shorten the text
        (Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]")), None),  # one [UNK], a long word
    ],
)
def test_a_text_is_bounded_by_its_tokenizer_only_where_no_byte_is_dropped(
    tokenizer: Tokenizer, expected: int | None
) -> None:
    assert bytes_per_token(tokenizer) == expected
    tokenizer.add_special_tokens(["<|special|>"])  # matched in the text as it is: 11 bytes, one token
    assert bytes_per_token(tokenizer) == (None if expected is None else 11)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("path", "body"),
    [
        (Endpoint.COMPLETIONS, COMPLETION | {"stop": ["a"] * (MAX_STOP_STRINGS + 1)}),
        (Endpoint.COMPLETIONS, COMPLETION | {"max_tokens": "5"}),
        (Endpoint.COMPLETIONS, COMPLETION | {"stream": "yes"}),
        (Endpoint.COMPLETIONS, COMPLETION | {"stream_options": {"include_usage": "yes"}}),
        (Endpoint.COMPLETIONS, COMPLETION | {"prompt": [1, True]}),
        (Endpoint.COMPLETIONS, COMPLETION | {"temperature": 3}),
        (Endpoint.CHAT_COMPLETIONS, CHAT | {"stop": "a" * (MAX_STOP_CHARS + 1)}),
        (Endpoint.CHAT_COMPLETIONS, CHAT | {"max_tokens": 0}),
        (Endpoint.CHAT_COMPLETIONS, CHAT | {"seed": -1}),
    ],
)
def test_the_gateway_refuses_in_the_engines_words(path: str, body: dict) -> None:
    engine = validated(CompletionRequest if path == Endpoint.COMPLETIONS else ChatRequest, body)
    assert isinstance(engine, Invalid)
    assert plan("POST", path, body) == engine


@pytest.mark.unit
def test_the_gateway_leaves_the_fields_it_does_not_read_to_the_engine() -> None:
    """A foreign engine's fields, and a chat's messages, reach the engine as they are (it judges them)."""
    chat = CHAT | {"messages": [{"role": "tool", "content": [{"type": "text", "text": "hi"}]}], "top_k": 5}
    assert isinstance(plan("POST", Endpoint.CHAT_COMPLETIONS, chat), Migratable)


@pytest.mark.unit
def test_slots_are_taken_several_at_a_time_first_come_first_served() -> None:
    async def scenario() -> list[str]:
        slots, order = Slots(4), []

        async def take(name: str, n: int) -> None:
            await slots.take(n)
            order.append(name)

        await slots.take(3)
        two = asyncio.create_task(take("two", 2))
        await asyncio.sleep(0)
        assert not slots.available(1)  # one is free, but "two" waits ahead
        one = asyncio.create_task(take("one", 1))
        gone = asyncio.create_task(take("gone", 1))
        await asyncio.sleep(0)
        gone.cancel()  # its client went away while it waited
        slots.give(3)
        await asyncio.gather(two, one, return_exceptions=True)
        assert slots.free == 1  # 4 - 2 - 1: the cancelled one holds none
        return order

    assert asyncio.run(scenario()) == ["two", "one"]


@pytest.mark.unit
def test_admission_counts_a_request_as_its_prompts() -> None:
    """Four slots and room for two waiting: three prompts are served at once; two more wait, so the next request
    finds the queue full; the three answered, the two start."""

    async def scenario() -> tuple[Refusal | Held, int, int]:
        admission = Admission(4, queue=2)
        first = await admission.enter(prompts=3)
        assert isinstance(first, Held) and first.prompts == 3
        waiter = asyncio.create_task(admission.enter(prompts=2))
        await asyncio.sleep(0)
        assert (admission.serving, admission.waiting) == (3, 2)
        refused = await admission.enter()
        admission.leave(first)
        assert isinstance(await waiter, Held)
        return refused, admission.serving, admission.waiting

    refused, serving, waiting = asyncio.run(scenario())
    assert isinstance(refused, Refusal) and "2 waiting, the most that may wait" in refused.reason, refused
    assert (serving, waiting) == (2, 0)


def test_sequences_beyond_the_slots_run_in_waves_without_idle_waits(tiny_model: Path) -> None:
    """Three waves of one-token sequences through two slots: each wave starts as the last one ends, never after
    the worker's idle sleep."""
    from hotweights.standby.decoder import Decoder  # the engine's modules import torch: on first use only
    from hotweights.standby.model import KVCache
    from hotweights.standby.scheduler import IDLE_WAIT_S, Finish, SamplingParams, Scheduler, Sequence
    from hotweights.standby.weights import load_model

    model = load_model(tiny_model, LoadSpec()).model
    decoder = Decoder(model, KVCache.allocate(model.config, model.tp, 2, 64, model.device, model.dtype))
    decoder.warm_up()
    scheduler = Scheduler()
    scheduler.attach_kv(decoder)
    done = [threading.Event() for _ in range(6)]
    for event in done:
        scheduler.submit(Sequence([1, 2, 3], SamplingParams(1), lambda e, ev=event: isinstance(e, Finish) and ev.set()))
    started = time.monotonic()
    scheduler.start()
    try:
        assert all(event.wait(60) for event in done)
        assert time.monotonic() - started < IDLE_WAIT_S
    finally:
        scheduler.stop(10)


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, GatewayProcess]]:
    """A primary engine (a KV slot of 512 tokens, 4 sequences at once) behind the gateway."""
    with EngineProcess(tiny_model, *FLAGS) as engine:
        config = write_cluster(tmp_path_factory.mktemp("shapes") / "cluster.toml", [engine.port])
        with GatewayProcess(config) as gateway:
            gateway.wait_health(lambda h: len(h["primaries"]) == 1, what="the primary")
            yield engine, gateway


@pytest.mark.parametrize(
    "body",
    [
        COMPLETION | {"stop": ["a"] * (MAX_STOP_STRINGS + 1)},
        COMPLETION | {"max_tokens": "5"},
        COMPLETION | {"stream": "yes", "stream_options": {"include_usage": True}},
        COMPLETION | {"prompt": [[1], []]},
        COMPLETION | {"prompt": [[1]] * 5},  # the engine's --max-batch is 4
        COMPLETION | {"prompt": [1] * 600},  # beyond the KV slot: the engine's refusal, relayed
        CHAT | {"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)},
    ],
)
def test_the_gateway_and_the_engine_answer_a_bad_request_alike(
    stack: tuple[EngineProcess, GatewayProcess], body: dict
) -> None:
    engine, gateway = stack
    path = Endpoint.CHAT_COMPLETIONS if "messages" in body else Endpoint.COMPLETIONS
    direct, through = engine.client.post(path, json=body), gateway.client.post(path, json=body)
    assert direct.status_code == through.status_code == 400, (direct.text, through.text)
    assert direct.json() == through.json()


class Probe:
    """``/primary`` of an engine checked every PROBE_S in a thread of its own, each check's seconds kept (a check
    that fails, or takes longer than the controller waits, is kept as infinite)."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.seconds: list[float] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=HEALTH_TIMEOUT_S) as client:
            while not self.stop.wait(PROBE_S):
                started = time.perf_counter()
                try:
                    ok = client.get(self.url + Endpoint.PRIMARY).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.seconds.append(time.perf_counter() - started if ok else float("inf"))

    def __enter__(self) -> Probe:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


SHAPES = {
    "chat 2 MB": (Endpoint.CHAT_COMPLETIONS, {"messages": [{"role": "system", "content": "word " * (2 * MB // 5)}]}),
    "completion 2 MB": (Endpoint.COMPLETIONS, {"prompt": "word " * (2 * MB // 5)}),
    "1M token ids": (Endpoint.COMPLETIONS, {"prompt": [1 + i % 9 for i in range(1_000_000)]}),
    "2,000 prompts": (Endpoint.COMPLETIONS, {"prompt": ["word"] * 2000}),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_large_request_through_the_gateway_never_stalls_health_checks(
    stack: tuple[EngineProcess, GatewayProcess], shape: str
) -> None:
    """Refused (beyond the engine's KV slot, or its batch), while every health check answers within the controller's
    timeout and an ordinary request sent meanwhile is served."""
    engine, gateway = stack
    path, body = SHAPES[shape]
    content = json.dumps(body | {"max_tokens": 1}).encode()
    with Probe(engine.url) as probe, httpx.Client(base_url=gateway.url, timeout=120) as other:
        while len(probe.seconds) < 5:  # the probe is under way
            time.sleep(PROBE_S)
        served: list[httpx.Response] = []
        ordinary = threading.Thread(target=lambda: served.append(other.post(Endpoint.COMPLETIONS, json=COMPLETION)))
        ordinary.start()
        response = gateway.client.post(path, content=content, headers={"content-type": "application/json"})
        ordinary.join(60)
    refused = response.json()["error"]
    assert response.status_code == 400, response.text
    assert refused["param"] in ("max_tokens", "prompt") or "a body may" in refused["message"], response.text
    assert served and served[0].status_code == 200, served
    assert max(probe.seconds) < HEALTH_TIMEOUT_S, f"{shape}: slowest check {max(probe.seconds) * 1000:.0f} ms"


@pytest.mark.timeout(600)
def test_the_request_shapes_bench_runs_through_hotweights_up() -> None:
    command = [sys.executable, str(BENCH), "--scale", "0.05", "--requests", "1", "--quiet-seconds", "1"]
    result = bench_result(command, timeout=540)
    assert result["failovers"] == 0 and result["fences"] == 0, result
    assert result["client_errors"] == 0, result
    shapes = result["shapes"]
    assert {s: v["answers"] for s, v in shapes.items()} == {
        "chat": {"400": 1},
        "completion": {"400": 1},
        "token_ids": {"400": 1},
        "prompts": {"400": 1},
        "batch": {"200": 1},
    }
    assert all(v["health_failed"] == 0 and v["health_checks"] > 0 for v in shapes.values()), shapes
