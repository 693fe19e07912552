"""No single request takes a group down, no input makes a server answer 5xx, and overload is refused at
once: one ``up`` stack (controller, gateway, two engines, the shipped health timings) for the module."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hotweights.admission import retry_after
from hotweights.contract import ADMITS_IN_HEADER, Endpoint
from hotweights.controller.config import HealthSection, load_config
from tests.controllerhelpers import ControllerStack

pytestmark = pytest.mark.timeout(240)

PROMPT_OF_DEATH = "the quick brown fox jumps over the lazy dog " * 48_000  # 2.1 MB: ~1 s of tokenizing
STACK_HEALTH = "[health]\ninterval_ms = 100\ntimeout_ms = 500\nfailure_threshold = 2\n"

# Bodies no server may answer with a 5xx: (content, content type).
HOSTILE = [
    (b'{"group": NaN}', "application/json"),
    (b'{"group": Infinity, "timeout_s": -Infinity}', "application/json"),
    (b'{"timeout_s": 1e999, "prompt": "x"}', "application/json"),
    (b'{"group": 1' + b"0" * 400 + b"}", "application/json"),
    (b'{"group": 0, "group": 1}', "application/json"),
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "application/json"),
    (b"[" * 100_000, "application/json"),
    (b'{"prompt": "\xff\xfe"}', "application/json"),
    (b'{"prompt": "\\ud800", "candidate": "\\udc00"}', "application/json"),
    (b'{"group": "zero", "candidate": 7, "timeout_s": [1], "prompt": {"a": 1}}', "application/json"),
    (b'{"unknown_field": 1, "prompt": "x"}', "application/json"),
    (b"not json at all", "application/json"),
    (b"\x00\x01\x02", "application/octet-stream"),
]
CONTROLLER_MUTATIONS = [
    "/switchover",
    Endpoint.ROLLOUT,
    "/failover",
    "/engines",
    "/engines/g0-e9/drain",
    "/cache/9/restart",
]


@pytest.fixture(scope="module")
def stack(tiny_model: Path) -> Iterator[ControllerStack]:
    """``up`` with the health timings a cluster ships with, a gateway that proxies one request at a time (one
    worker), and engines that let no request wait once they have timed one (a queue budget of 0), so that overload
    is easy to make."""
    engine_extra = "queue_budget_s = 0"
    stack = ControllerStack(
        tiny_model, engines=2, engine_extra=engine_extra, gateway_extra="max_in_flight = 1\nworkers = 1"
    )
    shipped = HealthSection()
    health = f"[health]\ninterval_ms = {shipped.interval_ms}\ntimeout_ms = {shipped.timeout_ms}\n"
    text = stack.config_path.read_text()
    assert STACK_HEALTH in text, "the helper's [health] changed: update STACK_HEALTH"
    stack.config_path.write_text(text.replace(STACK_HEALTH, health))
    stack.config = load_config(stack.config_path)
    try:
        stack.start_controller("up")
        stack.wait_steady()
        yield stack
    finally:
        stack.close()


def gateway(stack: ControllerStack) -> str:
    return f"http://127.0.0.1:{stack.config.gateway.port}"


def failovers(stack: ControllerStack) -> list[dict]:
    return stack.events("detect") + stack.events("fence")


def assert_short_4xx(response: httpx.Response, where: str) -> None:
    assert 400 <= response.status_code < 500, f"{where}: {response.status_code} {response.text[:300]}"
    assert len(response.content) < 4000, f"{where}: {len(response.content)} bytes answered"
    response.json()


def test_a_request_of_death_through_the_gateway_causes_no_failover(stack: ControllerStack) -> None:
    primary = stack.primary()["id"]
    assert stack.primary()["url"]
    response = httpx.post(gateway(stack) + Endpoint.COMPLETIONS, json={"prompt": PROMPT_OF_DEATH}, timeout=60)
    assert response.status_code == 400 and "exceeds this engine's" in response.json()["error"]["message"]
    assert failovers(stack) == []
    assert stack.primary()["id"] == primary


@pytest.mark.parametrize(("content", "content_type"), HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_bodies_get_a_short_4xx_everywhere(stack: ControllerStack, content: bytes, content_type: str) -> None:
    headers = {"content-type": content_type}
    primary = stack.primary()["url"]
    for url in [gateway(stack) + Endpoint.COMPLETIONS, primary + Endpoint.COMPLETIONS]:
        assert_short_4xx(httpx.post(url, content=content, headers=headers, timeout=60), url)
    for path in CONTROLLER_MUTATIONS:
        assert_short_4xx(stack.client.post(path, content=content, headers=headers), path)
    assert failovers(stack) == []


def oversized(url: str, path: str) -> int:
    """The status a server answers to headers announcing 5 MB (none of it sent): refused before reading."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {5 << 20}\r\n\r\n"
        conn.sendall(head.encode())
        return int(conn.recv(4096).split()[1])


