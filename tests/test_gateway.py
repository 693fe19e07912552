"""``hotweights gateway`` as a real process in front of real engines, with no controller anywhere: the
gateway finds the primary itself, holds requests while there is none, and hides failovers from clients.

The last test kills an engine, so it stays last in this file."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hotweights.contract import ADMITS_IN_HEADER, REPLAY_HEADER, SUSPECT_REQUEST, Endpoint
from hotweights.gateway.answers import UpstreamFailed
from hotweights.gateway.discovery import CPU_WINDOW_S, FULL_MAX_S, FULL_MIN_S, Discovery, Upstream, cuts, refused
from hotweights.gateway.migratingproxy import GONE, opened
from hotweights.ports import free_port
from hotweights.proctree import cpu_seconds
from hotweights.spawn import hotweights_command
from hotweights.standby.serving import bind_port
from tests.cachehelpers import busy_process, wait_until
from tests.enginehelpers import EngineProcess, in_use, refusal_on_taken_port
from tests.gatewayhelpers import GatewayProcess, metric, primary_and_standby, roles, write_cluster

PROMPTS = ["The quick brown fox", "Once upon a time"]
LONG_STREAM = {"prompt": "long", "max_tokens": 480, "temperature": 0.0, "stream": True}


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[EngineProcess]]:
    with primary_and_standby(tiny_model) as engines:
        yield engines


@pytest.fixture(scope="module")
def gateway(engines: list[EngineProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    config = write_cluster(tmp_path_factory.mktemp("gateway") / "cluster.toml", [e.port for e in engines])
    with GatewayProcess(config) as gateway:
        gateway.wait_health(lambda h: len(h["primaries"]) == 1, what="the primary")
        yield gateway


@pytest.mark.unit
@pytest.mark.parametrize(
    ("primary", "draining", "weights", "others", "cut"),
    [
        (True, False, "a", ["b"], False),  # serving
        (False, False, "a", ["a"], True),  # gone, hung or a standby: its requests go on elsewhere
        (False, True, "a", ["a", "b"], True),  # a switchover: the next primary can go on with them
        (False, True, "a", ["b", "b"], False),  # a model update's switchover: they finish where they began
        (False, True, "a", [], False),  # the only engine left drains: the same
        (False, True, None, ["b"], True),  # weights not named: as before such engines said
    ],
)
def test_a_draining_primarys_streams_are_cut_only_when_another_engine_has_its_weights(
    primary: bool, draining: bool, weights: str | None, others: list[str], cut: bool
) -> None:
    upstream = Upstream("http://a", is_primary=primary, weights=weights, draining=draining)
    assert cuts(upstream, [upstream, *(Upstream(f"http://{i}", weights=w) for i, w in enumerate(others))]) is cut


def test_an_upstream_that_stops_answering_names_no_weights() -> None:
    """A dead engine's last known weights must not count as an engine that could go on with a draining primary's
    requests (``cuts``): a probe that finds nothing listening forgets them."""

    async def probe() -> Upstream:
        async with httpx.AsyncClient() as client:
            discovery = Discovery([f"http://127.0.0.1:{free_port()}"], client, interval_s=1.0, timeout_s=1.0)
            discovery.upstreams[0].weights, discovery.upstreams[0].draining = "a", True  # as a live probe left them
            await discovery.probe_all()
            return discovery.upstreams[0]

    upstream = asyncio.run(probe())
    assert (upstream.status, upstream.weights, upstream.draining) == (None, None, False)
    assert upstream.reason.startswith("unreachable")


def test_a_late_probe_of_a_primary_running_on_the_cpu_changes_nothing_and_of_a_stopped_one_ends_it() -> None:
    """A primary that stops answering its probes (a socket nobody accepts on) while its process runs on the CPU, soon
    after its last answer, is busy, not lost: it stays primary; stopped (SIGSTOP), the next late probe ends it."""
    spinner = busy_process()
    try:
        with socket.create_server(("127.0.0.1", 0)) as silent:

            async def probe() -> tuple[bool, bool]:
                async with httpx.AsyncClient() as client:
                    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
                    discovery = Discovery([url], client, interval_s=1.0, timeout_s=0.1)
                    upstream = discovery.upstreams[0]
                    upstream.is_primary, upstream.status, upstream.pid = True, 200, spinner.pid
                    upstream.answered_at = time.monotonic()  # as a probe just answered
                    await discovery.probe_all()
                    kept = upstream.is_primary
                    spinner.send_signal(signal.SIGSTOP)
                    await discovery.probe_all()
                    return kept, upstream.is_primary

            kept, stopped_kept = asyncio.run(probe())
    finally:
        spinner.kill()
        spinner.wait()
    assert (kept, stopped_kept) == (True, False)


@pytest.mark.parametrize(
    ("cpu_share", "answered_ago_s", "primary", "saturated"),
    [
        (1.0, 0.1, True, True),  # it runs and answered just now: its load, not a loss
        (0.0, 0.1, True, False),  # it ran nothing (stopped, deadlocked): lost
        (1.0, 5.0, True, False),  # it ran, but answered nothing for seconds: lost
        (1.0, 0.1, False, False),  # not a primary
    ],
)
def test_a_connection_not_accepted_in_time_by_a_running_primary_is_its_load(
    cpu_share: float, answered_ago_s: float, primary: bool, saturated: bool
) -> None:
    """``Discovery.saturated``, on this process's own /proc figures: the CPU it used since a probe began
    CPU_WINDOW_S ago (the sample says it had used less by ``cpu_share`` of the window), and its last answer. A
    saturated primary is full for as long as a connection waits (fresh requests refused at once) and stays primary."""
    now, cpu = time.monotonic(), cpu_seconds(os.getpid())
    assert cpu is not None
    discovery = Discovery(["http://127.0.0.1:1"], httpx.AsyncClient(), interval_s=1.0, timeout_s=0.2)
    upstream = discovery.upstreams[0]
    upstream.is_primary, upstream.pid, upstream.responded_at = primary, os.getpid(), now - answered_ago_s
    upstream.probes_began.append((now - 2 * CPU_WINDOW_S, cpu - 2 * CPU_WINDOW_S * cpu_share))
    upstream.probes_began.append((now, cpu))  # too recent to measure over: not the one used
    assert discovery.saturated(upstream) is saturated
    assert (discovery.full_for() > 0) is saturated and upstream.is_primary is primary


def comparable(body: dict) -> dict:
    """A completion without the fields that differ between two identical requests."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def stream(client: httpx.Client, body: dict) -> list[dict]:
    with client.stream("POST", Endpoint.COMPLETIONS, json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [comparable(json.loads(line.removeprefix("data: "))) for line in lines[:-1]]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.9, "seed": 7}])
