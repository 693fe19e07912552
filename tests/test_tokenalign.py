"""``standby.tokenalign`` with the embedded tiny model's tokenizer (byte-level BPE: a character of several bytes is
several tokens) and streams as vLLM and SGLang send them: steps coalesced into chunks that end inside a character,
text sent in pieces. Every chunk's ids are then exactly the tokens whose text has been sent, and a stream cut after
any chunk and continued through the gateway's ``Ledger`` gives the uncut text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from hotweights.cache.maketokenizer import MAX_TOKENIZER_VOCAB, tokenizer_json
from hotweights.contract import Endpoint
from hotweights.engines import KINDS
from hotweights.gateway.migration import Ledger, Migratable, plan
from hotweights.layout import ModelConfig
from hotweights.standby.agent import engine_tokenizer, flag_value
from hotweights.standby.tokenalign import INCOMPLETE, StreamIds, WindowDecoder, wants_aligned

pytestmark = pytest.mark.unit
CORPUS = "Hello wörld — ünïcödé 日本語テキスト 🙂🙃 the quick brown fox "


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json(min(ModelConfig().vocab_size, MAX_TOKENIZER_VOCAB)))  # the tiny preset


def ids_of(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def decoded(tokenizer: Tokenizer, context: list[int], ids: list[int]) -> str:
    """The text of ``ids`` after ``context``, as a whole decode gives it."""
    return tokenizer.decode(context + ids)[len(tokenizer.decode(context)) :]


def printable(text: str) -> str:
    """SGLang's text of a step that ends inside a character: up to its last space (``find_printable_text``)."""
    return text[: text.rfind(" ") + 1]


