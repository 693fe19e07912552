"""``hotweights engine`` as real processes on loopback: OpenAI completions, health, roles, shutdown."""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from hotweights.cli import build_parser
from hotweights.contract import GATHER_MS_HEADER, MAX_GATHER_MS, Endpoint, Role
from hotweights.controller.config import GatewaySection
from hotweights.standby.roles import KvCapacity, Roles
from hotweights.standby.scheduler import Finish, SamplingParams, Scheduler, Sequence
from tests.cachehelpers import ProcessDaemon, wait_until
from tests.enginehelpers import (
    SAMPLINGS,
    EngineProcess,
    Reference,
    check_equal_to_reference,
    in_use,
    reference_completer,
    refusal_on_taken_port,
    streamed,
)
from tests.gatewayhelpers import metric

TOKEN = "test-token-1234"
FLAGS = ("--kv-cache-tokens", "512", "--max-batch", "4")
HEALTH_PATHS = (Endpoint.LIVE, Endpoint.READY, Endpoint.PRIMARY, Endpoint.STANDBY)


@pytest.fixture(scope="module")
def primary(tiny_model: Path) -> Iterator[EngineProcess]:
    """Off mode (weights loaded from disk in process), starts as primary; a KV pool of 1024 positions: 64 blocks."""
    flags = (*FLAGS, "--engine-id", "engine-a", "--kv-pool-tokens", "1024")
    with EngineProcess(tiny_model, *flags, token=TOKEN) as engine:
        yield engine


@pytest.fixture(scope="module")
def standby(tiny_model: Path) -> Iterator[EngineProcess]:
    """Attached to a cache daemon, starts as standby; every test leaves it a standby again."""
    runtime = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp"))  # socket paths must stay short
    sock = runtime / "d.sock"
    try:
        with (
            ProcessDaemon(tiny_model, sock),
            EngineProcess(
                tiny_model, *FLAGS, "--role", "standby", "--weight-cache", "client", "--socket", str(sock), token=TOKEN
            ) as engine,
        ):
            yield engine
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Reference:
    return reference_completer(tiny_model)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_off_mode_completions_equal_in_process_generate(
    primary: EngineProcess, reference: Reference, sampling: dict
) -> None:
    check_equal_to_reference(primary, reference, sampling)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_attached_completions_equal_in_process_generate(
    standby: EngineProcess, reference: Reference, sampling: dict
) -> None:
    assert standby.client.get(Endpoint.READY).json()["weight_cache"] == {"mode": "client", "source": "cache"}
    assert standby.post(Endpoint.PROMOTE).status_code == 200
    try:
        check_equal_to_reference(standby, reference, sampling)
    finally:
        assert standby.post(Endpoint.DEMOTE).status_code == 200


def test_openai_client_completes(primary: EngineProcess, reference: Reference) -> None:
    client = openai.OpenAI(base_url=f"{primary.url}/v1", api_key="x")
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="Hello there", max_tokens=8, temperature=0)
    text, n = reference("Hello there", 8, temperature=0.0)
    assert completion.choices[0].text == text
    assert completion.usage.completion_tokens == n


def test_stop_string_ends_the_text_before_it(primary: EngineProcess, reference: Reference) -> None:
    full, _ = reference("The quick brown fox", 24, temperature=0.0)
    stop = full[8:11]
    expected = full[: full.find(stop)]
    body = primary.complete(prompt="The quick brown fox", max_tokens=24, temperature=0, stop=[stop, "\x00never"]).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (expected, "stop")
    chunks = primary.stream(prompt="The quick brown fox", max_tokens=24, temperature=0, stop=stop)
    assert streamed(chunks) == ([expected], ["stop"])


