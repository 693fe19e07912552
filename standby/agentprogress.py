"""Progress-based health of a vLLM or SGLang engine behind the agent: requests relayed and no token for too long.

The engine's own health endpoint answers while its engine core (vLLM's EngineCore process, SGLang's scheduler) is
stuck, so the agent judges the engine by what it relays, with the reference engine's decision (``standby.progress``:
one floor, one factor). Progress is a chunk of any relayed response (a streamed token), the end of a relayed
response, and a change of the engine's step counter (``EngineKind.step_metric``: vLLM's
``vllm:generation_tokens_total``, SGLang's ``sglang:realtime_tokens_total``, which its scheduler moves at every
prefill and decode batch), read while a request that is not streamed is pending. The requests judged are those whose
progress shows: streamed ones, and the others while that counter can be read (an SGLang without ``--enable-metrics``
or too old to have it: not).
With judged requests pending, the engine must make progress within ``stall_bound_s`` of the last progress (or of
the work's arrival after none was pending), STALL_FACTOR times what the agent expects, at least STALL_FLOOR_S:

- while some judged request waits for its first token: the prefill of the longest prompt waiting (a prefill that
  is not chunked holds every decode), expected to take what its prompts' size took to a first token here
  (``expected_prefill_s`` over sizes rounded up to powers of two, so a long prompt is allowed its long prefill),
  timed only for requests sent while no other was pending (a first token after a queue times the queue, not the
  prefill, and an overloaded engine's tokens flow anyway), and never less than a decode step;
- otherwise a decode step: the time between two chunks of one stream, averaged (none timed yet: no bound).

Nothing bounds a first token before one was timed (an engine just promoted, taking a failover's requests at once, is
not judged by its readiness completion on an idle engine: as the reference engine, it is judged once it has timed
its own). Prompt sizes are estimated without a tokenizer on the request's path: a token id counts one, a text
CHARS_PER_TOKEN characters. ``RelayWatch.watch`` judges every TICK_S, not on a tick that comes late (the agent's own
loop was held, so the chunks waiting in its sockets are no evidence); ``refusal`` is what ``/health/ready`` answers
with, so the controller fails over from the engine."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass

from hotweights.standby.progress import Progress, Shape, Step, averaged, expected_prefill_s, stall_refusal

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # a text prompt's estimated tokens: its characters over this
SMALLEST_SIZE = 16  # prompt sizes are timed in powers of two from this many tokens
TICK_S = 0.1  # how often the watcher judges the engine
LATE_TICK_S = 0.25  # a tick later than this beyond TICK_S: the agent's own loop was held, that tick judges nothing
COUNTER_INTERVAL_S = 0.25  # how often the engine's step counter is read while a request not streamed is pending
SUBJECT = "the engine"
UNITS = "request(s)"


@dataclass(eq=False)
class Relayed:
    """One request relayed to the engine and not yet ended."""

    sent: float  # time.monotonic() when the agent sent it
    tokens: int  # its prompt's size, estimated (``prompt_tokens``)
    streamed: bool
    timed: bool = False  # sent while no other judged request was pending: its time to a first token is its prefill's
    first: float | None = None  # its first chunk's arrival
    last: float | None = None  # its latest chunk's arrival


def prompt_tokens(body: object) -> int:
    """The estimated tokens of a completion's ``prompt`` or a chat's ``messages`` in a request's JSON ``body``: a token
    id counts one, a text ``CHARS_PER_TOKEN`` characters (rounded up); anything else counts nothing."""
    if not isinstance(body, dict):
        return 0
    return _tokens(body.get("prompt")) + _tokens(body.get("messages"))


def _tokens(value: object) -> int:
    if isinstance(value, str):
        return math.ceil(len(value) / CHARS_PER_TOKEN)
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    if isinstance(value, list) and value and isinstance(value[0], int):  # token ids: a long prompt costs no walk
        return len(value)
    if isinstance(value, list):
        return sum(map(_tokens, value))
    if isinstance(value, dict):  # a chat message or a content part: its text
        return _tokens(value.get("content")) + _tokens(value.get("text"))
    return 0


def size_class(tokens: int) -> Shape:
    """The prefill shape a prompt of ``tokens`` is timed under: one prompt, its size rounded up to a power of two."""
    return 1, max(SMALLEST_SIZE, 1 << max(0, tokens - 1).bit_length())


def relay_step(waiting: Iterable[Relayed], decode_s: float, first_tokens: dict[Shape, float]) -> Step | None:
    """What the engine is expected to be doing (module docstring): None while no request in ``waiting`` (the judged
    requests with no chunk yet) is, else the prefill of the longest prompt waiting, expected to take its size
    class's time to a first token (``expected_prefill_s`` of ``first_tokens``) and at least ``decode_s``; its
    expected time None when no first token was timed."""
    longest = max(waiting, key=lambda r: r.tokens, default=None)
    if longest is None:
        return None
    expected = expected_prefill_s(first_tokens, size_class(longest.tokens))
    what = f"a first token of a prompt of about {longest.tokens} tokens"
    return Step(what, longest.sent, None if expected is None else max(expected, decode_s))


def relay_progress(judged: list[Relayed], since: float, decode_s: float, first_tokens: dict[Shape, float]) -> Progress:
    """The ``Progress`` that ``stall_refusal`` judges, of the ``judged`` requests pending."""
    step = relay_step([r for r in judged if r.first is None], decode_s, first_tokens)
    return Progress(len(judged), since, step, decode_s, SUBJECT, UNITS)


def metric_total(text: str, name: str) -> float | None:
    """The sum of a Prometheus text exposition's samples of metric ``name`` (every label set); None if it has none."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")
    ]
    return sum(values) if values else None