def test_completions_through_the_gateway_equal_the_engines_own(
    engines: list[EngineProcess], gateway: GatewayProcess, sampling: dict
) -> None:
    primary, _ = roles(engines)
    body = {"prompt": PROMPTS, "max_tokens": 16, **sampling}
    proxied = gateway.client.post(Endpoint.COMPLETIONS, json=body)
    assert proxied.status_code == 200, proxied.text
    assert proxied.headers["x-hotweights-upstream"] == primary.url
    assert comparable(proxied.json()) == comparable(primary.complete(**body).json())
    assert stream(gateway.client, body) == stream(primary.client, body)


def test_errors_and_other_endpoints_pass_through_unretried(
    engines: list[EngineProcess], gateway: GatewayProcess
) -> None:
    primary, _ = roles(engines)
    retries = metric(gateway, "hotweights_gateway_retries_total")
    bad = gateway.client.post(Endpoint.COMPLETIONS, json={"prompt": "x", "max_tokens": -1})
    assert (bad.status_code, bad.json()) == (400, primary.complete(prompt="x", max_tokens=-1).json())
    assert gateway.client.get(Endpoint.MODELS).json() == primary.client.get(Endpoint.MODELS).json()
    assert metric(gateway, "hotweights_gateway_retries_total") == retries


def test_health_and_metrics_describe_the_upstreams(engines: list[EngineProcess], gateway: GatewayProcess) -> None:
    primary, standby = roles(engines)
    served = gateway.client.post(Endpoint.COMPLETIONS, json={"prompt": "x", "max_tokens": 1})  # counted below
    assert served.status_code == 200, served.text
    health = gateway.health()
    assert health["primaries"] == [primary.url]
    assert {u["url"]: u["primary_status"] for u in health["upstreams"]} == {primary.url: 200, standby.url: 503}
    assert (health["held"], health["queue_limit"], health["hold_timeout_s"]) == (0, 256, 10.0)
    text = gateway.client.get(Endpoint.METRICS).text
    for name in (
        'hotweights_gateway_requests_total{status="200"}',
        "hotweights_gateway_retries_total",
        "hotweights_gateway_held_requests 0.0",
        "hotweights_gateway_hold_seconds_bucket",
        "hotweights_gateway_primaries 1.0",
    ):
        assert name in text, name


