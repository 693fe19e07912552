"""The HTTP guard and admission: the strict JSON check and the admission verdict as tables; the guard
itself in front of a real uvicorn server on a real socket (header deadline, connection cap, bodies)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from hotweights.admission import OWED_QUEUE_FACTOR, Admission, Verdict, opens_in, overloaded, starts_soon, verdict
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
@pytest.mark.parametrize(
    ("slot_free", "waiting", "queue", "starts_soon", "expected"),
    [
        (True, 0, 0, True, Verdict.ADMIT),
        (True, 5, 2, True, Verdict.ADMIT),
        (True, 0, 2, False, Verdict.ADMIT),  # a free slot serves at once, whatever the others need
        (False, 0, 2, True, Verdict.QUEUE),
        (False, 1, 2, True, Verdict.QUEUE),
        (False, 2, 2, True, Verdict.REFUSE),
        (False, 0, 0, True, Verdict.REFUSE),
        (False, 0, 2, False, Verdict.REFUSE),  # room to wait, but no slot is expected to free soon
    ],
)
def test_admission_verdict(slot_free: bool, waiting: int, queue: int, starts_soon: bool, expected: Verdict) -> None:
    assert verdict(slot_free, waiting, queue, starts_soon) is expected


@pytest.mark.unit
@pytest.mark.parametrize(
    ("remaining", "waiting", "completion_s", "share", "expected"),
    [  # a round of 10 ms
        ([30, 30, 30, 30], 0, 0.0, 0.5, True),  # nothing timed yet
        ([30, 30, 30, 30], 0, 0.32, 0.5, False),  # a wave that just began: 300 ms away, typical 320 ms
        ([30, 30, 30, 30], 0, 0.32, 1.0, True),  # the same, with a share of a whole completion
        ([30, 30, 30, 5], 0, 0.32, 0.5, True),  # one ends in 50 ms
        ([30, 30, 30, 5], 1, 0.32, 0.5, False),  # the second in line waits for a 300 ms one
        ([15, 30, 30, 30], 0, 0.32, 0.5, True),  # 150 ms: within half
        ([17, 30, 30, 30], 0, 0.32, 0.5, False),  # 170 ms
        ([30, 30], 2, 0.32, 0.5, True),  # fewer hold slots than would free one for it
    ],
)
def test_a_request_is_queued_only_when_a_slot_should_free_soon(
    remaining: list[int], waiting: int, completion_s: float, share: float, expected: bool
) -> None:
    assert starts_soon(remaining, waiting, 0.01, completion_s, share) is expected


@dataclass
class Times:
    """A scheduler's times as a test sets them (``hotweights.admission.Timing``): every ``starts_soon`` is ``soon``."""

    completion_s: float = 1.0
    soon: bool = False
    asked: list[int] = field(default_factory=list)

    def starts_soon(self, share: float, waiting: int) -> bool:
        self.asked.append(waiting)
        return self.soon

    def opens_in(self, share: float, ahead: int, queue: int) -> float | None:
        return None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("arrivals", "running", "completion_s", "queue", "expected"),
    [  # over a window of 1 s
        (100, 4, 0.0, 0, False),  # nothing timed yet
        (40, 4, 0.1, 0, False),  # exactly what 4 slots complete
        (41, 4, 0.1, 0, True),
        (41, 4, 0.1, 1, False),  # the one beyond waits in a queue of one
        (42, 4, 0.1, 1, True),
        (14, 2, 0.3, 8, False),  # a slowed engine: 6.7 a second complete, a deep queue takes the rest
        (5, 1, 0.25, 0, True),
        (3, 1, 0.25, 0, False),
    ],
)
def test_overloaded_is_more_arrivals_than_the_slots_complete_and_the_queue_holds(
    arrivals: int, running: int, completion_s: float, queue: int, expected: bool
) -> None:
    assert overloaded(arrivals, 1.0, running, completion_s, queue) is expected


@pytest.mark.unit
@pytest.mark.parametrize(
    ("remaining", "ahead", "queue", "share", "expected"),
    [  # a round of 10 ms, a typical completion of 320 ms
        ([], 0, 1, 0.5, None),  # nothing holds a slot
        ([30, 10, 20, 40], 1, 1, 0.0, 0.1),  # the queue is full: it moves up when the soonest ends
        ([30, 10, 20, 40], 3, 1, 0.0, 0.3),  # three ahead of a queue of one: the third soonest
        ([30, 10, 20, 40], 9, 1, 0.0, 0.4),  # more ahead than slots: the last one
        ([30, 30, 30, 30], 0, 1, 0.5, 0.3 - 0.16),  # room, but the slot frees within half a completion only then
        ([30, 5, 30, 30], 0, 1, 0.5, 0.0),  # the soonest is near enough already
        ([30, 30, 30, 30], 0, 1, 0.0, 0.0),  # room and no share: at once
    ],
)
def test_an_engine_says_when_it_queues_a_fresh_request_again(
    remaining: list[int], ahead: int, queue: int, share: float, expected: float | None
) -> None:
    found = opens_in(remaining, ahead, queue, 0.01, 0.32, share)
    assert found == pytest.approx(expected) if expected is not None else found is None