class RelayWatch:
    """The agent's view of its engine's progress (module docstring). Everything runs on the agent's event loop."""

    def __init__(self) -> None:
        self.requests: set[Relayed] = set()
        self.since = time.monotonic()
        self.decode_s = 0.0
        self.first_tokens: dict[Shape, float] = {}  # seconds to a first token per size class, averaged
        self.counter: float | None = None  # the step counter's last reading; None: not read (or unreadable)
        self.refusal: str | None = None  # the last tick's judgement

    def judged(self) -> list[Relayed]:
        return [r for r in self.requests if r.streamed or self.counter is not None]

    def sent(self, body: object) -> Relayed:
        """A request relayed now (``body``: its JSON value); it counts from now when no judged one was pending."""
        streamed = isinstance(body, dict) and body.get("stream") is True
        relayed = Relayed(time.monotonic(), prompt_tokens(body), streamed, timed=not self.judged())
        if relayed.timed:
            self.since = relayed.sent
        self.requests.add(relayed)
        return relayed

    def moved(self, relayed: Relayed) -> None:
        """A chunk of ``relayed``'s response arrived: progress; a stream's chunks time its steps, and its first
        token if it was sent to an engine with nothing else pending."""
        now = self.since = time.monotonic()
        if relayed.streamed and relayed.first is None:
            relayed.first = now
            if relayed.timed:
                shape = size_class(relayed.tokens)
                self.first_tokens[shape] = averaged(self.first_tokens.get(shape, 0.0), now - relayed.sent)
        elif relayed.streamed and relayed.last is not None:
            self.decode_s = averaged(self.decode_s, now - relayed.last)
        relayed.last = now

    def ended(self, relayed: Relayed, finished: bool) -> None:
        """``relayed`` is no longer pending; ``finished``: its response ended (progress), else it was given up."""
        if finished:
            self.since = time.monotonic()
        self.requests.discard(relayed)

    async def relay(self, relayed: Relayed, content: AsyncIterator[bytes], streams: bool) -> AsyncIterator[bytes]:
        """``content``, each piece counted as ``relayed``'s progress, its end as ``relayed``'s; ``streams``: the
        response is an event stream (else its pieces time nothing: an error, or a whole answer)."""
        relayed.streamed = streams
        async for piece in content:
            self.moved(relayed)
            yield piece
        self.ended(relayed, finished=True)

    def judge(self, now: float) -> str | None:
        """``stall_refusal`` of the judged requests at ``now``, kept as ``refusal``; a stall's start and end are
        logged once each."""
        progress = relay_progress(self.judged(), self.since, self.decode_s, self.first_tokens)
        reason = stall_refusal(progress, now)
        if bool(reason) != bool(self.refusal):
            if reason:
                log.error("unhealthy: %s", reason)
            else:
                log.warning("the engine makes progress again")
        self.refusal = reason
        return reason

    def counted(self, value: float | None) -> None:
        """A reading of the engine's step counter (None: unreadable): a change is progress; the first reading, after
        none, starts the time of the requests it makes judged."""
        if value is not None and value != self.counter:
            self.since = time.monotonic()
        self.counter = value

    async def watch(self, read_counter: Callable[[], Awaitable[float | None]]) -> None:
        """Judge every TICK_S (a late tick judges nothing); ``read_counter`` (the engine's step counter, None when
        unreadable) read every COUNTER_INTERVAL_S while a request that is not streamed is pending, on its own so
        that a slow read delays no judgement."""
        tick = read_at = time.monotonic()
        reading: asyncio.Task | None = None
        try:
            while True:
                await asyncio.sleep(TICK_S)
                now = time.monotonic()
                late, tick = now - tick > TICK_S + LATE_TICK_S, now
                if not late:
                    self.judge(now)
                unstreamed = any(not r.streamed for r in self.requests)
                idle = reading is None or reading.done()
                if unstreamed and now >= read_at and idle:
                    reading, read_at = asyncio.create_task(self._read(read_counter)), now + COUNTER_INTERVAL_S
        finally:
            if reading is not None:
                reading.cancel()

    async def _read(self, read_counter: Callable[[], Awaitable[float | None]]) -> None:
        self.counted(await read_counter())