def engine_requests(engines: list[EngineProcess]) -> float:
    """Requests the engines answered, besides the gateway's probes and these scrapes."""
    total = 0.0
    for engine in engines:
        for family in text_string_to_metric_families(engine.client.get(Endpoint.METRICS).text):
            total += sum(
                s.value
                for s in family.samples
                if s.name == "hotweights_engine_requests_total"
                and s.labels["endpoint"] not in (Endpoint.PRIMARY, Endpoint.METRICS)
            )
    return total


def raw_request(gateway: GatewayProcess, method: str, path: str) -> int:
    """Send ``path`` byte for byte (httpx would normalize it); the status."""
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    try:
        connection.request(method, path, body=b"{}", headers={"Content-Type": "application/json"})
        return connection.getresponse().status
    finally:
        connection.close()


HOSTILE_PATHS = [
    "/v1/../demote",
    "/v1/%2e%2e/demote",
    "/v1/%2E%2E/demote",
    "/v1/.%2e/demote",
    "/v1/..%2fdemote",
    "/v1/x/../../demote",
    "/v1/%2fdemote",
    "/v1/%5c..%5cdemote",
    "/v1/./models",
    "/v1//models",
    "/v1/models/",
    "/v1/models/..",
    "/v1/models%2f",
    "/v1/models%00",
    "/v1/",
]


def test_only_normalized_v1_paths_reach_the_engines(engines: list[EngineProcess], gateway: GatewayProcess) -> None:
    """The engines have no token here: a traversal that reached /demote would demote the primary."""
    primary, _ = roles(engines)
    before = engine_requests(engines)
    for path in HOSTILE_PATHS:
        for method in ("POST", "GET"):
            assert raw_request(gateway, method, path) == 404, (method, path)
    assert engine_requests(engines) == before, "a hostile path reached an engine"
    assert roles(engines)[0] is primary
    assert raw_request(gateway, "GET", Endpoint.MODELS) == 200  # the same client, a plain path: forwarded
    assert engine_requests(engines) == before + 1