def test_a_stream_whose_client_goes_away_ends_and_gives_its_sequence_back(primary: EngineProcess) -> None:
    """A stream whose client closes its connection after the first event (the stream's body runs in the request's
    own task, a watcher of the client beside it: ``standby.server.ClosingStream``) stops generating: its sequence
    and KV blocks are given back with far fewer than its 500 tokens generated, and the engine serves the next
    request."""
    tokens = "hotweights_engine_completion_tokens_total"
    before = metric(primary, tokens)
    body = {"prompt": "The quick brown fox", "max_tokens": 500, "temperature": 0, "stream": True}
    with primary.client.stream("POST", Endpoint.COMPLETIONS, json=body) as reply:
        assert reply.status_code == 200
        next(reply.iter_lines())
    wait_until(lambda: primary.client.get(Endpoint.PRIMARY).json()["kv_pool"]["running"] == 0, 30, "the stream's end")
    generated = metric(primary, tokens) - before
    assert 0 < generated < 250, generated
    assert primary.complete(prompt="Hello", max_tokens=4, temperature=0).status_code == 200


def test_a_gathered_stream_brings_the_same_text_and_token_ids_in_fewer_chunks(primary: EngineProcess) -> None:
    """``GATHER_MS_HEADER`` (what the gateway asks for a client that wants no stream): a choice's tokens of up to that
    many milliseconds are one chunk, the text and token ids those of the stream without it; beyond MAX_GATHER_MS,
    400 naming the header."""
    body = {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "return_token_ids": True}
    plain = primary.stream(**body)
    gathered = primary.stream(headers={GATHER_MS_HEADER: str(MAX_GATHER_MS)}, **body)
    assert 1 <= len(gathered) < len(plain)
    assert streamed(gathered) == streamed(plain)
    ids = [
        [i for chunk in chunks for choice in chunk["choices"] for i in choice["token_ids"]]
        for chunks in (plain, gathered)
    ]
    assert ids[0] == ids[1] and len(ids[0]) > 1
    refused = primary.client.post(
        Endpoint.COMPLETIONS, json=body | {"stream": True}, headers={GATHER_MS_HEADER: str(MAX_GATHER_MS + 1)}
    )
    assert refused.status_code == 400 and GATHER_MS_HEADER in refused.json()["error"]["param"], refused.text


