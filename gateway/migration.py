"""Request migration: what a completion has sent its client, and how it continues on another engine.

The gateway asks the engine for a stream with token ids (``return_token_ids``, as vLLM names it; the
reference engine speaks the same): every chunk of a choice carries ``token_ids`` and its first chunk
``prompt_token_ids``. A ``Ledger`` keeps, for the one choice of a request, the prompt ids, the tokens
released so far and how many characters came back beyond their text (an engine may send a token's
text in pieces). When the upstream fails mid-way the request goes to the next primary as a completion
of ``prompt ids + released ids`` with the budget left (the last tokens whose text has not come back
at all are generated again, not replayed); the ledger drops the first characters that came back
before the cut, rewrites the chunks to the first segment's id and creation time, and counts
``usage`` over the whole request.

Exactness: greedy decoding, and sampling with a ``seed`` (each token draws from a seed derived from
the request's seed and its position, ``standby.sampling.token_seed``), continue with exactly the tokens
of an uninterrupted run. Stop strings are applied here, on the text as it comes back (``StopStrings``),
and the engine is asked without them: no engine holds text back for them, and one met across the cut
is found like any other.

The fields the gateway reads or rewrites (the sampling fields, a completion's prompt) are validated first, with the
engines' own definitions (``hotweights.requestschema``), so that the gateway refuses what an engine would, in the
same words: a stop string it applies itself, or a ``stream`` it overrides, never escapes the engine's limits. The
other fields reach the engine as the client sent them, and it judges them.

Nothing here does I/O: ``gateway.policy`` sends the requests.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum

from hotweights.contract import CHAT_KEYS, CHAT_ONLY, Endpoint, choice_text
from hotweights.requestschema import (
    DEFAULT_MAX_TOKENS,
    INLINE_BODY_BYTES,
    CompletionRequest,
    Invalid,
    SamplingRequest,
    validated,
)

TOKEN_FIELDS = ("token_ids", "prompt_token_ids")  # what the gateway asks for, hidden unless the client did
FORCED = {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
CHECKED = {Endpoint.COMPLETIONS: CompletionRequest, Endpoint.CHAT_COMPLETIONS: SamplingRequest}  # what plan validates
# A migratable request's body is encoded again on the gateway's event loop (about 0.1 us a token id, with the GIL):
# a prompt of more token ids than this is relayed as it is.
MIGRATED_IDS = 1 << 16


class Refusal(StrEnum):
    """Why a request is relayed as it is, without migration (said in its error event if it fails)."""

    NOT_JSON = "its body is not a JSON object"
    LONG_PROMPT = f"its prompt has more than {MIGRATED_IDS} token ids"
    SEVERAL_CHOICES = "it asks for several choices (n, best_of or several prompts)"
    LOGPROBS = "it asks for logprobs"
    ECHO = "it asks for the prompt echoed"
    MAX_TOKENS = "its max_completion_tokens is not a positive integer"
    CHAT_FIELDS = f"it has chat fields a completion cannot carry on (only {', '.join(sorted(CHAT_KEYS))} can)"
    NO_BUDGET = "a chat request without max_tokens has no budget to continue with"


@dataclass(frozen=True)
class Migratable:
    """A completion the gateway can continue elsewhere: the client's body and what it asked for."""

    path: str  # Endpoint.COMPLETIONS or Endpoint.CHAT_COMPLETIONS: the shape the client gets
    body: dict
    max_tokens: int

    @property
    def is_chat(self) -> bool:
        return self.path == Endpoint.CHAT_COMPLETIONS

    @property
    def stream(self) -> bool:
        """The client wants server-sent events."""
        return bool(self.body.get("stream"))

    @property
    def include_usage(self) -> bool:
        """... ending with a usage chunk."""
        options = self.body.get("stream_options")
        return isinstance(options, dict) and bool(options.get("include_usage"))

    @property
    def wants_token_ids(self) -> bool:
        """The client asked for token ids itself."""
        return bool(self.body.get("return_token_ids"))

    @property
    def stop(self) -> tuple[str, ...]:
        """The stop strings, which the gateway applies (``StopStrings``): the engine is asked without them."""
        stop = self.body.get("stop")
        return (stop,) if isinstance(stop, str) else tuple(stop or ())

    def upstream_body(self) -> dict:
        """The first segment: the client's request, streamed with token ids and a usage chunk."""
        return {k: v for k, v in self.body.items() if k != "stop"} | FORCED

    def continuation(self, prompt_ids: list[int], max_tokens: int) -> dict:
        """A later segment: a completion (a chat's too) of ``prompt_ids``."""
        kept = {k: v for k, v in self.body.items() if k not in (*CHAT_ONLY, "stop")}
        return kept | FORCED | {"prompt": prompt_ids, "max_tokens": max_tokens}


async def plan_off_loop(method: str, path: str, size: int, request: object) -> Migratable | Refusal | Invalid | None:
    """``plan``, in a worker thread for a body of more than ``INLINE_BODY_BYTES`` (``size``): its prompt's check walks
    every token id."""
    if size <= INLINE_BODY_BYTES:
        return plan(method, path, request)
    return await asyncio.to_thread(plan, method, path, request)


