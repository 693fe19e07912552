"""A minimal OpenAI-style engine for tests/test_agent.py that streams as vLLM does when its client lags: several steps
coalesced into one chunk, every id at once, the text of a character whose bytes have not all come held back (so a
chunk may end inside a character). Healthy, lists one model, answers a whole completion too.

Usage: python tests/coalescing_engine.py --model DIR PORT (DIR holds the tokenizer.json it encodes ``TEXT`` with)
"""

from __future__ import annotations

import sys
from pathlib import Path

from fakeengine import WHOLE, FakeEngineHandler, serve  # tests/fakeengine.py: a script's folder is on sys.path
from tokenizers import Tokenizer

TEXT = "ab日本語 🙂 ünï done"
STEPS = 2  # steps per chunk: the tiny model's tokenizer spells a character of n bytes as n tokens
PROMPT_IDS = [0, 41, 42]


def chunks(tokenizer: Tokenizer, with_ids: bool) -> list[dict]:
    """The stream's chunks: ``STEPS`` tokens each, the text that became whole; the last with its finish_reason."""
    ids, out, sent = tokenizer.encode(TEXT, add_special_tokens=False).ids, [], 0
    for start in range(0, len(ids), STEPS):
        end = min(start + STEPS, len(ids))
        text = tokenizer.decode(ids[:end])
        text = text[:sent] if text.endswith("\ufffd") else text
        choice = {"index": 0, "text": text[sent:], "finish_reason": "length" if end == len(ids) else None}
        if with_ids:
            choice["token_ids"] = ids[start:end]
            choice |= {"prompt_token_ids": PROMPT_IDS} if start == 0 else {}
        out.append({"id": "c", "object": "text_completion", "created": 1, "model": "fake", "choices": [choice]})
        sent = len(text)
    return out


class Handler(FakeEngineHandler):
    tokenizer: Tokenizer

    def do_POST(self) -> None:
        request = self.request_body()
        if request.get("stream"):
            self.stream(chunks(self.tokenizer, bool(request.get("return_token_ids"))))
        else:
            self.reply(WHOLE)


if __name__ == "__main__":
    Handler.tokenizer = Tokenizer.from_file(str(Path(sys.argv[2]) / "tokenizer.json"))
    serve(int(sys.argv[3]), Handler)