def test_request_is_held_while_no_engine_is_primary(engines: list[EngineProcess], gateway: GatewayProcess) -> None:
    primary, standby = roles(engines)
    assert primary.post(Endpoint.DEMOTE).status_code == 200
    gateway.wait_health(lambda h: not h["primaries"], what="no primary")
    with ThreadPoolExecutor(1) as pool:
        request = pool.submit(httpx.post, f"{gateway.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        gateway.wait_health(lambda h: h["held"] == 1, what="the request held")
        assert standby.post(Endpoint.PROMOTE).status_code == 200
        promoted = time.monotonic()
        response = request.result(timeout=30)
        print(f"held request answered {(time.monotonic() - promoted) * 1000:.0f} ms after the promotion")
    assert response.status_code == 200, response.text
    assert response.headers["x-hotweights-upstream"] == standby.url


NO_WAIT = ("--kv-cache-tokens", "512", "--max-batch", "2", "--queue-budget", "0")  # no fresh request waits once timed


def test_a_burst_held_for_a_failover_is_queued_not_refused_by_the_new_primarys_admission(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Requests held while no primary is known are released together, marked owed; the new primary serves two
    sequences at a time (a request of two prompts alone) and, having timed a completion, lets no fresh request wait
    (a queue budget of 0), yet queues the whole burst: all are served. Then a burst of fresh requests meets its
    429s."""
    with EngineProcess(tiny_model, *NO_WAIT, "--engine-id", "c") as engine:
        engine.wait_ready()
        assert engine.complete(prompt="timed", max_tokens=8).status_code == 200
        with GatewayProcess(write_cluster(tmp_path / "cluster.toml", [engine.port])) as gateway:
            gateway.wait_health(lambda h: len(h["primaries"]) == 1, what="the primary")
            assert engine.post(Endpoint.DEMOTE).status_code == 200
            gateway.wait_health(lambda h: not h["primaries"], what="no primary")
            bodies = [{"prompt": f"held {i}", "max_tokens": 64} for i in range(3)]
            bodies += [{"prompt": [f"held {i}", "two prompts"], "max_tokens": 64} for i in range(3)]  # not migrated

            def post(body: dict) -> httpx.Response:
                return httpx.post(f"{gateway.url}{Endpoint.COMPLETIONS}", json=body, timeout=60)

            with ThreadPoolExecutor(len(bodies)) as pool:
                held = [pool.submit(post, body) for body in bodies]
                gateway.wait_health(lambda h: h["held"] == len(bodies), what="every request held")
                assert engine.post(Endpoint.PROMOTE).status_code == 200
                answers = [future.result(timeout=60) for future in held]
            assert [a.status_code for a in answers] == [200] * len(bodies), [a.text for a in answers]
            assert metric(engine, "hotweights_engine_admission_total", verdict="queued") >= 1
            with ThreadPoolExecutor(len(bodies)) as pool:  # not held: the engine's refusals reach the client
                burst = list(pool.map(post, [{"prompt": "busy", "max_tokens": 200}] * len(bodies)))
            assert 429 in [a.status_code for a in burst], [a.status_code for a in burst]


def test_a_request_re_sent_after_its_primary_died_is_queued_by_the_next_one_not_refused(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A request cut before its first byte (two prompts: re-sent whole, not migrated) goes to the next primary as
    one the gateway owes: that primary, both its slots busy and a completion timed, refuses a fresh request (a queue
    budget of 0) yet queues the owed one instead of answering 429."""
    with contextlib.ExitStack() as stack:
        old, new = (
            stack.enter_context(EngineProcess(tiny_model, *NO_WAIT, "--engine-id", name, "--role", role))
            for name, role in (("a", "primary"), ("b", "primary"))
        )
        old.wait_ready()
        new.wait_ready()
        assert new.complete(prompt="timed", max_tokens=8).status_code == 200
        assert new.post(Endpoint.DEMOTE).status_code == 200
        gateway = stack.enter_context(GatewayProcess(write_cluster(tmp_path / "cluster.toml", [old.port, new.port])))
        gateway.wait_health(lambda h: len(h["primaries"]) == 1, what="the primary")
        pool = stack.enter_context(ThreadPoolExecutor(4))
        body = {"prompt": ["cut", "two prompts"], "max_tokens": 300}
        cut = pool.submit(httpx.post, f"{gateway.url}{Endpoint.COMPLETIONS}", json=body, timeout=120)
        wait_until(lambda: metric(old, "hotweights_engine_in_flight_requests") >= 1, 30, "the request on a")
        assert new.post(Endpoint.PROMOTE).status_code == 200
        busy = [pool.submit(new.complete, prompt="busy", max_tokens=300) for _ in range(2)]
        wait_until(lambda: metric(new, "hotweights_engine_in_flight_requests") >= 2, 30, "b busy")
        assert new.complete(prompt="fresh", max_tokens=8).status_code == 429
        old.stop(signal.SIGKILL)
        answer = cut.result(timeout=120)
        assert answer.status_code == 200, answer.text
        assert [b.result(timeout=120).status_code for b in busy] == [200] * 2
        assert answer.headers["x-hotweights-upstream"] == new.url
        assert metric(new, "hotweights_engine_admission_total", verdict="queued") >= 1  # the owed one


def test_a_taken_port_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = write_cluster(tmp_path / "cluster.toml", [free_port()])
    port, stderr = refusal_on_taken_port("gateway", "--config", str(config))
    assert stderr.splitlines() == [f"hotweights gateway: error: {in_use(port)}"]


def test_a_listening_socket_handed_over_outlives_each_gateway(engines: list[EngineProcess], tmp_path: Path) -> None:
    """A socket bound and listening here, inherited by one gateway after another (how the controller runs
    its workers): while none runs, a client's connection is accepted by the kernel and waits in its queue
    instead of being refused, and the next gateway answers the request sent on it."""
    config = write_cluster(tmp_path / "cluster.toml", [e.port for e in engines])
    request = {"prompt": "hello", "max_tokens": 4}
    body = json.dumps(request)
    with contextlib.closing(bind_port("127.0.0.1", 0)) as listener:
        listener.listen(16)
        with GatewayProcess(config, listener=listener) as first:
            assert first.client.post(Endpoint.COMPLETIONS, json=request).status_code == 200
            first.process.kill()
            first.process.wait(timeout=10)
        waiting = http.client.HTTPConnection("127.0.0.1", listener.getsockname()[1], timeout=60)
        waiting.connect()  # no gateway runs: the kernel completes the handshake and queues it
        waiting.request("POST", Endpoint.COMPLETIONS, body, {"content-type": "application/json"})
        with GatewayProcess(config, listener=listener) as second:
            response = waiting.getresponse()
            assert response.status == 200, response.read()
            assert json.loads(response.read())["choices"][0]["text"]
            assert second.client.post(Endpoint.COMPLETIONS, json=request).status_code == 200
        waiting.close()


def test_an_fd_that_is_not_a_listening_socket_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = write_cluster(tmp_path / "cluster.toml", [free_port()])
    with socket.socket() as unbound:
        fd = unbound.fileno()
        result = subprocess.run(
            hotweights_command("gateway", "--config", str(config), "--fd", str(fd)),
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"hotweights gateway: error: --fd {fd}: not a listening TCP socket; pass the fd of one bound and listening"
    ]


def test_hold_deadline_and_queue_overflow_answer_503_with_the_reason(tmp_path: Path) -> None:
    """Nothing listens upstream (--upstream overrides the config's engines), one request may wait, for one
    second; SIGTERM then exits cleanly."""
    config = write_cluster(tmp_path / "cluster.toml", [], queue_limit=1, hold_timeout_s=1.0)
    upstream = f"http://127.0.0.1:{free_port()}"
    with GatewayProcess(config, "--upstream", upstream) as gateway, ThreadPoolExecutor(1) as pool:
        assert [u["url"] for u in gateway.health()["upstreams"]] == [upstream]
        started = time.monotonic()
        held = pool.submit(httpx.post, f"{gateway.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        gateway.wait_health(lambda h: h["held"] == 1, what="the request held")
        overflow = gateway.client.post(Endpoint.COMPLETIONS, json={"prompt": "x"})
        assert overflow.status_code == 503
        assert "already held (queue_limit)" in overflow.json()["error"]["message"]
        response = held.result(timeout=30)
        assert time.monotonic() - started >= 1.0
        assert response.status_code == 503
        assert "no primary engine appeared within 1.0 s" in response.json()["error"]["message"]
        assert metric(gateway, "hotweights_gateway_rejected_total") == 2
        assert gateway.stop() == 0, gateway.logs()


def test_a_stream_cut_mid_event_ends_with_a_well_formed_error_event() -> None:
    """The relay never splices the error event into an event the upstream had only half sent."""
    from hotweights.gateway.discovery import Upstream
    from hotweights.gateway.policy import Gateway
    from hotweights.gateway.suspectguard import Tracked

    async def chunks() -> AsyncIterator[bytes]:
        yield b'ta: {"b":2}\n\ndata: {"c"'
        raise httpx.ReadError("connection reset")

    async def relayed() -> bytes:
        gateway = Gateway([], interval_s=1.0, timeout_s=1.0, queue_limit=1, hold_s=1.0)
        try:
            tracked = Tracked("digest", 0, "client")
            relay = gateway.relay(Upstream("http://x"), b'data: {"a":1}\n\nda', chunks(), True, tracked)
            return b"".join([chunk async for chunk in relay])
        finally:
            await gateway.client.aclose()
            await gateway.probe_client.aclose()

    events = asyncio.run(relayed()).decode().split("\n\n")
    assert events[-1] == "", "the relayed bytes do not end at an event boundary"
    payloads = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert payloads[:2] == [{"a": 1}, {"b": 2}]
    assert "failed mid-response" in payloads[2]["error"]["message"]


class ThreadedUpstreams:
    """Fake engines, each a ``ThreadingHTTPServer`` in ``servers``, served on threads while ``running``."""

    servers: list[ThreadingHTTPServer]

    @contextlib.contextmanager
    def running(self) -> Iterator[Self]:
        threads = [threading.Thread(target=server.serve_forever, daemon=True) for server in self.servers]
        for thread in threads:
            thread.start()
        try:
            yield self
        finally:
            for server in self.servers:
                server.shutdown()
                server.server_close()


class FakeEngine(BaseHTTPRequestHandler):
    """A fake engine's request handler: HTTP/1.1, quiet, ``reply`` sends a whole JSON answer."""

    protocol_version = "HTTP/1.1"

    def reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in {"content-type": "application/json", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class CutUpstreams(ThreadedUpstreams):
    """Two upstreams on threads: A is primary until it answers a completion with its headers and the first
    bytes of its body, then closes the connection (a partition mid-reply); from then on B is, and serves."""

    def __init__(self) -> None:
        self.cut = threading.Event()
        self.received: list[dict[str, str]] = []  # each completion's request headers
        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), self.handler(name)) for name in ("a", "b")]
        self.urls = [f"http://127.0.0.1:{server.server_address[1]}" for server in self.servers]

    def handler(self, name: str) -> type[BaseHTTPRequestHandler]:
        upstreams = self

        class Handler(FakeEngine):
            def do_GET(self) -> None:  # /primary
                self.reply(200 if (name == "b") == upstreams.cut.is_set() else 503, b"{}")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                upstreams.received.append({k.lower(): v for k, v in self.headers.items()})
                if name == "b":
                    self.reply(200, json.dumps({"choices": [{"text": "from b"}]}).encode())
                    return
                upstreams.cut.set()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "64")
                self.end_headers()
                self.wfile.write(b'{"choi')
                self.wfile.flush()
                self.close_connection = True

        return Handler


