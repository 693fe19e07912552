"""The HTTP guard: the strict JSON check as a table; the guard itself in front of a real uvicorn server on a real
socket (header deadline, connection cap, bodies). Admission: ``tests/test_admission.py``."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from hotweights.httpguard import ErrorShape, HttpLimits, json_refusal, server_config, short

pytestmark = pytest.mark.timeout(60)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b'{"a": 1, "b": [1.5, "x", null, true]}', None),
        (b'{"prompt": "\\ud83d\\ude00"}', None),  # a surrogate pair is one character
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b'{"a": Infinity}', "Infinity is not a JSON number"),
        (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"a": 1e999}', "out of range"),
        (b'{"a": 123456789012345678901234567890}', "out of range (64 bits)"),
        (b'{"a": ' + b"9" * 5000 + b"}", "out of range (64 bits)"),
        (b"[" * 40 + b"]" * 40, "nested deeper than 32 levels"),
        (b"[" * 100000 + b"]" * 100000, "nested deeper than 32 levels"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b'{"a": "\xff"}', "not UTF-8 (byte 7)"),
        (b'{"prompt": "\\ud800"}', "lone surrogate"),
        (b'{"\\udfff": 1}', "lone surrogate"),
        (b'{"a": ', "invalid JSON: Expecting value"),
        (b'{"prompt": [' + b"1," * (1 << 18) + b"1]}", "more than the 262144 a body may"),
        (b'{"prompt": [' + b"1," * ((1 << 18) - 1) + b"1]}", None),
        (b'{"prompt": "' + b"1," * (1 << 19) + b'"}', None),  # commas inside a string are no values
    ],
)
def test_json_refusal_names_what_is_not_plain_json(body: bytes, problem: str | None) -> None:
    refusal = json_refusal(body)
    if problem is None:
        assert refusal is None
    else:
        assert refusal is not None and problem in refusal, refusal
        assert len(refusal) < 200


@pytest.mark.unit
def test_short_cuts_long_values_and_says_how_long() -> None:
    assert short("abc") == "abc"
    assert short("x" * 1000, 10) == "xxxxxxxxxx... (1000 characters)"


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"got": len(await request.body())})


LIMITS = HttpLimits(body_bytes=1000, body_timeout_s=0.5, header_timeout_s=0.3, max_connections=4)


@contextlib.contextmanager
def serving() -> Iterator[str]:
    """A real uvicorn, guarded with small limits, on a thread of this process: its URL."""
    app = Starlette(routes=[Route("/echo", echo, methods=["POST", "GET"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = server_config(app, LIMITS, ErrorShape.OPENAI, host="127.0.0.1", port=port, lifespan="off")
    config.log_level = "warning"
    instance = uvicorn.Server(config)
    instance.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=instance.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    with httpx.Client() as client:
        for _ in range(500):
            with contextlib.suppress(httpx.HTTPError):
                client.get(url + "/echo")
                break
            threading.Event().wait(0.01)
    try:
        yield url
    finally:
        instance.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving() as url:
        yield url


@pytest.fixture
def own_server() -> Iterator[str]:
    """A server of the test's own: the cap tests count every connection it has open."""
    with serving() as url:
        yield url


def raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=5)
    return conn


def closed_by_server(conn: socket.socket) -> bool:
    """Whether the server closed ``conn`` (an end of stream, or a reset from an abort) before it answered."""
    try:
        return conn.recv(100) == b""
    except ConnectionResetError:
        return True


def reply(conn: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_body_over_the_limit_is_413_before_it_is_read(server: str) -> None:
    with raw(server) as conn:  # announces 10 MB and sends none of it
        conn.sendall(
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 10000000\r\n\r\n"
        )
        status, body = reply(conn)
    assert status == 413 and "limit of 1000 bytes" in body["error"]["message"]


def test_a_chunked_body_is_counted_as_it_arrives(server: str) -> None:
    with raw(server) as conn:  # never ends: refused once past the limit
        conn.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        conn.sendall(b"400\r\n" + b"1" * 1024 + b"\r\n")
        status, _ = reply(conn)
    assert status == 413


def test_a_body_that_does_not_arrive_in_time_is_408(server: str) -> None:
    with raw(server) as conn:
        conn.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n12")
        status, body = reply(conn)
    assert status == 408 and "within 0.5 s" in body["error"]["message"]


@pytest.mark.parametrize(
    "body", [b'{"a": NaN}', b'{"a": 1e999}', b'{"a": 1, "a": 1}', b'{"a": "\\ud800"}', b'{"a": "\xff"}', b"[" * 200]
)
def test_bodies_that_are_not_plain_json_are_400(server: str, body: bytes) -> None:
    response = httpx.post(server + "/echo", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(("invalid JSON", "the body"))


def test_plain_bodies_reach_the_app(server: str) -> None:
    assert httpx.post(server + "/echo", json={"a": [1, 2]}).json() == {"got": 11}
    assert httpx.post(server + "/echo", content=b"\xff" * 10, headers={"content-type": "text/plain"}).json() == {
        "got": 10
    }


def test_headers_that_do_not_arrive_in_time_close_the_connection(server: str) -> None:
    with raw(server) as conn:
        conn.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\n")  # never finishes its headers
        assert conn.recv(100) == b""  # closed by the server, well before the socket's 5 s timeout


def test_at_the_cap_a_new_connection_takes_the_place_of_the_one_waiting_longest_for_headers(own_server: str) -> None:
    """Slow clients (headers never finished) fill the cap: a new client is served, the oldest slow one goes."""
    server = own_server
    slow = [raw(server) for _ in range(LIMITS.max_connections)]
    try:
        for conn in slow:
            conn.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\n")
        with httpx.Client(base_url=server) as client:
            assert client.post("/echo", json=1).status_code == 200
        assert closed_by_server(slow[0])  # evicted for the newcomer, before its header deadline
    finally:
        for conn in slow:
            conn.close()


def test_at_the_cap_with_every_connection_mid_request_the_new_one_is_closed(own_server: str) -> None:
    """Connections whose requests are under way (headers in, body awaited) are never evicted."""
    busy = [raw(own_server) for _ in range(LIMITS.max_connections)]
    try:
        for conn in busy:  # each request under way once the handler asks for its body: 100 Continue
            conn.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\nexpect: 100-continue\r\n\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1 100 ")
        refused = raw(own_server)
        assert closed_by_server(refused)  # accepted and closed at once
        refused.close()
        for conn in busy:
            conn.sendall(b"1234567890")
            assert reply(conn)[0] == 200
    finally:
        for conn in busy:
            conn.close()


def test_the_cap_is_at_most_half_the_open_files_limit() -> None:
    """In a child (the limit is per process): soft 200 -> a cap of 100, whatever was asked."""
    script = (
        "import resource; hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard)); "
        "from hotweights.httpguard import connection_cap; print(connection_cap(4096), connection_cap(50))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == ["100", "50"]
