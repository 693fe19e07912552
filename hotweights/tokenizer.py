"""A checkpoint's tokenizer and stop token ids: what its engines serve text with, read without torch (the
controller checks a new model's tokenizer before any engine loads it)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from hotweights.errors import CheckpointError


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The checkpoint's ``tokenizer.json``; CheckpointError, naming the file, when it is missing or unreadable."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint has no tokenizer")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a bare Exception for any bad file
        raise CheckpointError(f"{path}: not a tokenizer the tokenizers library can read ({exc})") from None


def stop_token_ids(model_dir: Path) -> tuple[int, ...]:
    """eos_token_id from generation_config.json or config.json (an int or a list)."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()