def answer_to_headers(url: str, path: str, length: int) -> int:
    """The status a server answers to headers announcing ``length`` bytes of JSON, none of them sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n"
        conn.sendall(head.encode())
        return int(conn.recv(4096).split()[1])


def test_a_full_engine_refuses_a_fresh_completion_from_its_headers_before_its_body(stack: ControllerStack) -> None:
    """While both slots of the primary are taken (its queue budget of 0 lets none wait), a completion whose body never
    comes is answered 429 at once: a refusal costs the engine no body, parse or validation (a body it waited for
    would be 408 after 30 s, past this socket's 10 s)."""
    url = stack.primary()["url"]
    body = {"prompt": "hello", "max_tokens": 240}
    assert httpx.post(url + Endpoint.COMPLETIONS, json=body, timeout=60).is_success  # a request's hold timed
    refused = threading.Event()
    done = threading.Event()

    def busy() -> None:  # keeps a slot taken: the next request goes in as one ends
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                if client.post(url + Endpoint.COMPLETIONS, json=body).status_code == 429:
                    refused.set()

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        clients = [pool.submit(busy) for _ in range(3)]
        try:
            assert refused.wait(60), "the engine refused nothing with both slots taken"
            assert answer_to_headers(url, Endpoint.COMPLETIONS, 50) == 429
        finally:
            done.set()
        for client in clients:
            client.result()


def test_bodies_beyond_each_servers_limit_are_413_before_they_are_read(stack: ControllerStack) -> None:
    assert oversized(gateway(stack), Endpoint.COMPLETIONS) == 413
    assert oversized(stack.primary()["url"], Endpoint.COMPLETIONS) == 413
    assert oversized(stack.url, "/switchover") == 413


def test_echoed_values_are_cut_short(stack: ControllerStack) -> None:
    name = "e" * 100_000
    response = stack.client.post(f"/engines/{name[:8000]}/promote")
    assert_short_4xx(response, "promote")
    response = httpx.post(gateway(stack) + Endpoint.COMPLETIONS, json={"prompt": "x", "model": name}, timeout=30)
    assert_short_4xx(response, "model")


def flood(url: str) -> list[httpx.Response]:
    """16 completions of 200 tokens sent at once."""
    body = {"prompt": "hello", "max_tokens": 200}
    with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda _: client.post(url + Endpoint.COMPLETIONS, json=body), range(16)))


@pytest.mark.parametrize("where", ["gateway", "engine"])
def test_overload_is_refused_at_once_with_retry_after(stack: ControllerStack, where: str) -> None:
    """The gateway proxies one request at a time here; the engine generates max_batch (2) and, once it has timed a
    completion, lets none wait: each refusal says when a slot is expected (``Retry-After``, whole seconds, and the
    engine's ``ADMITS_IN_HEADER`` in milliseconds)."""
    url = gateway(stack) if where == "gateway" else stack.primary()["url"]
    assert httpx.post(url + Endpoint.COMPLETIONS, json={"prompt": "hello", "max_tokens": 8}, timeout=60).is_success
    responses = flood(url)
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses
    refused = [r for r in responses if r.status_code == 429]
    assert refused, statuses
    for answer in refused:
        admits_in_ms = answer.headers.get(ADMITS_IN_HEADER)
        expected = retry_after(None if admits_in_ms is None else int(admits_in_ms) / 1000)
        assert answer.headers["retry-after"] == str(expected), answer.headers
    assert all(r.json()["error"]["type"] == "overloaded" for r in refused)
    metrics = httpx.get(url + Endpoint.METRICS).text
    assert f'hotweights_{where}_admission_total{{verdict="refused"}}' in metrics
