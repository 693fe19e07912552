"""``TextStream`` decodes incrementally: its pieces are exactly what decoding every id at each step gave
(multi-byte characters split over tokens, stop strings, random ids), in linear time."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from hotweights.standby.generate import TextStream
from hotweights.tokenizer import load_tokenizer

STOPS = ["fox", "ü", " the", "🙂", "o", "語"]


def reference(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...]) -> tuple[str, bool]:
    """The text a stream of ``ids`` should give: the whole decode, ended before the first stop string."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        hits = [i for s in stop if (i := text.find(s)) >= 0]
        if hits:
            return text[: min(hits)], True
    return tokenizer.decode(ids), False


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return load_tokenizer(tiny_model)


def test_incremental_pieces_add_up_to_the_whole_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    corpus = tokenizer.encode("Hello wörld — ünïcödé 日本語テキスト 🙂🙃 the quick brown fox " * 3).ids
    for trial in range(400):
        if trial % 2:
            ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randrange(1, 40))]
        else:
            start = rng.randrange(len(corpus))
            ids = corpus[start : start + rng.randrange(1, 40)]
        stop = tuple(rng.sample(STOPS, rng.randrange(0, 3)))
        stream = TextStream(tokenizer, stop)
        pieces = []
        for token in ids:
            pieces.append(stream.push(token))
            if stream.stopped:
                break
        pieces.append(stream.flush())
        assert ("".join(pieces), stream.stopped) == reference(tokenizer, ids, stop), (ids, stop)