def plan(method: str, path: str, request: object) -> Migratable | Refusal | Invalid | None:
    """A ``Migratable`` for a completion the gateway can continue; a ``Refusal`` for a completion it cannot (relayed
    as it is: the engine judges its fields as the client sent them); ``Invalid`` for one it would continue but whose
    fields an engine would refuse (module docstring); None for any other request. ``request``: the body's JSON value
    (``hotweights.httpguard.parsed_json``)."""
    if method != "POST" or path not in CHECKED:
        return None
    if not isinstance(request, dict):
        return Refusal.NOT_JSON
    if refusal := refusal_of(request):
        return refusal
    if path == Endpoint.CHAT_COMPLETIONS and (refusal := chat_refusal(request)):
        return refusal
    schema = CHECKED[path]
    checked = validated(schema, {k: v for k, v in request.items() if k in schema.model_fields})
    if isinstance(checked, Invalid):
        return checked
    max_tokens = budget(request)  # max_completion_tokens, a chat's, is no field of the engines'
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return Refusal.MAX_TOKENS
    return Migratable(path, request, max_tokens)


def budget(request: dict) -> int:
    """The request's token budget (``max_completion_tokens`` is the newer name in chat)."""
    return request.get("max_completion_tokens") or request.get("max_tokens", DEFAULT_MAX_TOKENS)


def chat_refusal(request: dict) -> Refusal | None:
    if not set(request) <= CHAT_KEYS:
        return Refusal.CHAT_FIELDS
    if request.get("max_tokens") is None and request.get("max_completion_tokens") is None:
        return Refusal.NO_BUDGET
    return None


def refusal_of(request: dict) -> Refusal | None:
    """None when the request has one choice and nothing a continuation could not reproduce."""
    prompt = request.get("prompt")
    several_prompts = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1
    if request.get("n", 1) != 1 or request.get("best_of", 1) != 1 or several_prompts:
        return Refusal.SEVERAL_CHOICES
    ids = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else prompt
    if isinstance(ids, list) and len(ids) > MIGRATED_IDS:
        return Refusal.LONG_PROMPT
    if request.get("logprobs") not in (None, False):
        return Refusal.LOGPROBS
    if request.get("echo"):
        return Refusal.ECHO
    return None


@dataclass
class StopStrings:
    """Stop strings applied to the text as it arrives, so that an engine never holds text back for them
    (whatever it does with token ids meanwhile): text that may start one is held here; the text ends just
    before the first one met."""

    stop: tuple[str, ...]
    held: str = ""
    hit: bool = False

    def push(self, text: str) -> str:
        """What may go to the client now; sets ``hit`` at a stop string."""
        self.held += text
        if hits := [i for s in self.stop if (i := self.held.find(s)) >= 0]:
            self.hit = True
            ready, self.held = self.held[: min(hits)], ""
            return ready
        end = len(self.held) - self.prefix_len()
        ready, self.held = self.held[:end], self.held[end:]
        return ready

    def flush(self) -> str:
        """The text held back, once the generation ended without a stop string."""
        ready, self.held = self.held, ""
        return ready

    def prefix_len(self) -> int:
        """Length of the longest tail of the held text that a stop string starts with."""
        return max((n for s in self.stop for n in range(len(s) - 1, 0, -1) if self.held.endswith(s[:n])), default=0)