def test_a_reply_cut_before_its_whole_body_is_retried_on_the_next_primary(tmp_path: Path) -> None:
    """Nothing of a non-streamed reply reaches the client before its whole body did: the cut one is re-sent. A
    client's replay count, which only the gateway sets, reaches no engine, migratable request or not."""
    config = write_cluster(tmp_path / "cluster.toml", [])
    with CutUpstreams().running() as upstreams:
        a, b = upstreams.urls
        with GatewayProcess(config, "--upstream", a, "--upstream", b) as gateway:
            gateway.wait_health(lambda h: [u["is_primary"] for u in h["upstreams"]] == [True, False], what="a primary")
            replay = {REPLAY_HEADER: "1"}
            response = gateway.client.post(Endpoint.COMPLETIONS, json={"prompt": "x"}, headers=replay)
            assert upstreams.cut.is_set()
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == "from b"
            assert response.headers["x-hotweights-upstream"] == b
            assert metric(gateway, "hotweights_gateway_retries_total") >= 1
            before = len(upstreams.received)  # the cut one's tries
            relayed = gateway.client.post(Endpoint.COMPLETIONS, json={"prompt": ["x", "y"]}, headers=replay)
            assert relayed.status_code == 200, relayed.text
            assert len(upstreams.received) == before + 1
            assert not [h for h in upstreams.received if REPLAY_HEADER in h], upstreams.received


