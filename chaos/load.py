"""Steady client load through a load balancer, with every request's client-visible outcome recorded.

Open loop: a request starts every ``1 / rps`` seconds whether or not earlier ones have answered, as
real clients do, so an outage shows up as failed or slow requests instead of as fewer requests. Every
request is the same short greedy completion; its text is compared with a reference taken before the
first fault, which checks that no engine ever serves from wrong weights. The generator never retries:
what it records is what a client would have seen (retries inside the gateway are counted by the
gateway's metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx

from hotweights.contract import SUSPECT_REQUEST, Endpoint

PROMPT = "The quick brown fox"
MAX_TOKENS = 8
STREAM_EVERY = 2  # a drill streams every other request
BROKEN_STREAM = "broken stream"  # how a record of a stream cut mid-way begins its error
SUSPECT = "suspect"  # how a record of a request the gateway refused as suspect begins its error


@dataclass(frozen=True)
class RequestRecord:
    start: float  # time.time()
    end: float
    status: int | None  # None: no HTTP answer (connect error, reset, timeout)
    error: str  # "" for a correct 200
    correct: bool | None  # None: no completion to compare
    text: str = ""  # the completion of a 200
    streamed: bool = False  # asked as a stream

    @property
    def broken_stream(self) -> bool:
        """A stream that began (200) and did not end with ``[DONE]``: cut mid-way."""
        return self.streamed and self.status == 200 and self.error.startswith(BROKEN_STREAM)

    @property
    def suspect(self) -> bool:
        """Refused by the gateway because engines failed while serving it (gateway.suspect_after)."""
        return self.error.startswith(SUSPECT)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.correct is True


@contextlib.asynccontextmanager
async def in_background(work: Coroutine[Any, Any, object]) -> AsyncIterator[None]:
    """Run ``work`` as a task for the duration of the block; on exit cancel it and wait until it has ended."""
    task = asyncio.create_task(work)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def completion_body(max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}


async def reference_completion(
    client: httpx.AsyncClient, base_url: str, timeout_s: float = 60.0, max_tokens: int = MAX_TOKENS
) -> str:
    """The greedy completion the cluster gives now; retried until it answers, since the stack may be starting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = await client.post(base_url + Endpoint.COMPLETIONS, json=completion_body(max_tokens))
            if response.status_code == 200:
                return response.json()["choices"][0]["text"]
            failure = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            failure = f"{type(exc).__name__} {exc}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"no reference completion from {base_url} within {timeout_s} s: {failure}")
        await asyncio.sleep(0.2)


