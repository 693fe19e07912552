"""Shared fixtures: real checkpoints on disk, written once per test session."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hotweights.cache.makemodel import PRESETS, write_checkpoint

# Tests spawn many torch processes on small machines; one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def make_checkpoint(out: Path, *, quant: str | None = None, tie: bool = False, seed: int = 0, **fields) -> Path:
    config = replace(PRESETS["tiny"], tie_word_embeddings=tie, **fields)
    return write_checkpoint(
        out, config, dtype=torch.float32, quant=quant, seed=seed, shard_size=1 << 20, progress=False
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset in float32 (exact comparisons), split over several shards."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def tiny_fp8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-fp8", quant="fp8-block")


@pytest.fixture(scope="session")
def tiny_tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-tied", tie=True)