def test_concurrent_streams_interleave(primary: EngineProcess) -> None:
    chunks = primary.stream(prompt=["a", "b", "c"], max_tokens=40, temperature=0)
    order = [choice["index"] for chunk in chunks for choice in chunk["choices"]]
    assert order != sorted(order), "the three sequences ran one after another"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": [], "max_tokens": 4}, "prompt"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "max_tokens": 600}, "max_tokens"),  # beyond the 512-token KV slot
    ],
)
def test_bad_requests_name_the_field(primary: EngineProcess, body: dict, param: str) -> None:
    response = primary.complete(**body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert param in error["message"]


def test_unknown_model_is_404(primary: EngineProcess) -> None:
    response = primary.complete(model="gpt-17", prompt="x")
    assert (response.status_code, response.json()["error"]["param"]) == (404, "model")


def test_health_endpoints_answer_get_head_and_options(primary: EngineProcess) -> None:
    expected = {Endpoint.LIVE: 200, Endpoint.READY: 200, Endpoint.PRIMARY: 200, Endpoint.STANDBY: 503}
    for path in HEALTH_PATHS:
        for method in ("GET", "HEAD", "OPTIONS"):
            response = primary.client.request(method, path)
            assert response.status_code == expected[path], (method, path)
            if method == "HEAD":
                assert response.content == b""
            else:
                body = response.json()
                assert body["engine_id"] == "engine-a"
                assert (body["role"], body["state"]) == ("primary", "ready")
                assert len(body["fingerprint"]) == 16
                assert body["weight_cache"] == {"mode": "off", "source": "disk"}
                assert body["kv_cache_bytes"] > 0 and body["max_batch"] == 4
                assert body["kv_pool"] == {"block_tokens": 16, "blocks": 64, "used": 0, "running": 0, "waiting": 0}
                assert {"uptime_s", "in_flight"} <= body.keys()


def test_metrics_are_exported(primary: EngineProcess) -> None:
    primary.complete(prompt="x", max_tokens=2)
    text = primary.client.get(Endpoint.METRICS).text
    for name in (
        f'hotweights_engine_requests_total{{endpoint="{Endpoint.COMPLETIONS}",status="200"}}',
        "hotweights_engine_prompt_tokens_total",
        "hotweights_engine_completion_tokens_total",
        "hotweights_engine_request_duration_seconds_bucket",
        "hotweights_engine_time_to_first_token_seconds_bucket",
        'hotweights_engine_role{role="primary"} 1.0',
        "hotweights_engine_promotions_total",
        "hotweights_engine_promotion_duration_seconds_bucket",
        'hotweights_engine_weight_cache_info{engine_id="engine-a"',
        "hotweights_engine_in_flight_requests",
        "hotweights_engine_kv_cache_bytes",
        'hotweights_engine_kv_pool{measure="blocks"} 64.0',
        'hotweights_engine_kv_pool{measure="used"} 0.0',
        'hotweights_engine_kv_pool{measure="running"} 0.0',
        'hotweights_engine_kv_pool{measure="waiting"} 0.0',
    ):
        assert name in text, name


def test_a_sequence_holds_the_kv_blocks_it_needs_while_it_runs_and_a_request_needing_more_than_the_pool_is_400(
    primary: EngineProcess,
) -> None:
    """A prompt of one token with max_tokens 400 holds 25 of the pool's 64 blocks while it streams (``/primary`` says
    so), none once it is done; four such prompts in one request need 100: refused, naming the numbers."""
    body = {"prompt": [5], "max_tokens": 400, "temperature": 0, "stream": True}
    with primary.client.stream("POST", Endpoint.COMPLETIONS, json=body) as response:
        assert response.status_code == 200 and next(line for line in response.iter_lines() if line)
        pool = primary.client.get(Endpoint.PRIMARY).json()["kv_pool"]
        assert (pool["used"], pool["running"], pool["waiting"]) == (25, 1, 0)
    wait_until(lambda: primary.client.get(Endpoint.PRIMARY).json()["kv_pool"]["used"] == 0, what="the blocks freed")
    refused = primary.complete(prompt=[[5]] * 4, max_tokens=400)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    message = refused.json()["error"]["message"]
    assert "need 100 KV blocks of 16 positions" in message and "whole KV pool of 64 blocks" in message, message


def test_role_changes_need_the_token(primary: EngineProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for path in (Endpoint.PROMOTE, Endpoint.DRAIN, Endpoint.DEMOTE):
            response = primary.client.post(path, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.headers["WWW-Authenticate"] == "Bearer"
    response = primary.post(Endpoint.PROMOTE)
    assert response.status_code == 200
    assert (response.json()["changed"], response.json()["message"]) == (False, "already primary")


def test_role_change_bodies_are_checked_strictly(primary: EngineProcess) -> None:
    for body in ({"timeout_s": True}, {"timeout_s": -1}, {"timeout_s": "5"}, {"bogus": 1}):
        for path in (Endpoint.DRAIN, Endpoint.DEMOTE):
            response = primary.post(path, json=body)
            assert response.status_code == 400, (path, body, response.text)
            assert response.json()["error"]["type"] == "invalid_request_error"
    assert primary.client.get(Endpoint.PRIMARY).status_code == 200  # nothing was drained


def test_standby_never_serves(standby: EngineProcess) -> None:
    for response in (standby.complete(prompt="x", max_tokens=2), standby.client.get(Endpoint.MODELS)):
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["type"] == "unavailable" and "standby" in error["message"]
    assert standby.client.get(Endpoint.PRIMARY).status_code == 503
    health = standby.client.get(Endpoint.STANDBY)
    assert health.status_code == 200
    assert (health.json()["role"], health.json()["kv_cache_bytes"]) == ("standby", 0)


def test_promote_drain_demote(standby: EngineProcess) -> None:
    promoted = standby.post(Endpoint.PROMOTE).json()
    assert (promoted["changed"], promoted["role"]) == (True, "primary")
    assert promoted["duration_ms"] > 0 and promoted["kv_cache_bytes"] > 0
    assert standby.client.get(Endpoint.PRIMARY).status_code == 200
    assert standby.client.get(Endpoint.STANDBY).status_code == 503
    assert standby.client.get(Endpoint.READY).json()["kv_cache_bytes"] == promoted["kv_cache_bytes"]
    assert standby.post(Endpoint.PROMOTE).json()["message"] == "already primary"

    drained: list[httpx.Response] = []
    body = {
        "prompt": "x",
        "max_tokens": 480,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with standby.client.stream("POST", Endpoint.COMPLETIONS, json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        drain = threading.Thread(target=lambda: drained.append(standby.post(Endpoint.DRAIN, json={"timeout_s": 60})))
        drain.start()
        wait_until(lambda: standby.client.get(Endpoint.PRIMARY).status_code == 503, timeout=5, what="/primary 503")
        assert standby.client.get(Endpoint.READY).json()["in_flight"] == 1, "the stream ended before the drain began"
        assert standby.complete(prompt="x", max_tokens=2).status_code == 503
        rest = [line for line in lines if line]
    drain.join(timeout=30)
    assert rest[-1] == "data: [DONE]"
    assert '"completion_tokens":480' in rest[-2]
    report = drained[0].json()
    assert (drained[0].status_code, report["state"], report["drained"]) == (200, "drained", True)
    assert (report["finished"], report["cancelled"]) == (1, 0)

    demoted = standby.post(Endpoint.DEMOTE).json()
    assert (demoted["role"], demoted["kv_cache_bytes_released"]) == ("standby", promoted["kv_cache_bytes"])
    assert standby.client.get(Endpoint.STANDBY).json()["kv_cache_bytes"] == 0
    assert standby.client.get(Endpoint.PRIMARY).status_code == 503
    assert standby.post(Endpoint.DEMOTE).json()["message"] == "already standby"


def test_drain_deadline_cancels_what_is_left(standby: EngineProcess) -> None:
    standby.post(Endpoint.PROMOTE)
    try:
        with standby.client.stream(
            "POST", Endpoint.COMPLETIONS, json={"prompt": "x", "max_tokens": 480, "stream": True, "temperature": 0}
        ) as r:  # greedy: a sampled text may draw its stop token first and end before the deadline
            lines = r.iter_lines()
            next(lines)
            report = standby.post(Endpoint.DRAIN, json={"timeout_s": 0.05}).json()
            rest = [line for line in lines if line]
        assert (report["drained"], report["cancelled"]) == (True, 1)
        assert '"error"' in rest[-1] and "[DONE]" not in rest[-1]
    finally:
        assert standby.post(Endpoint.DEMOTE).json()["role"] == "standby"


def test_a_taken_port_is_one_line_before_anything_loads(tiny_model: Path) -> None:
    """Exit 2 and nothing on stderr but the refusal: the weights' load (which logs) never started."""
    port, stderr = refusal_on_taken_port("engine", "--model", str(tiny_model))
    assert stderr.splitlines() == [f"hotweights engine: error: {in_use(port)}"]


def test_the_engine_default_port_is_not_the_gateways() -> None:
    engine_port = build_parser().parse_args(["engine"]).port
    gateway_port = GatewaySection().port
    assert (engine_port, gateway_port) == (8200, 8000)


def test_sigterm_lets_in_flight_requests_finish_and_exits_zero(tiny_model: Path) -> None:
    engine = EngineProcess(tiny_model, *FLAGS, "--shutdown-timeout", "30")
    with engine:
        with engine.client.stream(
            "POST", Endpoint.COMPLETIONS, json={"prompt": "x", "max_tokens": 300, "stream": True}
        ) as r:
            lines = r.iter_lines()
            next(lines)
            engine.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert engine.process.wait(timeout=30) == 0
        assert "stopped on SIGTERM" in engine.logs()


def test_sigterm_past_the_shutdown_timeout_cancels_cleanly(tiny_model: Path) -> None:
    """A stream still running at --shutdown-timeout ends with an SSE error event (as at a drain deadline),
    not with uvicorn cancelling its task and logging a traceback; the engine still exits 0."""
    # A generation of thousands of tokens, far longer than --shutdown-timeout: it cannot end on its own
    # between the first streamed event and the signal, however late a loaded machine lets this test read.
    # Greedy: the tiny model's greedy continuation of "x" has no end-of-sequence token in its first 4000 (a
    # sampled one can draw one early and end with [DONE] before the signal).
    flags = ("--kv-cache-tokens", "4096", "--max-batch", "1", "--shutdown-timeout", "0.05")
    engine = EngineProcess(tiny_model, *flags)
    body = {"prompt": "x", "max_tokens": 4000, "temperature": 0.0, "stream": True}
    with engine:
        with engine.client.stream("POST", Endpoint.COMPLETIONS, json=body) as r:
            lines = r.iter_lines()
            next(lines)
            engine.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert '"error"' in rest[-1] and "[DONE]" not in rest[-1]
        assert engine.process.wait(timeout=30) == 0
        assert "stopped on SIGTERM" in engine.logs()
        assert "Exception in ASGI application" not in engine.logs()


class FakeScheduler:
    """What ``Roles`` drives, without a model: sequences are never live."""

    def cancel_all(self) -> int:
        return 0

    def attach_kv(self, kv: object) -> None:
        pass

    def release_kv(self, timeout_s: float) -> tuple[None, int]:
        return None, 0

    def keep_cut(self, keep: bool) -> None:
        pass


def test_a_role_change_queued_behind_a_resume_stops_serving_at_once() -> None:
    """drain (waiting for a request), then promote (resumes the drained primary), then demote, all queued
    on the role-change lock: once the demote runs, /primary and /v1 refuse while it drains."""

    async def scenario() -> None:
        roles = Roles(Role.PRIMARY, KvCapacity(FakeScheduler(), lambda: None), drain_timeout_s=10)
        roles.admit()
        drain = asyncio.create_task(roles.drain())
        await asyncio.sleep(0.01)
        promote = asyncio.create_task(roles.promote())
        demote = asyncio.create_task(roles.demote())
        await asyncio.sleep(0.01)
        roles.release()  # the drain finishes and the promote resumes serving
        assert (await drain).accepted and (await promote).message.startswith("resumed")
        roles.admit()  # a request the resumed primary took
        await asyncio.sleep(0.05)
        assert roles.serving_refusal() is not None, "the demote is draining but /primary still answers 200"
        roles.release()
        assert (await asyncio.wait_for(demote, 5)).changed and roles.role is Role.STANDBY

    asyncio.run(scenario())


def test_demote_during_a_promote_is_not_already_standby() -> None:
    async def scenario() -> None:
        allocated = threading.Event()

        def allocate() -> object:
            allocated.wait(5)
            return type("KV", (), {"nbytes": 8})()

        roles = Roles(Role.STANDBY, KvCapacity(FakeScheduler(), allocate), drain_timeout_s=10)
        promote = asyncio.create_task(roles.promote())
        await asyncio.sleep(0.01)
        demote = asyncio.create_task(roles.demote())
        await asyncio.sleep(0.01)
        allocated.set()
        assert (await promote).changed
        outcome = await asyncio.wait_for(demote, 5)
        assert (outcome.changed, roles.role) == (True, Role.STANDBY), outcome.message

    asyncio.run(scenario())


def test_a_sequence_submitted_after_the_worker_ended_is_answered() -> None:
    """Once the inference thread has ended (stopped or crashed), a submitted sequence gets an error Finish
    at once instead of waiting forever for a worker that will never collect it."""
    scheduler = Scheduler()  # no decoder: no sequence ever reaches a model
    scheduler.start()
    scheduler.stop(5)
    events: list[object] = []
    scheduler.submit(Sequence([1], SamplingParams(max_tokens=1), events.append))
    assert [type(e) for e in events] == [Finish] and events[0].reason == "error"
