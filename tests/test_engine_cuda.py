"""The reference engine's decode on a real GPU: CUDA graphs against eager decode, batching against
``generate``, and an engine process that reserves its KV cache and graphs at start-up (skipped
without CUDA; ``bench/gpu_suite.py`` runs it on the H200)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hotweights.cache.loadspec import LoadSpec
from hotweights.contract import Endpoint
from hotweights.standby.decoder import Decoder, bucket
from hotweights.standby.model import KVCache, Transformer, generate
from hotweights.standby.scheduler import SamplingParams
from hotweights.standby.weights import load_model
from hotweights.tokenizer import load_tokenizer
from tests.cachehelpers import ENV
from tests.enginehelpers import EngineProcess
from tests.test_scheduler import MAX_TOKENS, PROMPTS, run

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICE = "cuda:0"
TOKEN = "cuda-test-token"
# The fused reductions at decode's row counts and hidden sizes, on seeded inputs, saved to argv[1].
FUSED_PROBE = """
import sys, torch
from safetensors.torch import save_file
from hotweights.standby import fused
torch.manual_seed(0)
out = {}
with fused.fusing():
    for rows in (1, 8, 64):
        for width in (1024, 5120, 8192):
            x, delta = (torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            weight = torch.randn(width, device="cuda", dtype=torch.bfloat16)
            out[f"rms_norm_{rows}x{width}"] = fused.rms_norm(x, weight, 1e-6)
            out[f"add_rms_norm_{rows}x{width}"] = fused.add_rms_norm(x, delta, weight, 1e-6)[1]
save_file(out, sys.argv[1])
"""


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Transformer:
    return load_model(tiny_model, LoadSpec(device=DEVICE)).model


def decoder(model: Transformer, graphs: bool, batch: int = 3) -> Decoder:
    kv = KVCache.allocate(model.config, model.tp, batch, 64, model.device, model.dtype)
    made = Decoder(model, kv, graphs)
    made.warm_up()
    return made


def test_graph_replays_equal_eager_steps_and_never_hand_out_a_reused_buffer(model: Transformer) -> None:
    graphed, eager = decoder(model, graphs=True), decoder(model, graphs=False)
    assert graphed.graph_bytes > 0 and eager.graph_bytes == 0
    for d in (graphed, eager):
        for slot, prompt in enumerate(PROMPTS[:3]):
            d.prefill(slot, [prompt])
    steps = [([11, 12, 13], [3, 21, 1]), ([14], [4]), ([15, 16], [5, 22]), ([17, 18, 19], [6, 23, 2])]
    outputs = [graphed.decode(*step) for step in steps]
    for step, (logits, greedy) in zip(steps, outputs, strict=True):
        # Still each step's own values after the later replays: a copy, not the graph's output buffer.
        expected, expected_greedy = eager.decode(*step)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert greedy == logits.argmax(-1).tolist() == expected_greedy


def test_a_step_between_captured_batch_sizes_replays_the_next_one_with_free_rows(model: Transformer) -> None:
    """Batch 12 captures sizes 1, 2, 4, 8 and 12: steps of 11, 5 and 3 rows replay 12, 8 and 4, and each row's
    logits are the eager step's. Fewer rows each time, as the scheduler guarantees: the extra rows are free."""
    graphed, eager = decoder(model, graphs=True, batch=12), decoder(model, graphs=False, batch=12)
    assert graphed.graph_batches == [1, 2, 4, 8, 12]
    assert {n for n, _ in graphed._graphs} == {1, 2, 4, 8, 12}
    for d in (graphed, eager):
        for slot in range(11):
            d.prefill(slot, [PROMPTS[slot % len(PROMPTS)]])
    for n in (11, 5, 3):
        step = ([20 + i for i in range(n)], [len(PROMPTS[i % len(PROMPTS)]) for i in range(n)])
        logits, greedy = graphed.decode(*step)
        expected, expected_greedy = eager.decode(*step)
        assert logits.shape[0] == n
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert greedy == expected_greedy


def test_prefill_graphs_write_and_return_what_the_eager_prefill_does(model: Transformer) -> None:
    """Short prefills replay a capture per (rows, length), whatever their first slot: the same logits and keys as
    the eager pass of a decoder without graphs, at every first slot, including prompts that wait together."""
    graphed, eager = decoder(model, graphs=True), decoder(model, graphs=False)
    trio = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
    cases = [(0, PROMPTS[:1]), (2, PROMPTS[1:2]), (1, PROMPTS[2:4]), (0, trio), (1, PROMPTS[5:])]
    for first, prompts in cases:
        length = bucket(graphed.lengths, max(map(len, prompts)))
        assert (len(prompts), length) in graphed.graphed_prefills()
        got, expected = graphed.prefill(first, prompts), eager.prefill(first, prompts)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
        for i, prompt in enumerate(prompts):
            for cache in ("k", "v"):
                written = getattr(graphed.kv, cache)[:, first + i, :, : len(prompt)]
                torch.testing.assert_close(written, getattr(eager.kv, cache)[:, first + i, :, : len(prompt)])


def test_batched_greedy_with_graphs_equals_generate(model: Transformer) -> None:
    params = [SamplingParams(n) for n in MAX_TOKENS]
    batched, sizes, _ = run(model, 3, params, graphs=True)
    assert max(sizes) == 3
    for prompt, p, b in zip(PROMPTS, params, batched, strict=True):
        assert b.tokens == list(generate(model, prompt, p.max_tokens))


def test_a_standby_reserves_its_kv_cache_and_graphs_and_promote_allocates_nothing(
    tiny_model: Path, model: Transformer
) -> None:
    flags = ("--device", DEVICE, "--kv-cache-tokens", "256", "--max-batch", "4", "--role", "standby")
    with EngineProcess(tiny_model, *flags, token=TOKEN) as engine:
        health = engine.client.get(Endpoint.STANDBY).json()
        assert health["kv_cache_bytes"] > 0 and health["cuda_graph_bytes"] > 0
        promoted = engine.post(Endpoint.PROMOTE).json()
        assert promoted["kv_cache_bytes"] == health["kv_cache_bytes"]
        assert "reserved at start-up" in promoted["message"]
        prompt = "The quick brown fox"
        body = engine.complete(prompt=prompt, max_tokens=24, temperature=0).json()
        tokenizer = load_tokenizer(tiny_model)
        expected = tokenizer.decode(list(generate(model, tokenizer.encode(prompt).ids, 24)))
        assert body["choices"][0]["text"] == expected
        demoted = engine.post(Endpoint.DEMOTE).json()
        assert (demoted["role"], demoted["kv_cache_bytes_released"]) == ("standby", 0)
        assert engine.client.get(Endpoint.STANDBY).json()["kv_cache_bytes"] == health["kv_cache_bytes"]
    with EngineProcess(tiny_model, *flags, "--no-cuda-graphs", token=TOKEN) as engine:
        health = engine.client.get(Endpoint.STANDBY).json()
        assert (health["kv_cache_bytes"], health["cuda_graph_bytes"]) == (0, 0)
        assert engine.post(Endpoint.PROMOTE).json()["kv_cache_bytes"] > 0


@pytest.fixture(scope="module")
def bf16_model(tiny_model: Path) -> Transformer:
    return load_model(tiny_model, LoadSpec(device=DEVICE, dtype="bf16")).model


def test_batch_invariant_rows_are_bitwise_the_same_whatever_shares_the_step(bf16_model: Transformer) -> None:
    """In bf16 a row's logits may round differently with the step's batch size; batch-invariant, a row computes
    the same bits alone and beside three others, from a prefill of its prompt alone."""
    kv = KVCache.allocate(bf16_model.config, bf16_model.tp, 4, 64, bf16_model.device, bf16_model.dtype)
    invariant = Decoder(bf16_model, kv, graphs=True, batch_invariant=True)
    invariant.warm_up()
    assert list(invariant._graphs) == [(4, 64)]
    first = invariant.prefill(0, [PROMPTS[0]])
    alone, _ = invariant.decode([11], [len(PROMPTS[0])])
    for slot, prompt in enumerate(PROMPTS[:4]):
        again = invariant.prefill(slot, [prompt])
        if slot == 0:
            assert torch.equal(again, first)
    beside, _ = invariant.decode([11, 12, 13, 14], [len(prompt) for prompt in PROMPTS[:4]])
    assert torch.equal(beside[0], alone[0])


def test_batch_invariant_sequences_and_replayed_continuations_match_alone(bf16_model: Transformer) -> None:
    """Batch-invariant with graphs in bf16: each sequence generates what it generates alone, and a continuation
    that replays the first tokens through decode steps generates the rest of the uncut run."""
    params = [SamplingParams(n) for n in MAX_TOKENS]
    together, sizes, _ = run(bf16_model, 3, params, graphs=True, batch_invariant=True)
    assert set(sizes) == {3}
    for prompt, p, t in zip(PROMPTS, params, together, strict=True):
        (alone,), _, _ = run(bf16_model, 3, [p], graphs=True, batch_invariant=True, sequences=[(prompt, 0)])
        assert t.tokens == alone.tokens
    prompt, total, cut = PROMPTS[1], 30, 12
    (uncut,), _, _ = run(
        bf16_model, 3, [SamplingParams(total)], graphs=True, batch_invariant=True, sequences=[(prompt, 0)]
    )
    rest = [SamplingParams(total - cut)]
    replayed = [(prompt + uncut.tokens[:cut], cut)]
    (continued,), _, _ = run(bf16_model, 3, rest, graphs=True, batch_invariant=True, sequences=replayed)
    assert continued.tokens == uncut.tokens[cut:]


def test_engines_compiling_at_once_fuse_kernels_that_compute_bitwise_alike(tmp_path: Path) -> None:
    """Two processes, each with an empty Inductor cache and compiling at the same time (a group's engines starting
    on a fresh machine), compute the fused reductions bitwise alike (``standby.fused``: no kernel chosen by timing
    it), so a continuation decoding on one engine's keys and values computes what the other engine would have."""
    outputs = [tmp_path / f"{i}.safetensors" for i in range(2)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", FUSED_PROBE, str(out)],
            env=ENV | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{i}")},
        )
        for i, out in enumerate(outputs)
    ]
    try:
        assert [p.wait(timeout=240) for p in processes] == [0, 0]
    finally:
        for p in processes:
            p.kill()
            p.wait()
    first, second = (load_file(out) for out in outputs)
    assert first.keys() == second.keys()
    assert [name for name in first if not torch.equal(first[name], second[name])] == []