@pytest.mark.unit
def test_admission_refuses_at_once_when_overloaded_and_no_slot_is_expected_to_free_soon() -> None:
    async def scenario() -> tuple[str | None, list[int]]:
        times = Times()
        admission = Admission(1, 2, 5.0, share=0.5, timing=times)
        assert await admission.enter() is None  # served: not asked
        # with 2 a gateway refused: 4 arrivals in a second, where one completes and 2 wait
        return await admission.enter(refused_elsewhere=2), times.asked

    refused, asked = asyncio.run(scenario())
    assert refused is not None and "none is expected to end soon" in refused
    assert asked == [0]


@pytest.mark.unit
@pytest.mark.parametrize(("refused_elsewhere", "queued"), [(0, True), (30, False)])
def test_below_the_capacity_the_wait_share_does_not_apply(refused_elsewhere: int, queued: bool) -> None:
    """Slots that complete 10 a second: a second arrival is queued whatever its wait; with 30 more that a gateway
    refused on the server's behalf, the arrivals are beyond the capacity and the wait share refuses it."""

    async def scenario() -> tuple[str | None, list[int]]:
        times = Times(completion_s=0.1)
        admission = Admission(1, 2, 5.0, share=0.5, timing=times)
        assert await admission.enter() is None
        waiter = asyncio.create_task(admission.enter(refused_elsewhere=refused_elsewhere))
        await asyncio.sleep(0)
        admission.leave()
        return await waiter, times.asked

    answer, asked = asyncio.run(scenario())
    assert (answer is None) is queued, answer
    assert asked == ([] if queued else [0])


@pytest.mark.unit
@pytest.mark.parametrize(("owed_first", "completion_s", "queued"), [(True, 0.01, 4), (True, 1.0, 1), (False, 0.01, 1)])
def test_after_a_failover_below_the_capacity_a_burst_waits_as_deep_as_the_slots(
    owed_first: bool, completion_s: float, queued: int
) -> None:
    """Four slots and a queue of one. Just after an owed request's answer and below the capacity (slots that
    complete 400 a second), four more fresh requests wait and the fifth is refused; then, the queue found full, an
    arrival meets the queue of one: with three still waiting, it is refused. Beyond the capacity (4 a second, and 9
    arrivals), or with no failover behind it, one waits."""

    async def scenario() -> tuple[list[str | None], str | None]:
        admission = Admission(4, 1, 5.0, share=0.5, timing=Times(completion_s=completion_s, soon=True))
        if owed_first:
            assert await admission.enter(owed=True) is None
            admission.leave(owed=True)
        for _ in range(4):
            assert await admission.enter() is None
        burst = [asyncio.create_task(admission.enter()) for _ in range(5)]
        await asyncio.sleep(0)
        refused = [task.result() for task in burst if task.done()]
        admission.leave()  # the first that waits starts
        await asyncio.sleep(0)
        pressed = await admission.enter() if queued > 1 else None
        for _ in range(queued - 1):  # each that waits gets a slot
            admission.leave()
        await asyncio.gather(*burst)
        return refused, pressed

    refused, pressed = asyncio.run(scenario())
    assert len(refused) == 5 - queued and all("are waiting" in (reason or "") for reason in refused), refused
    assert queued == 1 or (pressed is not None and "4 requests are being served and 3 are waiting" in pressed)


@pytest.mark.unit
def test_owed_requests_wait_in_order_in_their_queue_and_arrivals_join_it_until_the_last_is_answered() -> None:
    """A failover's burst (owed) is queued past the short queue and the wait share, first come first served, within
    its own bound (4 x (running + queue)); a fresh request that arrives while an owed one waits or is served joins
    that queue; once the last owed request is answered, the short queue and the wait share apply again, even to
    arrivals while a fresh one that joined still waits."""

    async def scenario() -> tuple[list[str | None], list[int], str | None, str | None]:
        admission = Admission(1, 1, 5.0, share=0.5, timing=Times())
        assert await admission.enter() is None  # served, fresh
        order: list[int] = []

        async def enter(i: int, owed: bool) -> str | None:
            reason = await admission.enter(owed=owed)
            order.append(i)
            return reason

        bound = OWED_QUEUE_FACTOR * 2
        owed = [i != 3 for i in range(bound)]  # the 4th arrives fresh
        waiters = [asyncio.create_task(enter(i, owed[i])) for i in range(bound)]
        await asyncio.sleep(0)
        over = await admission.enter(owed=True)  # beyond the bound
        admission.leave()  # the fresh one served at first: the owed queue's head starts
        for i in range(bound - 1):  # each answered in turn, which starts the next
            await asyncio.sleep(0)
            admission.leave(owed[i])
        await asyncio.sleep(0)
        # the last owed request (bound - 1) holds the slot: an arrival still joins the owed queue
        late = asyncio.create_task(enter(bound, False))
        await asyncio.sleep(0)
        admission.leave(owed[bound - 1])  # the last owed one answered; the late arrival starts
        await asyncio.sleep(0)
        after = await admission.enter()  # a slot is held by a fresh request and no owed one is left
        admission.leave()
        return [await w for w in waiters] + [await late, over], order, after, await admission.enter()

    answers, order, after, fresh = asyncio.run(scenario())
    assert answers[:-1] == [None] * (OWED_QUEUE_FACTOR * 2 + 1), answers
    assert answers[-1] is not None and "1 requests are being served and 8 are waiting" in answers[-1]
    assert order == list(range(OWED_QUEUE_FACTOR * 2 + 1))
    assert after is not None and "none is expected to end soon" in after  # the short rules are back
    assert fresh is None  # and with the slot free, served