class FullUpstreams(ThreadedUpstreams):
    """Two primaries on threads that answer every completion 429, expecting to queue one again in a second
    (``ADMITS_IN_HEADER``); each completion's request headers in ``received``."""

    def __init__(self) -> None:
        self.received: list[dict[str, str]] = []
        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), self.handler()) for _ in range(2)]
        self.urls = [f"http://127.0.0.1:{server.server_address[1]}" for server in self.servers]

    def handler(self) -> type[BaseHTTPRequestHandler]:
        received = self.received

        class Handler(FakeEngine):
            def do_GET(self) -> None:  # /primary
                self.reply(200, b"{}")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                received.append({k.lower(): v for k, v in self.headers.items()})
                body = json.dumps({"error": {"message": "overloaded: upstream", "type": "overloaded", "param": None}})
                self.reply(429, body.encode(), {"retry-after": "1", ADMITS_IN_HEADER: "1000"})

        return Handler


@pytest.mark.unit
@pytest.mark.parametrize(
    ("admits_in_ms", "full_s"),
    [(None, FULL_MIN_S), ("0", FULL_MIN_S), ("20", FULL_MIN_S), ("300", 0.3), ("99999", FULL_MAX_S), ("x", FULL_MIN_S)],
)
def test_an_engine_that_refused_gets_no_fresh_request_for_as_long_as_it_says_within_bounds(
    admits_in_ms: str | None, full_s: float
) -> None:
    """At least ``FULL_MIN_S`` (an engine refuses only with its queue budget's worth waiting), at most a second."""
    upstream = Upstream("http://127.0.0.1:1")
    before = time.monotonic()
    refused(upstream, httpx.Response(429, headers={ADMITS_IN_HEADER: admits_in_ms} if admits_in_ms else {}))
    assert upstream.full_until - before == pytest.approx(full_s, abs=0.01)


def test_engines_that_refused_get_no_fresh_request_until_they_expect_to_queue_one(tmp_path: Path) -> None:
    """Each full primary's 429 is relayed with its Retry-After; while both expect to queue nothing (their
    ``ADMITS_IN_HEADER``), the gateway answers fresh completions 429 itself (a GET still goes through) and counts
    them; once that time has passed, an engine gets a completion again."""
    config = write_cluster(tmp_path / "cluster.toml", [])
    with FullUpstreams().running() as upstreams:
        urls = [arg for url in upstreams.urls for arg in ("--upstream", url)]
        with GatewayProcess(config, *urls) as gateway:
            gateway.wait_health(lambda h: len(h["primaries"]) == 2, what="two primaries")
            relayed = [gateway.client.post(Endpoint.COMPLETIONS, json={"prompt": "x"}) for _ in "ab"]
            assert [r.status_code for r in relayed] == [429, 429]
            assert [r.headers.get("retry-after") for r in relayed] == ["1", "1"]
            assert {r.headers["x-hotweights-upstream"] for r in relayed} == set(upstreams.urls)  # the open one first
            refused = 0
            while len(upstreams.received) == 2:  # until the first engine's second has passed
                answer = gateway.client.post(Endpoint.COMPLETIONS, json={"prompt": "x"})
                assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
                if len(upstreams.received) == 2:
                    assert "every primary engine is full" in answer.json()["error"]["message"], answer.text
                    refused += 1
                    if refused == 1:  # what is not a completion still goes through; health says who is full
                        assert gateway.client.get(Endpoint.MODELS).status_code == 200
                        assert all(u["full_for_ms"] > 0 for u in gateway.health()["upstreams"])
            assert refused > 0
            assert metric(gateway, "hotweights_gateway_admission_total", verdict="refused") == refused
            timed = "hotweights_gateway_refusal_seconds_count"  # each refusal timed, by who refused it
            assert metric(gateway, timed, by="gateway") == refused
            assert metric(gateway, timed, by="engine") == len(upstreams.received)
            # every request through the handler timed from its arrival at the worker, a refusal's included
            assert metric(gateway, "hotweights_gateway_wait_seconds_count") >= refused + 3


