"""Streamed token ids kept with their text, for an engine that sends ids ahead of their text (vLLM, SGLang).

The gateway continues a cut completion from the token ids it was sent (``gateway.migration.Ledger``) and relies on
the engine contract (docs/engine-contract.md, "Continuation"): a chunk's ``token_ids`` are the tokens whose text has
now been wholly sent, and no text beyond them is sent with them. vLLM and SGLang send each step's ids at once but hold
back the text of a character whose bytes have not all come, and merge several steps into one chunk when their client
lags: a chunk may carry ids [a, b, c] with the text of a and b only, c being a character's first bytes. A stream cut
there would continue after c, and the character would be lost.

The agent has its engine's tokenizer, so for a streamed completion or chat with ``return_token_ids``
(``wants_aligned``) it rewrites each choice's ids (``StreamIds``): it decodes them as the engines' detokenizers do
(``WindowDecoder``) and releases them only where the text sent so far is exactly their text, ending at a whole
character; the others wait for a later chunk, and a choice's last chunk (its ``finish_reason``) carries all that are
left. Where the engine's text and the decoding part (a reasoning parser's text, a tokenizer the engine overrides),
the ids wait to the end, so a cut continues from the last point they met and the gateway drops the text sent since
(its ``skip``): tokens are generated again, no text is lost. Each token decodes a window of a few ids and each
character is compared once: linear in the stream.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

from tokenizers import Tokenizer

from hotweights.contract import choice_text

log = logging.getLogger(__name__)

INCOMPLETE = "\ufffd"  # what decoding gives for the bytes of a character not all there yet
CONTEXT_IDS = 4  # prompt ids a choice's first tokens are decoded after (SGLang's detokenizer takes 5, vLLM's all)


def wants_aligned(request: object) -> bool:
    """Whether the agent re-aligns the response to ``request`` (its body's JSON value): a streamed completion or chat
    with ``return_token_ids``, what the gateway asks for (``gateway.migration.FORCED``)."""
    return isinstance(request, dict) and request.get("stream") is True and request.get("return_token_ids") is True


class WindowDecoder:
    """Token ids in, their text out, as the engines' incremental detokenizers give it: each token's text is the
    decoding of the ids since the last whole character (with the ids before them for context) past that of the
    context; None while the decoding ends inside a character (the token's text comes with a later one's)."""

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids = list(context[-CONTEXT_IDS:])
        self.read = len(self.ids)  # ids[:read]: the context; ids[read:]: tokens whose text has not come out

    def push(self, token: int) -> str | None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith(INCOMPLETE):
            return None
        settled = self.tokenizer.decode(self.ids[: self.read], skip_special_tokens=self.skip_special_tokens)
        del self.ids[: self.read]  # the next window starts after this one's context
        self.read = len(self.ids)
        return text[len(settled) :]


class ChoiceIds:
    """One choice's token ids, released as their text is sent (module docstring)."""

    def __init__(self, decoder: WindowDecoder) -> None:
        self.decoder = decoder
        self.pending: list[int] = []  # ids come, not released
        self.whole: deque[tuple[int, int]] = deque()  # (pending ids, their characters) where their text is whole
        self.decoded: list[str] = []  # the pending ids' text, as far as it is whole
        self.decoded_chars = 0
        self.sent: list[str] = []  # the text sent since the last release
        self.sent_chars = 0
        self.parted = False  # the text and the decoding did not meet where their lengths did: ids wait to the end

    def take(self, ids: Sequence[int], text: str, last: bool) -> list[int]:
        """The ids for a chunk that came with ``ids`` and ``text``; ``last``: the choice's last chunk, which takes
        every id left."""
        if self.parted:
            self.pending += ids
        else:
            self.decode(ids)
            self.sent.append(text)
            self.sent_chars += len(text)
        if last:
            released, self.pending = self.pending, []
            return released
        return [] if self.parted else self.release()

    def decode(self, ids: Sequence[int]) -> None:
        for token in ids:
            self.pending.append(token)
            if (piece := self.decoder.push(token)) is not None:
                self.decoded.append(piece)
                self.decoded_chars += len(piece)
                self.whole.append((len(self.pending), self.decoded_chars))

    def release(self) -> list[int]:
        """The pending ids whose text is exactly the text sent, at the last whole character that the text reached."""
        while self.whole and self.whole[0][1] < self.sent_chars:
            self.whole.popleft()  # the text went past it, into a character or token it had not reached
        met = None
        while self.whole and self.whole[0][1] == self.sent_chars:
            met = self.whole.popleft()  # the last of several: tokens without text (an end of sequence) go too
        if met is None:
            return []
        count, chars = met
        decoded, sent = "".join(self.decoded), "".join(self.sent)
        if decoded[:chars] != sent:
            log.warning("a streamed choice's text is not its token ids' decoding: its ids wait for its last chunk")
            self.parted = True
            return []
        self.decoded, self.decoded_chars = [decoded[chars:]], self.decoded_chars - chars
        self.sent, self.sent_chars = [], 0
        self.whole = deque((n - count, c - chars) for n, c in self.whole)
        released, self.pending = self.pending[:count], self.pending[count:]
        return released


class StreamIds:
    """A streamed response's chunks with each choice's ``token_ids`` released as its text is sent (``ChoiceIds``);
    a choice is decoded after its prompt's last ids (its first chunk's ``prompt_token_ids``, a chat's at the top)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.choices: dict[int, ChoiceIds] = {}

    def chunk(self, chunk: dict) -> dict:
        """``chunk`` with its choices' ids re-aligned (one without choices as it is)."""
        if not chunk.get("choices"):
            return chunk
        return chunk | {"choices": [self.choice(c, chunk.get("prompt_token_ids")) for c in chunk["choices"]]}

    def choice(self, choice: dict, prompt_ids: list[int] | None) -> dict:
        index = choice.get("index", 0)
        if (ids := self.choices.get(index)) is None:
            context = choice.get("prompt_token_ids") or prompt_ids or ()
            ids = self.choices[index] = ChoiceIds(WindowDecoder(self.tokenizer, context, self.skip_special_tokens))
        last = choice.get("finish_reason") is not None
        return choice | {"token_ids": ids.take(choice.get("token_ids") or (), choice_text(choice), last)}
