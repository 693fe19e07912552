"""Split-KV decode attention (``standby.decodeattention``) on CPU: its torch reference against the masked SDPA it
replaces, and its Triton kernels under Triton's interpreter, in the Python of the SGLang venv (the only one here
with Triton; skipped without it unless ``HOTWEIGHTS_REQUIRE_SGLANG=1``). ``tests/test_engine_cuda.py`` runs the same
cases on a GPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from hotweights.standby.decodeattention import SPLIT, reference, splits
from hotweights.standby.model import MaskedReads
from tests.attentionhelpers import LENGTHS, POSITIONS, TOLERANCES, case, cases, in_order
from tests.cachehelpers import ENV, engine_python

HELPERS = Path(__file__).with_name("attentionhelpers.py")


def test_splits_cover_the_cache() -> None:
    assert [splits(n) for n in (1, SPLIT - 1, SPLIT, SPLIT + 1, 4096)] == [1, 1, 1, 2, 4096 // SPLIT]


def test_the_reference_computes_what_masked_sdpa_does() -> None:
    for group, head_dim, dtype in cases():
        q, k, v, table, lengths = case(group, head_dim, dtype, "cpu")
        masked = MaskedReads.for_step(lengths - 1, POSITIONS, dtype, table).attend(q, k, v)
        atol, rtol = TOLERANCES[dtype][1]
        computed = reference(q, in_order(k, table), in_order(v, table), lengths, head_dim**-0.5)
        torch.testing.assert_close(computed, masked, atol=atol, rtol=rtol)
    assert max(LENGTHS) == POSITIONS and POSITIONS % SPLIT  # the last split only partly in the cache


@pytest.mark.sglang
def test_the_kernels_compute_the_reference_under_the_triton_interpreter() -> None:
    """Every group, head dim and dtype, rows of lengths 1, SPLIT - 1, SPLIT, SPLIT + 1 and the whole cache, read
    through a block table that scatters each row over the pool, strided like the model's views, stage 1's scratch NaN
    where no split wrote: within the dtype's tolerance of the reference and of masked SDPA, and a row's bits the same
    alone as in its batch; and a small model's decode steps with split-KV attention compute what they compute with
    masked SDPA."""
    python = engine_python("SGLang", "Triton")
    env = ENV | {"TRITON_INTERPRET": "1"}
    checked = subprocess.run([python, str(HELPERS), "cpu"], env=env, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert json.loads(checked.stdout.splitlines()[-1]) == []