class Load:
    """Sequential completions through the gateway on a thread, plain and (while ``streams``) streamed in
    turn; ``failures`` lists what any client would have seen go wrong."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=30.0)
        self.streams = True
        self.failures: list[str] = []
        self.latencies: list[float] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        while not self.done.is_set():
            started = time.monotonic()
            try:
                failure = self.one(stream=self.streams and len(self.latencies) % 2 == 1)
            except httpx.HTTPError as exc:
                failure = repr(exc)
            self.latencies.append(time.monotonic() - started)
            if failure:
                self.failures.append(failure)

    def one(self, stream: bool) -> str:
        body = {"prompt": "load", "max_tokens": 8, "stream": stream}
        with self.client.stream("POST", Endpoint.COMPLETIONS, json=body) as response:
            text = response.read().decode()
        if response.status_code != 200:
            return f"{response.status_code}: {text}"
        if stream and not text.rstrip().endswith("data: [DONE]"):
            return f"stream without [DONE]: {text[-200:]}"
        return ""

    @contextlib.contextmanager
    def running(self) -> Iterator[Load]:
        self.thread.start()
        try:
            yield self
        finally:
            self.done.set()
            self.thread.join(timeout=60)
            self.client.close()


def served_more(load: Load, n: int) -> None:
    """Wait until the load has completed ``n`` more requests (its progress, not a time, marks each phase)."""
    count = len(load.latencies)
    wait_until(lambda: len(load.latencies) >= count + n, timeout=60, what=f"{n} more requests served")


def test_failovers_under_load_show_no_client_errors(engines: list[EngineProcess], gateway: GatewayProcess) -> None:
    """A planned flip (demote, then promote), then a crash (kill -9, then promote as a controller would):
    every request of a sequential load through the gateway succeeds (streamed ones too, until the crash),
    and a stream cut by the crash goes on on the new primary to ``[DONE]``. Kills an engine."""
    primary, standby = roles(engines)
    with Load(gateway.url).running() as load:
        served_more(load, 5)
        assert primary.post(Endpoint.DEMOTE).status_code == 200
        assert standby.post(Endpoint.PROMOTE).status_code == 200
        served_more(load, 5)
        with gateway.client.stream("POST", Endpoint.COMPLETIONS, json=LONG_STREAM) as cut:
            lines = (line for line in cut.iter_lines() if line)
            assert next(lines).startswith("data: {")
            standby.process.kill()
            standby.process.wait()
            assert primary.post(Endpoint.PROMOTE).status_code == 200  # as a controller would, once it fenced
            rest = list(lines)
        served_more(load, 5)
    retries = metric(gateway, "hotweights_gateway_retries_total")
    print(
        f"{len(load.latencies)} requests, {len(load.failures)} client-visible errors, {retries:.0f} retries, "
        f"longest request {max(load.latencies) * 1000:.0f} ms"
    )
    assert load.failures == []
    # The stream under way at the crash was migrated (the crash was met, not missed): it ends as any other does.
    # (A load request may or may not have been on the killed engine at that instant: retries are not asserted.)
    assert rest[-1] == "data: [DONE]"
    assert metric(gateway, "hotweights_gateway_migrations_total") >= 1


def test_wake_needs_the_token_when_the_cluster_has_one(tmp_path: Path) -> None:
    """POST /gateway/wake is the gateway's one mutation: over TCP it needs the cluster's token, like every other."""
    config = write_cluster(tmp_path / "cluster.toml", [])
    (tmp_path / "token").write_text("s3cret\n")
    (tmp_path / "token").chmod(0o600)
    config.write_text(config.read_text().replace("[cluster]\n", f'[cluster]\ntoken_file = "{tmp_path / "token"}"\n'))
    with GatewayProcess(config, "--upstream", f"http://127.0.0.1:{free_port()}") as gateway:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            refused = gateway.client.post(Endpoint.GATEWAY_WAKE, headers=headers)
            assert (refused.status_code, refused.headers["www-authenticate"]) == (401, "Bearer"), refused.text
        woken = gateway.client.post(Endpoint.GATEWAY_WAKE, headers={"Authorization": "Bearer s3cret"})
        assert woken.status_code == 204, woken.text


class DyingUpstreams(ThreadedUpstreams):
    """Three upstreams on threads, each primary until a completion reaches it; then it closes the connection as an
    engine the request itself brought down, once it started it (the headers of the stream the gateway asks for; a
    whole reply's come only with its end), before any event (``mid_stream``: after one), and stops being
    primary."""

    def __init__(self, mid_stream: bool = False) -> None:
        self.dead: set[str] = set()
        self.mid_stream = mid_stream
        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), self.handler(name)) for name in ("a", "b", "c")]
        self.urls = [f"http://127.0.0.1:{server.server_address[1]}" for server in self.servers]

    def handler(self, name: str) -> type[BaseHTTPRequestHandler]:
        dead, mid_stream = self.dead, self.mid_stream
        event = b'data: {"id":"c","choices":[{"index":0,"text":"a","token_ids":[5],"finish_reason":null}]}\n\n'

        class Handler(FakeEngine):
            def do_GET(self) -> None:  # /primary
                self.reply(503 if name in dead else 200, b"{}")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                dead.add(name)
                self.close_connection = True  # a chunked stream that never ends
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                if mid_stream:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))

        return Handler


def test_a_request_that_engines_fail_serving_is_not_resent_past_suspect_after(tmp_path: Path) -> None:
    """With gateway.suspect_after = 2, the second engine failing with the request in flight, once it started it,
    ends it: 422 saying so, counted as suspect; the third engine never sees it."""
    config = write_cluster(tmp_path / "cluster.toml", [])
    with DyingUpstreams().running() as upstreams:
        urls = [arg for url in upstreams.urls for arg in ("--upstream", url)]
        with GatewayProcess(config, *urls) as gateway:
            gateway.wait_health(lambda h: len(h["primaries"]) == 3, what="three primaries")
            response = gateway.client.post(Endpoint.COMPLETIONS, json={"prompt": "x"})
            assert response.status_code == 422, response.text
            assert response.json()["error"]["type"] == SUSPECT_REQUEST
            assert "2 engines failed while serving this request" in response.json()["error"]["message"]
            assert len(upstreams.dead) == 2
            assert metric(gateway, "hotweights_gateway_suspect_requests_total") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_cut_mid_way_on_suspect_after_engines_is_refused_as_suspect(tmp_path: Path, stream: bool) -> None:
    """A migrating completion whose stream two engines cut as they fail is not continued on the third: the
    whole reply is a 422 suspect_request, a stream ends with an error event of that type."""
    config = write_cluster(tmp_path / "cluster.toml", [])
    with DyingUpstreams(mid_stream=True).running() as upstreams:
        urls = [arg for url in upstreams.urls for arg in ("--upstream", url)]
        with GatewayProcess(config, *urls) as gateway:
            gateway.wait_health(lambda h: len(h["primaries"]) == 3, what="three primaries")
            body = {"prompt": "x", "max_tokens": 4, "stream": stream}
            response = gateway.client.post(Endpoint.COMPLETIONS, json=body)
            if stream:
                assert response.status_code == 200, response.text
                events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
                assert events[0]["choices"][0]["text"] == "a"
                error = events[-1]["error"]
            else:
                assert response.status_code == 422, response.text
                error = response.json()["error"]
            assert error["type"] == SUSPECT_REQUEST
            assert "2 engines failed while serving this request" in error["message"]
            assert len(upstreams.dead) == 2
            assert metric(gateway, "hotweights_gateway_suspect_requests_total") == 1


@pytest.mark.unit
@pytest.mark.parametrize(
    ("raised", "kind"),
    [
        (AttributeError(GONE), "connect"),  # httpcore's look at a connection whose socket went: never sent
        (httpx.ConnectError("refused"), "connect"),
        (httpx.ReadError("reset"), "disconnected"),
        (AttributeError("'X' object has no attribute 'y'"), None),  # any other: a bug, raised as it is
    ],
)
def test_a_connection_that_fails_as_it_opens_goes_to_the_next_primary_unstarted(
    raised: Exception, kind: str | None
) -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise raised

    async def send() -> UpstreamFailed | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(fail)) as client:
            outgoing = client.build_request("POST", "http://127.0.0.1:1/v1/completions", json={})
            try:
                await opened(client, Upstream("http://127.0.0.1:1"), outgoing, streamed=True)
            except UpstreamFailed as exc:
                return exc
        return None

    if kind is None:
        with pytest.raises(AttributeError):
            asyncio.run(send())
        return
    failed = asyncio.run(send())
    assert failed is not None and failed.kind == kind
    assert not failed.started  # a stream whose headers never came: not yet started (controller.suspects)