@pytest.mark.unit
@pytest.mark.parametrize(("completion_s", "drains"), [(0.001, True), (1.0, False)])
def test_after_the_last_owed_request_arrivals_join_what_is_left_of_the_burst_below_the_capacity(
    completion_s: float, drains: bool
) -> None:
    """Once the owed request is answered, two fresh ones that joined its queue are left; below the capacity, two
    more arrivals join them (a queue of one would hold only one); beyond it (a completion a second), the first meets
    the short rules and is refused."""

    async def scenario() -> list[str | None]:
        admission = Admission(1, 1, 5.0, share=0.5, timing=Times(completion_s=completion_s))
        assert await admission.enter() is None  # served, fresh
        owed = asyncio.create_task(admission.enter(owed=True))
        joined = [asyncio.create_task(admission.enter()) for _ in range(2)]
        await asyncio.sleep(0)
        admission.leave()  # the owed one starts
        assert await owed is None
        admission.leave(owed=True)  # and is answered: the first that joined starts, the second still waits
        assert await joined[0] is None
        late = [asyncio.create_task(admission.enter()) for _ in range(2)]
        await asyncio.sleep(0)
        refused = [task.result() for task in late if task.done()]  # a refusal answers at once; the queued wait
        for task in [joined[1], *(task for task in late if not task.done())]:  # each served in turn
            admission.leave()
            assert await task is None
        return refused

    refused = asyncio.run(scenario())
    if drains:
        assert refused == [], refused
    else:
        assert refused and "none is expected to end soon" in (refused[0] or ""), refused


@pytest.mark.unit
@pytest.mark.parametrize("ends", ["cancelled", "timed out"])
def test_an_owed_request_that_ends_while_queued_ends_the_catch_up(ends: str) -> None:
    """An owed request whose client goes away (or whose wait runs out) while it waits no longer counts as owed: the
    next arrival meets the short queue and the wait share again."""

    async def scenario() -> str | None:
        admission = Admission(1, 1, 0.05 if ends == "timed out" else 5.0, share=0.5, timing=Times())
        assert await admission.enter() is None  # served, fresh
        owed = asyncio.create_task(admission.enter(owed=True))
        await asyncio.sleep(0)
        if ends == "cancelled":
            owed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await owed
        else:
            assert await owed is not None
        return await admission.enter(refused_elsewhere=2)  # beyond what one slot completes and one waits

    refused = asyncio.run(scenario())
    assert refused is not None and "none is expected to end soon" in refused


@pytest.mark.unit
def test_a_queued_request_reports_how_long_it_waited_for_its_slot() -> None:
    async def scenario() -> list[float]:
        waits: list[float] = []
        admission = Admission(1, 1, 5.0, on_wait=waits.append)
        assert await admission.enter() is None  # served at once: no wait reported
        waiter = asyncio.create_task(admission.enter())
        await asyncio.sleep(0.05)  # the time it waits
        admission.leave()
        assert await waiter is None
        return waits

    waits = asyncio.run(scenario())
    assert len(waits) == 1 and 0.05 <= waits[0] < 5.0, waits


@pytest.mark.unit
def test_short_cuts_long_values_and_says_how_long() -> None:
    assert short("abc") == "abc"
    assert short("x" * 1000, 10) == "xxxxxxxxxx... (1000 characters)"


@pytest.mark.unit
def test_admission_serves_queues_then_refuses_and_a_wait_runs_out() -> None:
    async def scenario() -> list[str | None]:
        seen: list[Verdict] = []
        admission = Admission(1, 1, 0.05, seen.append)
        assert await admission.enter() is None  # served
        waiter = asyncio.create_task(admission.enter())
        await asyncio.sleep(0)
        refused = await admission.enter()  # the queue is full
        timed_out = await waiter  # nobody left
        admission.leave()
        again = await admission.enter()
        assert seen == [Verdict.ADMIT, Verdict.QUEUE, Verdict.REFUSE, Verdict.REFUSE, Verdict.ADMIT]
        return [refused, timed_out, again]

    refused, timed_out, again = asyncio.run(scenario())
    assert refused is not None and "1 requests are being served and 1 are waiting" in refused
    assert timed_out is not None and "within 0.05 s" in timed_out
    assert again is None


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