@dataclass
class Ledger:
    """One migratable request's progress: what its client has been sent, as tokens and characters."""

    request: Migratable
    id: str | None = None  # the first segment's completion id and creation time, kept for the whole response
    created: int | None = None
    model: str | None = None
    prompt_ids: list[int] | None = None
    released: list[int] = field(default_factory=list)  # generated tokens that came back
    held: int = 0  # the last released tokens whose text has not come back (a character's first bytes)
    beyond: int = 0  # characters that came back after the released tokens' text
    skip: int = 0  # characters of the current segment's text that came back before the cut
    segment_start: int = 0  # released tokens when the current segment began
    completion_tokens: int = 0  # completion tokens of the segments before the current one
    segment_usage: dict | None = None  # the current segment's usage chunk
    finish_reason: str | None = None
    text: str = ""  # everything sent (kept for a non-streamed reply)
    shown: int = 0  # choices shown to the client so far
    migrations: int = 0
    weights: str | None = None  # what the engine of its first segment computes with (WEIGHTS_HEADER); None: unnamed
    stops: StopStrings = field(init=False)

    def __post_init__(self) -> None:
        self.stops = StopStrings(self.request.stop)

    @property
    def stopped(self) -> bool:
        """A stop string was met: the request is over, whatever the engine goes on generating."""
        return self.stops.hit

    @property
    def client_saw_nothing(self) -> bool:
        """Nothing generated has reached the client: a non-streamed reply (sent whole at the end), or a stream
        before its first choice."""
        return not self.request.stream or self.shown == 0

    def continues_on(self, weights: str | None) -> bool:
        """Whether an engine that names ``weights`` may continue this request: the weights of its first segment,
        or either unnamed (an engine that does not say)."""
        return self.weights is None or weights is None or weights == self.weights

    def restart(self) -> None:
        """Forget what was generated, so that the request runs again from its prompt (when the weights that
        computed it are no longer served and its client saw nothing)."""
        self.__dict__.update(Ledger(self.request, migrations=self.migrations).__dict__)

    @property
    def remaining(self) -> int:
        """Tokens the request may still generate."""
        return self.request.max_tokens - len(self.released)

    def take(self, chunk: dict) -> dict | None:
        """The client's view of one upstream chunk, or None when it has nothing new for the client."""
        self.id = self.id or chunk.get("id")
        self.created = self.created or chunk.get("created")
        self.model = self.model or chunk.get("model")
        if self.prompt_ids is None and chunk.get("prompt_token_ids") is not None:  # a chat's first chunk
            self.prompt_ids = list(chunk["prompt_token_ids"])
        if usage := chunk.get("usage"):
            self.segment_usage = usage
        choices = [c for c in (self.take_choice(c) for c in chunk.get("choices") or ()) if c is not None]
        if not choices:
            return None
        rest = {k: v for k, v in chunk.items() if k not in ("usage", "prompt_token_ids")}  # usage: at the end
        shown = rest | {"id": self.id, "created": self.created, "object": self.chunk_object, "choices": choices}
        if self.request.is_chat and self.request.wants_token_ids and self.shown == 1:
            shown["prompt_token_ids"] = self.prompt_ids
        return shown

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.request.is_chat else "text_completion"

    def take_choice(self, choice: dict) -> dict | None:
        if self.prompt_ids is None and choice.get("prompt_token_ids") is not None:
            self.prompt_ids = list(choice["prompt_token_ids"])
        text = choice_text(choice)
        dropped = min(self.skip, len(text))
        text, self.skip = text[dropped:], self.skip - dropped
        self.beyond += len(text)
        if ids := choice.get("token_ids"):
            self.held = 0 if choice_text(choice) else self.held + len(ids)
            self.released += ids
            self.beyond = 0
        text = self.stops.push(text)
        self.finish_reason = "stop" if self.stops.hit else choice.get("finish_reason")
        if self.finish_reason is not None and not self.stops.hit:
            text += self.stops.flush()
        self.text += text
        if not text and self.finish_reason is None and self.shown:
            return None
        self.shown += 1
        return self.client_choice(choice, text)

    def client_choice(self, choice: dict, text: str) -> dict:
        """``choice`` with ``text`` in the client's shape (a chat's delta, the first with the role)."""
        wanted = self.request.wants_token_ids
        if self.request.is_chat:
            delta = ({"role": "assistant"} if self.shown == 1 else {}) | {"content": text}
            shown = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": self.finish_reason}
            return shown | ({"token_ids": choice.get("token_ids") or []} if wanted else {})
        shown = {k: v for k, v in choice.items() if k not in TOKEN_FIELDS or wanted}
        shown |= {"text": text, "finish_reason": self.finish_reason}
        if self.shown > 1:
            shown.pop("prompt_token_ids", None)  # the client had it with its first chunk
        return shown

    def cut(self) -> dict | None:
        """The upstream failed: the body of the continuation (None when nothing is left to generate:
        the request ends with finish_reason ``length``). Tokens whose text has not come back are not
        replayed but generated again: an engine that decodes a token-id prompt ending inside a character
        may send the whole prompt's text with its first token (vLLM does)."""
        del self.released[len(self.released) - self.held :]
        self.held = 0
        self.completion_tokens += len(self.released) - self.segment_start
        self.segment_start, self.segment_usage = len(self.released), None
        self.skip, self.beyond = self.skip + self.beyond, 0
        self.migrations += 1
        if self.prompt_ids is None:  # nothing came back yet: the request as it was
            return self.request.upstream_body()
        if self.remaining <= 0:
            self.finish_reason = "length"
            return None
        return self.request.continuation(self.prompt_ids + self.released, self.remaining)

    def usage(self) -> dict[str, int]:
        """Usage over the whole request: the prompt as the client sent it, every token generated."""
        segment = (self.segment_usage or {}).get("completion_tokens", len(self.released) - self.segment_start)
        prompt = len(self.prompt_ids or ())
        completion = self.completion_tokens + segment
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage_chunk(self) -> dict:
        base = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model}
        return base | {"choices": [], "usage": self.usage()}

    def whole(self) -> dict:
        """The non-streamed reply."""
        ids = {"token_ids": self.released} if self.request.wants_token_ids else {}
        prompt = {"prompt_token_ids": self.prompt_ids} if self.request.wants_token_ids else {}
        choice = {"index": 0, "logprobs": None, "finish_reason": self.finish_reason}
        if not self.request.is_chat:
            choice = {"index": 0, "text": self.text} | choice | ids | prompt
            return self.usage_chunk() | {"choices": [choice]}
        choice |= {"message": {"role": "assistant", "content": self.text}} | ids
        return self.usage_chunk() | {"object": "chat.completion", "choices": [choice]} | prompt
