"""The OpenAI completions protocol: one request's run from submitted sequences to response chunks (text via
``standby.generate.TextStream``, stop strings included); the request schemas are ``hotweights.requestschema``'s.

Nothing here knows about HTTP routing or roles; ``standby/server.py`` wires it to FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import StrEnum

from tokenizers import Tokenizer

from hotweights.requestschema import SamplingRequest
from hotweights.standby.generate import TextStream
from hotweights.standby.scheduler import Event, Finish, SamplingParams, Scheduler, Sequence


class Api(StrEnum):
    """Which OpenAI endpoint a run answers; its value is the ``object`` of a whole reply."""

    COMPLETIONS = "text_completion"
    CHAT = "chat.completion"

    @property
    def chunk_object(self) -> str:
        return "text_completion" if self is Api.COMPLETIONS else "chat.completion.chunk"

    @property
    def id_prefix(self) -> str:
        return "cmpl" if self is Api.COMPLETIONS else "chatcmpl"


class GenerationAborted(Exception):
    """A sequence ended without completing: cancelled (drain deadline, shutdown) or failed."""

    def __init__(self, finish: Finish) -> None:
        super().__init__(finish.error or f"the request was {finish.reason}")
        self.finish = finish


@dataclass
class Choice:
    index: int
    prompt_tokens: int
    text: TextStream
    sequence: Sequence
    completion_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class Piece:
    index: int
    text: str
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)  # tokens whose text is now wholly sent


@dataclass
class CompletionRun:
    """One request's choices, submitted to the scheduler at construction, consumed as ``Piece``s."""

    request: SamplingRequest
    model_name: str
    api: Api = Api.COMPLETIONS
    choices: list[Choice] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None  # seconds to the first generated token
    _events: asyncio.Queue[tuple[int, Event]] = field(default_factory=asyncio.Queue)

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.api.id_prefix}-{secrets.token_hex(12)}"

    @classmethod
    def prepare(
        cls,
        request: SamplingRequest,
        model_name: str,
        prompt_ids: list[list[int]],
        tokenizer: Tokenizer,
        stop_ids: frozenset[int],
        api: Api = Api.COMPLETIONS,
        replay: int = 0,
    ) -> CompletionRun:
        """A sequence for every prompt, which ``submit`` hands to the scheduler; ``replay``: of a single prompt, its
        last tokens fed through decode steps (``standby.scheduler.Sequence``)."""
        run = cls(request, model_name, api, prompt_ids=prompt_ids)
        loop = asyncio.get_running_loop()
        params = SamplingParams(request.max_tokens, request.temperature, request.top_p, request.seed, stop_ids)
        for index, ids in enumerate(prompt_ids):
            sequence = Sequence(ids, params, run._sink(loop, index), replay)
            run.choices.append(Choice(index, len(ids), TextStream(tokenizer, request.stop_strings), sequence))
        return run

    def submit(self, scheduler: Scheduler) -> None:
        """Hand every choice's sequence to ``scheduler``: from now on the model computes them."""
        scheduler.submit(*(choice.sequence for choice in self.choices))

    async def submitted_sse(self, scheduler: Scheduler, gather_s: float = 0.0) -> AsyncIterator[str]:
        """``sse``, the sequences submitted to ``scheduler`` as its first event is asked for: a response sends its
        headers before that, so a client that saw none knows the model had not seen the request
        (docs/engine-contract.md)."""
        self.submit(scheduler)
        async for event in self.sse(gather_s):
            yield event

    def _sink(self, loop: asyncio.AbstractEventLoop, index: int) -> Callable[[Event], None]:
        def sink(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(self._events.put_nowait, (index, event))

        return sink

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text as it is generated, choices interleaved; the last piece of each carries its finish
        reason. Raises GenerationAborted if a sequence is cancelled or fails."""
        pending = len(self.choices)
        while pending:
            index, event = await self._events.get()
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue  # ended at a stop string; later events are leftovers
            if isinstance(event, Finish):
                if event.reason not in ("stop", "length"):
                    raise GenerationAborted(event)
                choice.finish_reason = event.reason
                pending -= 1
                text = choice.text.flush()
                yield Piece(index, text, event.reason, choice.text.take_released())
                continue
            if self.first_token_s is None:
                self.first_token_s = time.perf_counter() - self.started
            choice.completion_tokens += 1
            text = choice.text.push(event)
            if choice.text.stopped:
                choice.sequence.cancel()
                choice.finish_reason = "stop"
                pending -= 1
                yield Piece(index, text, "stop", choice.text.take_released())
            elif text:
                yield Piece(index, text, token_ids=choice.text.take_released())

    def cancel(self) -> None:
        """Stop generating (client gone, request over); harmless for finished choices."""
        for choice in self.choices:
            choice.sequence.cancel()

    async def collect(self) -> dict:
        """The whole non-streaming response body."""
        texts = [""] * len(self.choices)
        ids: list[list[int]] = [[] for _ in self.choices]
        async for piece in self.pieces():
            texts[piece.index] += piece.text
            ids[piece.index] += piece.token_ids
        choices = [
            self._choice(c.index, texts[c.index], c.finish_reason, ids[c.index], whole=True) for c in self.choices
        ]
        return self._body(choices, Api(self.api).value, first=True) | {"usage": self.usage()}

    def _choice(
        self, index: int, text: str, finish: str | None, ids: list[int], *, whole: bool, first: bool = True
    ) -> dict:
        """One choice in this API's shape; with ``return_token_ids`` its ids, and on its first chunk
        (a completion's) its prompt's."""
        if self.api is Api.COMPLETIONS:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        elif whole:
            message = {"role": "assistant", "content": text}
            choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            delta = ({"role": "assistant"} if first else {}) | {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        if not self.request.return_token_ids:
            return choice
        prompt = {"prompt_token_ids": self.prompt_ids[index]} if first and self.api is Api.COMPLETIONS else {}
        return choice | {"token_ids": ids} | prompt

    async def sse(self, gather_s: float = 0.0) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece, optional usage chunk, then ``[DONE]``. ``gather_s`` (a gateway's
        ``GATHER_MS_HEADER``): a choice's consecutive pieces of up to that long are one chunk (a piece is held until
        the window since the chunk's first piece has passed and the next piece comes, or its choice ends)."""
        unseen = set(range(len(self.choices)))
        held: Piece | None = None
        since = 0.0
        try:
            async for piece in self.pieces():
                if held is not None and piece.index == held.index:
                    held = Piece(
                        held.index, held.text + piece.text, piece.finish_reason, held.token_ids + piece.token_ids
                    )
                else:
                    if held is not None:
                        yield self._chunk(held, unseen)
                    held, since = piece, time.monotonic()
                if held.finish_reason is not None or not gather_s or time.monotonic() - since >= gather_s:
                    yield self._chunk(held, unseen)
                    held = None
        except GenerationAborted as exc:
            if held is not None:  # what was generated before reaches the gateway, which continues from it
                yield self._chunk(held, unseen)
            yield _event({"error": {"message": str(exc), "type": "unavailable"}})
            return
        if self.request.stream_options and self.request.stream_options.include_usage:
            yield _event(self._body([], self.api.chunk_object, first=False) | {"usage": self.usage()})
        yield "data: [DONE]\n\n"

    def _chunk(self, piece: Piece, unseen: set[int]) -> str:
        """``piece`` as one event; its choice's first (``unseen`` before) carries what a first chunk does."""
        first = piece.index in unseen
        unseen.discard(piece.index)
        choice = self._choice(piece.index, piece.text, piece.finish_reason, piece.token_ids, whole=False, first=first)
        return _event(self._body([choice], self.api.chunk_object, first))

    def usage(self) -> dict[str, int]:
        prompt = sum(c.prompt_tokens for c in self.choices)
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _body(self, choices: list[dict], kind: str, first: bool) -> dict:
        """A reply or chunk; a chat's (one choice) carries its prompt's ids at the top, on its first chunk."""
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model_name, "choices": choices}
        if first and self.api is Api.CHAT and self.request.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids[0]
        return body


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