def refusal_text(body: str) -> str:
    """A failed answer's body as a record's error: led by ``SUSPECT`` when it is the gateway's suspect refusal."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        error = json.loads(body)["error"]
        if error["type"] == SUSPECT_REQUEST:
            return f"{SUSPECT}: {error['message']}"[:300]
    return body[:300]


class LoadGenerator:
    """``rps`` greedy completions of ``max_tokens`` a second through ``base_url``; each answer is correct when it is
    ``reference`` or one of ``also`` (a model update's other weights). With ``stream_every`` N > 0 every
    Nth request is streamed; one that does not end with ``[DONE]`` is a broken stream."""

    def __init__(
        self,
        base_url: str,
        rps: float,
        reference: str,
        timeout_s: float = 30.0,
        also: tuple[str, ...] = (),
        stream_every: int = 0,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.body = completion_body(max_tokens)
        self.stream_every = stream_every
        self.started = 0
        self.rps = rps
        self.reference = reference
        self.also = also
        self.timeout_s = timeout_s
        self.records: list[RequestRecord] = []
        self.in_flight: set[asyncio.Task] = set()

    async def run(self, client: httpx.AsyncClient) -> None:
        """Start one request per tick until cancelled; missed ticks (a stalled loop) are not made up."""
        interval = 1.0 / self.rps
        next_start = time.monotonic()
        while True:
            task = asyncio.create_task(self.one(client))
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)
            next_start = max(next_start + interval, time.monotonic())
            await asyncio.sleep(next_start - time.monotonic())

    async def one(self, client: httpx.AsyncClient) -> None:
        self.started += 1
        streamed = self.stream_every > 0 and self.started % self.stream_every == 0
        start = time.time()
        status, correct, error, text = None, None, "", ""
        try:
            read = self.read_stream if streamed else self.read_whole
            status, text, error = await read(client)
            if status == 200 and not error:
                correct = text == self.reference or text in self.also
                error = "" if correct else f"wrong output {text!r}, expected {self.reference!r}"
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        self.records.append(RequestRecord(start, time.time(), status, error, correct, text, streamed))

    async def read_whole(self, client: httpx.AsyncClient) -> tuple[int, str, str]:
        """(status, text, error) of a plain completion."""
        response = await client.post(self.base_url + Endpoint.COMPLETIONS, json=self.body, timeout=self.timeout_s)
        if response.status_code != 200:
            return response.status_code, "", refusal_text(response.text)
        return 200, response.json()["choices"][0]["text"], ""

    async def read_stream(self, client: httpx.AsyncClient) -> tuple[int, str, str]:
        """(status, text, error) of a streamed completion; a 200 without ``[DONE]`` is a broken stream."""
        body = self.body | {"stream": True}
        url = self.base_url + Endpoint.COMPLETIONS
        async with client.stream("POST", url, json=body, timeout=self.timeout_s) as response:
            if response.status_code != 200:
                return response.status_code, "", refusal_text((await response.aread()).decode(errors="replace"))
            text, last = "", ""
            async for line in response.aiter_lines():
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    return 200, text, ""
                if payload:
                    last = payload
                    text += "".join(choice["text"] for choice in json.loads(payload).get("choices", ()))
        if (why := refusal_text(last)).startswith(SUSPECT):
            return 200, text, why
        return 200, text, f"{BROKEN_STREAM}: no [DONE]; last event {last[:200]}"

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LoadGenerator]:
        """Load for the duration of the block; on exit, stop starting requests and let open ones finish."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        async with httpx.AsyncClient(limits=limits) as client:
            try:
                async with in_background(self.run(client)):
                    yield self
            finally:
                if self.in_flight:
                    await asyncio.wait(self.in_flight, timeout=self.timeout_s)

    def p50_ms(self, started: Callable[[float], bool]) -> float | None:
        """The median ms of the requests answered 200 whose start (wall-clock) ``started`` accepts; None if none."""
        seconds = [r.end - r.start for r in self.records if r.status == 200 and started(r.start)]
        return round(statistics.median(seconds) * 1000, 1) if seconds else None


T = TypeVar("T")


@dataclass(frozen=True)
class Loaded(Generic[T]):
    """What ``while_loaded`` gives: ``work``'s result, the load's records, and the wall-clock (start, end) of the
    quiet window and of the work."""

    result: T
    load: LoadGenerator
    quiet: tuple[float, float]
    during: tuple[float, float]

    def p50_ms(self, window: tuple[float, float]) -> float | None:
        """The load's p50 over the requests started within ``window`` (wall-clock [start, end)): ``quiet``,
        ``during``."""
        return self.load.p50_ms(lambda start: window[0] <= start < window[1])


async def while_loaded(
    url: str, rps: float, max_tokens: int, work: Callable[[], T], quiet_s: float, timeout_s: float = 120.0
) -> Loaded[T]:
    """``work()`` on a thread while ``rps`` greedy completions of ``max_tokens`` a second go to the engine or gateway at
    ``url`` (correct: its first answer, awaited up to ``timeout_s``), after ``quiet_s`` of that load alone: what a
    bench's work costs a serving engine (its p50 during the work over its p50 in the quiet window)."""
    async with httpx.AsyncClient() as client:
        reference = await reference_completion(client, url, timeout_s, max_tokens)
    load = LoadGenerator(url, rps, reference, max_tokens=max_tokens)
    async with load.running():
        quiet_from = time.time()
        await asyncio.sleep(quiet_s)  # the quiet window itself: the load runs meanwhile
        work_from = time.time()
        result = await asyncio.to_thread(work)
        work_to = time.time()
    return Loaded(result, load, (quiet_from, work_from), (work_from, work_to))


BATCH_REFUSED_PAUSE_S = 0.05  # before a batch client asks again after a refusal (which comes back at once)


@dataclass(frozen=True)
class BatchAnswer:
    sent: float  # time.time()
    answered: float
    status: int | None  # None: no HTTP answer (what failed is in ``error``)
    retry_after: str | None = None
    error: str = ""

    @property
    def suspect(self) -> bool:
        """Refused by the gateway because engines failed while serving it (gateway.suspect_after)."""
        return self.error.startswith(SUSPECT)

    @property
    def ok(self) -> bool:
        """Answered, or refused in a way a client can act on: 503 with ``Retry-After``."""
        return self.status == 200 or (self.status == 503 and self.retry_after is not None)


class BatchClient:
    """A batch engine's own client (not the load through the load balancer): one completion at a time, each
    bounded by ``timeout_s`` (a longer one is a hang), every answer recorded in ``answers``."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.answers: list[BatchAnswer] = []

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            sent = time.time()
            try:
                response = await client.post(self.url + Endpoint.COMPLETIONS, json=completion_body())
                answer = BatchAnswer(sent, time.time(), response.status_code, response.headers.get("retry-after"))
            except httpx.HTTPError as exc:
                answer = BatchAnswer(sent, time.time(), None, error=f"{type(exc).__name__}: {exc}")
            self.answers.append(answer)
            if answer.status != 200:
                await asyncio.sleep(BATCH_REFUSED_PAUSE_S)  # pacing, not waiting for an event

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[BatchClient]:
        """Asking for the duration of the block; the request in flight is dropped on exit."""
        async with httpx.AsyncClient(timeout=self.timeout_s) as client, in_background(self.run(client)):
            yield self