def engine_chunks(
    tokenizer: Tokenizer, context: list[int], generated: list[int], sizes: list[int], *, pieces: bool = False
) -> list[dict]:
    """An engine's stream of ``generated`` after ``context``: each chunk the ids of ``sizes[i]`` steps (coalesced) and
    the text that came out, held back while it ends inside a character (with ``pieces``, as SGLang, the text up to
    the last space goes out meanwhile); the last chunk has a finish_reason and the rest of the text."""
    chunks, sent, start = [], 0, 0
    while start < len(generated):
        end = min(start + sizes[len(chunks) % len(sizes)], len(generated))
        text = decoded(tokenizer, context, generated[:end])
        last = end == len(generated)
        if text.endswith(INCOMPLETE) and not last:
            text = printable(text) if pieces else text[:sent]
        choice = {"index": 0, "text": text[sent:], "token_ids": generated[start:end], "finish_reason": None}
        if not chunks:
            choice["prompt_token_ids"] = context
        if last:
            choice["finish_reason"] = "length"
        chunks.append({"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]})
        sent, start = max(sent, len(text)), end
    return chunks


def aligned(tokenizer: Tokenizer, chunks: list[dict]) -> list[dict]:
    """The chunks as the agent relays them."""
    ids = StreamIds(tokenizer)
    return [ids.chunk(chunk) for chunk in chunks]


def test_a_chunk_that_ends_inside_a_character_keeps_its_first_bytes_for_the_next(tokenizer: Tokenizer) -> None:
    hello, kanji = ids_of(tokenizer, "ab"), ids_of(tokenizer, "日")
    assert len(kanji) == 3  # a byte token each
    first = {"index": 0, "text": "ab", "token_ids": [*hello, kanji[0]], "finish_reason": None}
    second = {"index": 0, "text": "日", "token_ids": kanji[1:], "finish_reason": None}
    ids = StreamIds(tokenizer)
    assert ids.chunk({"choices": [first]})["choices"][0]["token_ids"] == hello
    assert ids.chunk({"choices": [second]})["choices"][0]["token_ids"] == kanji


@pytest.mark.parametrize(
    ("steps", "released"),
    [
        pytest.param([("a", "a", None), ("Hello", "He", None), ("", "llo", None)], [["a"], [], ["Hello"]], id="pieces"),
        pytest.param([("a日", "a", "length")], [["a日"]], id="the-last-chunk-takes-all"),
        pytest.param(
            [("a", "X", None), ("b", "b", None), ("c", "c", "stop")], [[], [], ["a", "b", "c"]], id="not-its-text"
        ),
        pytest.param([("ab", "", None), ("", "ab", None)], [[], ["ab"]], id="text-after-its-ids"),
    ],
)
def test_ids_go_out_where_the_text_sent_is_exactly_theirs(
    tokenizer: Tokenizer, steps: list[tuple[str, str, str | None]], released: list[list[str]]
) -> None:
    """Each step: the text whose tokens came, the text sent, the finish_reason; each chunk's ids as their texts."""
    ids = StreamIds(tokenizer)
    out = []
    for tokens, text, finish in steps:
        choice = {"index": 0, "text": text, "token_ids": ids_of(tokenizer, tokens), "finish_reason": finish}
        out.append(ids.chunk({"choices": [choice]})["choices"][0]["token_ids"])
    assert out == [[t for piece in chunk for t in ids_of(tokenizer, piece)] for chunk in released]


def test_an_end_of_sequence_token_goes_with_the_text_before_it(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id("<|end_of_text|>")
    choice = {"index": 0, "text": "a", "token_ids": [*ids_of(tokenizer, "a"), eos], "finish_reason": None}
    assert StreamIds(tokenizer).chunk({"choices": [choice]})["choices"][0]["token_ids"] == [
        *ids_of(tokenizer, "a"),
        eos,
    ]


def test_a_chats_choices_are_aligned_after_the_prompt_at_the_top(tokenizer: Tokenizer) -> None:
    """vLLM's streamed chat: the prompt's ids at the top of the first chunk (a role and no ids), two choices."""
    kanji = ids_of(tokenizer, "本")
    ids = StreamIds(tokenizer)
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    first = ids.chunk({"prompt_token_ids": ids_of(tokenizer, "hi"), "choices": [role]})
    assert first["choices"][0]["token_ids"] == [] and first["prompt_token_ids"] == ids_of(tokenizer, "hi")
    held = [{"index": i, "delta": {"content": ""}, "token_ids": kanji[:2], "finish_reason": None} for i in (0, 1)]
    assert [c["token_ids"] for c in ids.chunk({"choices": held})["choices"]] == [[], []]
    whole = {"index": 1, "delta": {"content": "本"}, "token_ids": kanji[2:], "finish_reason": None}
    assert ids.chunk({"choices": [whole]})["choices"][0]["token_ids"] == kanji
    assert ids.chunk({"choices": [], "usage": {"completion_tokens": 3}}) == {
        "choices": [],
        "usage": {"completion_tokens": 3},
    }


def sequences(tokenizer: Tokenizer, trials: int) -> list[tuple[list[int], list[int]]]:
    """(generated ids, steps per chunk): random vocabulary ids (bytes that never make a character included) and
    slices of a text of one- to four-byte characters."""
    rng, corpus = random.Random(0), ids_of(tokenizer, CORPUS * 3)
    cases = []
    for trial in range(trials):
        if trial % 2:
            generated = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randrange(1, 40))]
        else:
            start = rng.randrange(len(corpus))
            generated = corpus[start : start + rng.randrange(1, 40)]
        cases.append((generated, [rng.randrange(1, 5) for _ in range(8)]))
    return cases


@pytest.mark.parametrize("pieces", [False, True], ids=["vllm", "sglang"])
def test_every_chunks_ids_are_exactly_the_tokens_whose_text_was_sent(tokenizer: Tokenizer, pieces: bool) -> None:
    context = tokenizer.encode("The weather").ids
    for generated, sizes in sequences(tokenizer, 300):
        released, sent = [], ""
        for chunk in aligned(tokenizer, engine_chunks(tokenizer, context, generated, sizes, pieces=pieces)):
            (choice,) = chunk["choices"]
            released += choice["token_ids"]
            sent += choice["text"]
            if choice["token_ids"] and choice["finish_reason"] is None:
                assert decoded(tokenizer, context, released) == sent, (generated, sizes)
        assert released == generated


def continued(tokenizer: Tokenizer, prompt: list[int], generated: list[int], sizes: list[int], cut: int, **how) -> str:
    """The text a client gets through the gateway when the stream of ``generated`` is cut after ``cut`` chunks and
    continued on a next engine (greedy: it generates the same tokens) from the ids the agent let through."""
    ledger = Ledger(plan("POST", Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": len(generated), "stream": True}))
    assert isinstance(ledger.request, Migratable)
    for chunk in aligned(tokenizer, engine_chunks(tokenizer, prompt, generated, sizes, **how))[:cut]:
        ledger.take(chunk)
    continuation = ledger.cut()
    assert continuation is not None
    context, done = continuation["prompt"], len(ledger.released)
    for chunk in aligned(tokenizer, engine_chunks(tokenizer, context, generated[done:], sizes[::-1], **how)):
        ledger.take(chunk)
    return ledger.text


@pytest.mark.parametrize("pieces", [False, True], ids=["vllm", "sglang"])
def test_a_stream_cut_after_any_chunk_continues_to_the_uncut_text(tokenizer: Tokenizer, pieces: bool) -> None:
    prompt = tokenizer.encode("The weather").ids
    for generated, sizes in sequences(tokenizer, 60):
        chunks = engine_chunks(tokenizer, prompt, generated, sizes, pieces=pieces)
        uncut = "".join(chunk["choices"][0]["text"] for chunk in chunks)
        for cut in range(1, len(chunks)):
            assert continued(tokenizer, prompt, generated, sizes, cut, pieces=pieces) == uncut, (generated, sizes, cut)


def test_decoding_keeps_a_window_of_a_few_ids_however_long_the_stream(tokenizer: Tokenizer) -> None:
    decoder = WindowDecoder(tokenizer, tokenizer.encode("The weather").ids)
    longest = 0
    for token in ids_of(tokenizer, CORPUS * 200):
        decoder.push(token)
        longest = max(longest, len(decoder.ids))
    assert longest <= 8


@pytest.mark.parametrize(
    ("body", "wanted"),
    [
        ({"stream": True, "return_token_ids": True}, True),
        ({"stream": True}, False),
        ({"return_token_ids": True}, False),  # a whole reply: its ids are the whole text's
        ({"stream": "yes", "return_token_ids": True}, False),
        ([{"stream": True, "return_token_ids": True}], False),
    ],
)
def test_only_a_stream_that_asks_for_token_ids_is_aligned(body: object, wanted: bool) -> None:
    assert wants_aligned(body) is wanted


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        (["python", "-m", "vllm", "--model", "/m", "--port", "{port}"], "--model", "/m"),
        (["python", "--model=/m"], "--model", "/m"),
        (["python", "--model", "/a", "--model", "/b"], "--model", "/b"),
        (["python", "--model"], "--model", None),
        (["python", "--model-path", "/m"], "--model", None),
    ],
)
def test_a_flags_value_is_read_from_the_engine_command(command: list[str], flag: str, value: str | None) -> None:
    assert flag_value(command, flag) == value


def test_the_engine_tokenizer_is_its_tokenizer_flags_else_its_models(tokenizer: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    sglang = KINDS["sglang"]
    found = engine_tokenizer(
        sglang, ["python", "--model-path", str(tmp_path), "--tokenizer-path", str(tmp_path / "tok")]
    )
    assert found is not None and found.get_vocab_size() == tokenizer.get_vocab_size()
    assert engine_tokenizer(sglang, ["python", "--model-path", str(tmp_path)]) is None  # no tokenizer.json there
    assert engine_tokenizer(KINDS["vllm"], ["python", "--port", "{port}"]) is None
