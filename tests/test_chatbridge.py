"""The agent's chat bridge without processes: which chats it takes, the completion it asks for, the chunks it writes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from hotweights.proxying import rewritten_events
from hotweights.standby.chatbridge import ChatChunks, bridgeable, completion_body, tokenize_body

pytestmark = pytest.mark.unit
MESSAGES = [{"role": "user", "content": "hi"}]
ASKED = {"messages": MESSAGES, "max_tokens": 8, "stream": True, "return_token_ids": True}


@pytest.mark.parametrize(
    ("body", "bridged"),
    [
        (ASKED, True),
        (ASKED | {"temperature": 0, "seed": 3, "stop": ["x"], "stream_options": {"include_usage": True}}, True),
        (ASKED | {"stream": False}, False),  # the engine serves a whole chat with token ids itself
        ({k: v for k, v in ASKED.items() if k != "return_token_ids"}, False),  # nothing to bridge
        (ASKED | {"tools": []}, False),  # a field a completion cannot carry: the engine answers for itself
        (ASKED | {"n": 2}, False),
        (ASKED | {"messages": "hi"}, False),
        ([ASKED], False),
    ],
)
def test_only_a_chat_the_gateway_could_continue_is_bridged(body: object, bridged: bool) -> None:
    assert (bridgeable(json.dumps(body).encode()) is not None) is bridged


def test_not_json_is_left_to_the_engine() -> None:
    assert bridgeable(b'{"messages": [') is None
    assert bridgeable(b"\xff") is None


def test_the_completion_carries_the_chats_sampling_and_its_budget() -> None:
    chat = ASKED | {"model": "m", "max_tokens": None, "max_completion_tokens": 5, "temperature": 0}
    assert tokenize_body(chat) == {"messages": MESSAGES, "model": "m"}
    body = completion_body(chat, [1, 2, 3])
    assert body == {"model": "m", "max_tokens": 5, "stream": True, "return_token_ids": True, "temperature": 0} | {
        "prompt": [1, 2, 3]
    }


def test_completion_chunks_become_chat_chunks_with_the_prompts_ids_first() -> None:
    lines = [
        'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"He","token_ids":[7],'
        '"finish_reason":null,"prompt_token_ids":[1,2]}]}',
        "",
        'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"llo","token_ids":[8,9],'
        '"finish_reason":"length"}]}',
        'data: {"id":"c","object":"text_completion","choices":[],"usage":{"completion_tokens":3}}',
        "data: [DONE]",
        'data: {"never": "read"}',
    ]

    async def source() -> AsyncIterator[str]:
        for line in lines:
            yield line

    async def collect() -> list[bytes]:
        return [event async for event in rewritten_events(source(), ChatChunks([1, 2]))]

    events = asyncio.run(collect())
    assert events[-1] == b"data: [DONE]\n\n" and len(events) == 4
    first, second, usage = (json.loads(e.decode().removeprefix("data: ")) for e in events[:3])
    assert first["object"] == second["object"] == usage["object"] == "chat.completion.chunk"
    assert first["prompt_token_ids"] == [1, 2] and "prompt_token_ids" not in second
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": "He"}, "logprobs": None, "finish_reason": None}
        | {"token_ids": [7]}
    ]
    assert second["choices"][0]["delta"] == {"content": "llo"} and second["choices"][0]["token_ids"] == [8, 9]
    assert second["choices"][0]["finish_reason"] == "length"
    assert usage["usage"] == {"completion_tokens": 3} and usage["choices"] == []
