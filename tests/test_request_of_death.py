"""A request that kills or stalls every engine it reaches, sent through real gateway processes in front of real
engine processes (``tests/deadly_engine.py``): it costs at most ``gateway.suspect_after`` (2) engines however
often it is sent, through whichever gateway worker; its client is refused for a while; the others are served."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from hotweights.contract import SUSPECT_REQUEST, Endpoint
from hotweights.gateway.answers import SUSPECT_CLIENT
from hotweights.ports import free_port
from tests.cachehelpers import wait_until
from tests.deadly_engine import DEADLY
from tests.enginehelpers import ChildService
from tests.gatewayhelpers import GatewayProcess, metric, write_cluster

ENGINES = 4
CHAT = (Endpoint.CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": DEADLY}]})  # no budget: not migrated
COMPLETION = (Endpoint.COMPLETIONS, {"prompt": DEADLY, "max_tokens": 4})  # migrated when cut mid-way
OTHER_CLIENT = {"Authorization": "Bearer another-client"}
HOLD_S = 1.0  # gateway.hold_timeout_s where a request waits in a queue longer


class DeadlyEngine(ChildService):
    name = "deadly-engine"
    ready_path = Endpoint.PRIMARY

    def __init__(self, mode: str) -> None:
        self.port = free_port()
        command = [sys.executable, str(Path(__file__).with_name("deadly_engine.py")), str(self.port), mode]
        super().__init__(command, f"http://127.0.0.1:{self.port}")

    @property
    def dead(self) -> bool:
        return self.process.poll() is not None

    def is_stalled(self) -> bool:
        """Whether it let a health check go unanswered for 0.5 s (as the controller checks)."""
        try:
            self.client.get(Endpoint.PRIMARY, timeout=0.5)
        except httpx.TimeoutException:
            return True
        except httpx.TransportError:
            return False
        return False


@contextlib.contextmanager
def deadly_engines(mode: str, count: int = ENGINES) -> Iterator[list[DeadlyEngine]]:
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(DeadlyEngine(mode)) for _ in range(count)]
        yield engines


@contextlib.contextmanager
def fencing(engines: list[DeadlyEngine]) -> Iterator[None]:
    """SIGKILL every engine that stops answering its health checks, as the controller fences a stalled primary."""
    done = threading.Event()

    def fence() -> None:
        while not done.is_set():
            for engine in engines:
                if not engine.dead and engine.is_stalled():
                    engine.process.kill()
                    engine.process.wait()

    thread = threading.Thread(target=fence, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=30)


def suspect_error(response: httpx.Response, status: int, kind: str = SUSPECT_REQUEST) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind, error
    return error["message"]


def served(gateway: GatewayProcess, headers: dict[str, str] | None = None) -> bool:
    response = gateway.client.post(Endpoint.COMPLETIONS, json={"prompt": "hello", "max_tokens": 2}, headers=headers)
    return response.status_code == 200 and response.json()["choices"][0]["text"] == "x"


@pytest.mark.parametrize(("path", "body"), [CHAT, COMPLETION], ids=["chat", "completion"])
def test_a_request_that_kills_engines_costs_two_whichever_worker_it_is_sent_through(
    tmp_path: Path, path: str, body: dict
) -> None:
    """Two gateway workers share one state dir: the request kills the engine it reaches and the one it is re-sent
    to, then is refused (422); the same body through the other worker is refused at once and reaches no engine;
    the client that sent it is refused for a while (429), whatever it sends; another client is served."""
    with deadly_engines("kill") as engines:
        config = write_cluster(tmp_path / "cluster.toml", [e.port for e in engines])
        with GatewayProcess(config) as one, GatewayProcess(config) as two:
            for gateway in (one, two):
                gateway.wait_health(lambda h: len(h["primaries"]) == ENGINES, what="every engine primary")
            message = suspect_error(one.client.post(path, json=body), 422)
            assert "2 engines failed while serving this request" in message
            wait_until(lambda: sum(e.dead for e in engines) == 2, 30, "the two engines it reached dead")
            message = suspect_error(two.client.post(path, json=body, headers=OTHER_CLIENT), 422)
            assert "this same body" in message  # refused on arrival: it reached no engine
            message = suspect_error(two.client.post(path, json=body | {"user": "new"}), 429, SUSPECT_CLIENT)
            assert "this client's requests" in message
            assert served(two, OTHER_CLIENT) and served(one, OTHER_CLIENT)
            assert metric(one, "hotweights_gateway_suspect_requests_total", rule="failures") == 1
            assert metric(two, "hotweights_gateway_suspect_requests_total", rule="body") == 1
            assert metric(two, "hotweights_gateway_suspect_requests_total", rule="client") == 1
            assert "sha256" in two.logs() and DEADLY not in one.logs() + two.logs()
        assert sum(e.dead for e in engines) == 2


STREAM = (Endpoint.COMPLETIONS, COMPLETION[1] | {"stream": True})


@pytest.mark.parametrize(("path", "body"), [CHAT, STREAM], ids=["before-headers", "mid-stream"])
def test_a_request_that_stalls_engines_costs_two(tmp_path: Path, path: str, body: dict) -> None:
    """A stall counts as a failure: the engine stops answering (the gateway's probes time out, the controller's
    fence kills it, played here by the test), whether before its answer began or mid-stream (then the gateway moves
    the stream at once, its probe unanswered)."""
    with deadly_engines("stall") as engines, fencing(engines):
        config = write_cluster(tmp_path / "cluster.toml", [e.port for e in engines])
        with GatewayProcess(config) as gateway, ThreadPoolExecutor(1) as pool:
            gateway.wait_health(lambda h: len(h["primaries"]) == ENGINES, what="every engine primary")
            response = pool.submit(gateway.client.post, path, json=body).result(timeout=60)
            if body.get("stream"):  # its first event was relayed: it ends with an error event
                assert response.status_code == 200, response.text
                last = json.loads(response.text.strip().splitlines()[-1].removeprefix("data: "))
                assert last["error"]["type"] == SUSPECT_REQUEST, response.text
            else:
                suspect_error(response, 422)
            suspect_error(gateway.client.post(path, json=body, headers=OTHER_CLIENT), 422)
            assert served(gateway, OTHER_CLIENT)
            wait_until(lambda: sum(e.dead for e in engines) >= 2, 30, "the stalled engines fenced")
            assert not any(e.is_stalled() for e in engines if not e.dead)
            assert sum(e.dead for e in engines) == 2, gateway.logs()


def test_engines_that_fail_while_a_request_waits_in_their_queue_do_not_make_it_suspect(tmp_path: Path) -> None:
    """An engine sends a stream's headers only once it starts the request: two primaries killed in turn while a
    completion waits in their queues, before its headers, had not started it, so it is not refused as suspect
    (what two failures with it in flight would do) but served by the third, and counts against nothing. Each
    waited there past the gateway's hold timeout: a failure gives it a hold of its own."""
    with deadly_engines("queue", count=3) as engines:
        config = write_cluster(tmp_path / "cluster.toml", [e.port for e in engines], hold_timeout_s=HOLD_S)
        with GatewayProcess(config) as gateway, ThreadPoolExecutor(1) as pool:
            gateway.wait_health(lambda h: len(h["primaries"]) == 3, what="every engine primary")
            answer = pool.submit(gateway.client.post, Endpoint.COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
            for _ in range(2):
                wait_until(lambda: any(waiting(e) for e in engines), 30, "the completion waiting in a queue")
                holder = next(e for e in engines if waiting(e))
                time.sleep(HOLD_S)  # the scenario: it waits in that queue past its hold timeout
                holder.process.kill()
                holder.process.wait()
                assert not answer.done(), answer.result().text
            response = answer.result(timeout=60)
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == "x", response.text
            assert metric(gateway, "hotweights_gateway_suspect_requests_total") == 0


def waiting(engine: DeadlyEngine) -> bool:
    """Whether a stream waits in ``engine``'s queue (False once it is dead)."""
    return not engine.dead and engine.client.get(Endpoint.PRIMARY).json()["waiting"] > 0
