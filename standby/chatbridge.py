"""A streamed chat with token ids, served over the engine's completions for an engine that has it only there.

The gateway continues a chat that a failover cut as a completion of the rendered prompt's ids, so it asks
the engine for a streamed chat with ``return_token_ids``: the prompt's ids on the first chunk, each chunk's
own ids. vLLM serves that itself. SGLang refuses it on a streamed chat but serves it on a completion, and
renders and encodes a chat's messages at ``/v1/tokenize`` as its chat completion would. For such an engine
(``EngineKind.chat_token_ids`` false) the agent bridges: it has the engine encode the messages, streams the
completion of those ids and writes each chunk as a chat chunk (the role on the first delta, the prompt's ids
on the first chunk), its ids kept with their text as on any stream (``standby.tokenalign``). Only a request the
gateway could continue is bridged (``bridgeable``); any other goes to the engine as it is, which answers for itself.
"""

from __future__ import annotations

import json

from hotweights.contract import CHAT_KEYS, CHAT_ONLY

CHAT_CHUNK = "chat.completion.chunk"
TOKENIZE = "/v1/tokenize"  # the engine's: messages in, the ids its chat completion would prefill out


def bridgeable(body: bytes) -> dict | None:
    """The chat request to bridge: a JSON object with one choice, streamed with token ids, of fields a
    completion can carry (``CHAT_KEYS``); None for anything else."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict) or not set(request) <= CHAT_KEYS or request.get("n", 1) != 1:
        return None
    if request.get("stream") is not True or request.get("return_token_ids") is not True:
        return None
    return request if isinstance(request.get("messages"), list) else None


def tokenize_body(request: dict) -> dict:
    """The engine's ``/v1/tokenize`` request: the messages, rendered as its chat completion would."""
    return {"messages": request["messages"]} | ({"model": request["model"]} if "model" in request else {})


def completion_body(request: dict, prompt_ids: list[int]) -> dict:
    """The completion of ``prompt_ids`` that generates what the chat request asks for."""
    kept = {k: v for k, v in request.items() if k not in CHAT_ONLY}
    budget = request.get("max_completion_tokens") or request.get("max_tokens")
    return kept | {"prompt": prompt_ids} | ({"max_tokens": budget} if budget is not None else {})


def chat_choice(choice: dict, first: bool) -> dict:
    """A completion's streamed choice as a chat's: its text as the delta's content, its token ids kept."""
    delta = ({"role": "assistant"} if first else {}) | {"content": choice.get("text") or ""}
    chat = {
        "index": choice.get("index", 0),
        "delta": delta,
        "logprobs": None,
        "finish_reason": choice.get("finish_reason"),
    }
    return chat | ({"token_ids": choice["token_ids"]} if choice.get("token_ids") is not None else {})


class ChatChunks:
    """Rewrites a completion's streamed chunks as a chat's (``hotweights.proxying.rewritten_events``): chunks with
    choices rewritten, the first carrying ``prompt_ids``; a usage chunk and an error event as they are."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids, self.first = prompt_ids, True

    def __call__(self, chunk: dict) -> dict:
        if "choices" not in chunk:
            return chunk
        chunk = chunk | {"object": CHAT_CHUNK, "choices": [chat_choice(c, self.first) for c in chunk["choices"]]}
        if self.first and chunk["choices"]:
            chunk["prompt_token_ids"] = self.prompt_ids
            self.first = False
        return chunk
