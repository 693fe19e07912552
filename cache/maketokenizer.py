"""The generated models' tokenizer: byte-level BPE trained on the packaged corpus, without torch (the tests of
streamed token ids and the agent's use it as the engines do)."""

from __future__ import annotations

import functools
from importlib import resources

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
MAX_TOKENIZER_VOCAB = 4096  # the corpus is small; more merges would only learn whole sentences


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train byte-level BPE on the packaged corpus; bytes first, so any text encodes."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = resources.files("hotweights.cache").joinpath("corpus.txt").read_text(encoding="utf-8")
    tokenizer.train_from_iterator(corpus.splitlines(), trainer=trainer)
    bos = tokenizer.token_to_id(BOS_TOKEN)
    # Like Llama 3: encode() prepends <|begin_of_text|>; decode() drops it again.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos)]
    )
    return tokenizer


@functools.lru_cache(maxsize=4)
def tokenizer_json(vocab_size: int) -> str:
    """The trained tokenizer as JSON, cached: training is deterministic, so once per process."""
    return _train_tokenizer(vocab_size).to_str()
