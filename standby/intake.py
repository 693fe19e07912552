"""A completion request's CPU work before it is generated: off the engine's event loop, and bounded.

The event loop answers health checks within milliseconds whatever requests arrive (a controller fences an engine
whose checks time out), so everything whose cost grows with a request runs in the intake's worker thread once its
body is larger than ``INLINE_BODY_BYTES``: validation (``hotweights.requestschema``, whose prompt check gives the
GIL back every few milliseconds), the chat template, tokenization (``encode_batch``, which releases the GIL while
it works) and the checks of the token ids. The JSON was parsed before the handler, in a worker thread too
(``hotweights.httpguard``). One thread: however many large requests arrive, their intake takes at most one core
from generation, and at most one thread competes with the event loop for the GIL.

Every step is bounded by the request's size: the body (``--max-body-bytes``); the prompts of one request (at most
``--max-batch``, what the engine generates at once, refused before any is looked at); each prompt's tokens
(prompt and ``max_tokens`` within the KV slot, checked before its ids are); the messages (``MAX_MESSAGES``); the KV
blocks its sequences need, within the engine's pool (``standby.kvpool``). Where
the tokenizer bounds how much text one token stands for (``bytes_per_token``: byte-level BPE), a text that
cannot fit the KV slot whatever its tokens is refused before it is tokenized: a prompt of megabytes costs the
engine no more than its JSON.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from tokenizers import Tokenizer

from hotweights.httpguard import NO_JSON
from hotweights.requestschema import (
    INLINE_BODY_BYTES,
    ChatRequest,
    CompletionRequest,
    Invalid,
    SamplingRequest,
    validated,
)
from hotweights.standby.chat import ChatTemplate
from hotweights.standby.kvpool import sequence_blocks, shortfall

T = TypeVar("T")
R = TypeVar("R", bound=SamplingRequest)


@dataclass
class Intake:
    """Turns a parsed body into a validated request and its prompts' token ids, for one engine: its tokenizer and
    chat template, its vocabulary, its KV slot (``context_tokens``), its batch (``max_prompts``)."""

    tokenizer: Tokenizer
    template: ChatTemplate
    vocab_size: int
    context_tokens: int
    max_prompts: int
    kv_blocks: int = 0  # the engine's KV pool (``standby.kvpool``); 0: none to check against
    _thread: ThreadPoolExecutor = field(
        init=False, default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="intake")
    )
    _bytes_per_token: int | None = field(init=False)

    def __post_init__(self) -> None:
        self._bytes_per_token = bytes_per_token(self.tokenizer)

    async def request(self, schema: type[R], body: object, size: int) -> R | Invalid:
        """``body`` (``hotweights.httpguard.parsed_json``, ``size`` bytes) as ``schema``, or why not."""
        if body is NO_JSON:
            return Invalid("body: expected a JSON object (content-type application/json)", "body")
        return await self.run(size, lambda: validated(schema, body, self.max_prompts, self.context_tokens))

    async def prompt_ids(self, request: CompletionRequest | ChatRequest, size: int) -> list[list[int]] | Invalid:
        """The token ids of each of the request's prompts, each checked against the vocabulary and the KV slot."""
        return await self.run(size, lambda: self._encoded(request))

    async def run(self, size: int, work: Callable[[], T]) -> T:
        """``work()`` on the event loop for a body of up to ``INLINE_BODY_BYTES``, else in the intake's thread."""
        if size <= INLINE_BODY_BYTES:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    def _encoded(self, request: CompletionRequest | ChatRequest) -> list[list[int]] | Invalid:
        """Each prompt's token ids, or why they cannot run here; a text's ids are taken from its encoding only once
        their count fits (a list of a million ints costs tens of milliseconds of GIL to build, and as many to free)."""
        if isinstance(request, ChatRequest):
            prompts: list[str | list[int]] = [self.template.render([m.model_dump() for m in request.messages])]
            special = not self.template.from_checkpoint
        else:
            prompts, special = request.prompts, True
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            if refusal := self.text_refusal(text, request.max_tokens):
                return refusal
        encodings = iter(self.tokenizer.encode_batch(texts, add_special_tokens=special) if texts else ())
        prompt_ids = []
        for prompt in prompts:
            encoding = next(encodings) if isinstance(prompt, str) else None
            if refusal := self.length_refusal(len(prompt if encoding is None else encoding), request.max_tokens):
                return refusal
            prompt_ids.append(prompt if isinstance(prompt, list) else encoding.ids)
        return self.vocabulary_refusal(prompt_ids) or self.pool_refusal(prompt_ids, request.max_tokens) or prompt_ids

    def pool_refusal(self, prompt_ids: list[list[int]], max_tokens: int) -> Invalid | None:
        """Why the prompts' sequences can never run at once on this engine's KV pool (they need more blocks than it
        holds, ``kvpool.shortfall``), or None (they may wait for their blocks: ``Admission.reserve``)."""
        reason = self.kv_blocks and shortfall(blocks_needed(prompt_ids, max_tokens), self.kv_blocks)
        return Invalid(f"{reason} (--kv-pool-tokens)", "max_tokens") if reason else None

    def text_refusal(self, text: str, max_tokens: int) -> Invalid | None:
        """Why ``text`` cannot fit the KV slot with ``max_tokens`` whatever its tokens (at least one per
        ``bytes_per_token`` bytes, a character being one byte or more), or None (also when the tokenizer gives no
        such bound)."""
        if self._bytes_per_token is None:
            return None
        least = len(text) // self._bytes_per_token
        if least + max_tokens <= self.context_tokens:
            return None
        message = (
            f"prompt (at least {least} tokens: {len(text)} characters) + max_tokens ({max_tokens}) exceeds this "
            f"engine's {self.context_tokens}-token context (--kv-cache-tokens)"
        )
        return Invalid(message, "max_tokens")

    def length_refusal(self, tokens: int, max_tokens: int) -> Invalid | None:
        """Why a prompt of ``tokens`` cannot run with ``max_tokens`` here (empty, or beyond the KV slot), or None."""
        if not tokens:
            return Invalid("prompt is empty after tokenization", "prompt")
        if tokens + max_tokens > self.context_tokens:
            message = (
                f"prompt ({tokens} tokens) + max_tokens ({max_tokens}) exceeds this engine's "
                f"{self.context_tokens}-token context (--kv-cache-tokens)"
            )
            return Invalid(message, "max_tokens")
        return None

    def vocabulary_refusal(self, prompt_ids: list[list[int]]) -> Invalid | None:
        """Why the prompts' token ids cannot run on this model (ids beyond its vocabulary), or None."""
        for ids in prompt_ids:
            if bad := [t for t in ids if t >= self.vocab_size]:
                message = f"prompt token ids {bad[:5]} are outside this model's vocabulary [0, {self.vocab_size})"
                return Invalid(message, "prompt")
        return None


def blocks_needed(prompt_ids: list[list[int]], max_tokens: int) -> int:
    """The KV blocks a request's sequences hold while they run (``kvpool.sequence_blocks``)."""
    return sum(sequence_blocks(len(ids), max_tokens) for ids in prompt_ids)


def bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """The most bytes of text one token can stand for, when the tokenizer bounds it: byte-level BPE with no
    normalizer (every byte of the text ends up in some token; a vocabulary entry is one character per byte) and
    pre-tokenizers that drop nothing; the longest entry or added token. None for any other tokenizer."""
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = {(step.get("type"), step.get("behavior")) for step in steps}
    byte_level = ("ByteLevel", None) in kinds and all(
        kind == "ByteLevel" or behavior not in (None, "Removed") for kind, behavior in kinds
    )
    if spec.get("normalizer") is not None or spec["model"].get("type") != "BPE" or not byte_level:
        return None
    added = [len(token["content"].encode()) for token in spec.get("added_tokens", [])]
    return max([len(entry) for entry in spec["model"]["vocab"]] + added)
