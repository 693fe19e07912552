"""The reference engine's decode on a real GPU: the split-KV attention kernels against their reference and masked
SDPA, CUDA graphs (one decode graph per batch size, every KV length) against eager decode, batching against
``generate``, and an engine process that reserves its KV cache and graphs at start-up (skipped without CUDA;
``bench/gpu_suite.py`` runs it on the H200)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hotweights.cache.loadspec import LoadSpec
from hotweights.contract import Endpoint
from hotweights.standby.decodeattention import supported
from hotweights.standby.decoder import GRAPHED_PREFILL, Decoder
from hotweights.standby.model import KVCache, Transformer, generate
from hotweights.standby.scheduler import SamplingParams
from hotweights.standby.weights import load_model
from hotweights.tokenizer import load_tokenizer
from tests import fusedhelpers
from tests.attentionhelpers import held, mismatches, model_mismatches
from tests.cachehelpers import ENV
from tests.enginehelpers import EngineProcess
from tests.test_scheduler import MAX_TOKENS, PROMPTS, run

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICE = "cuda:0"
TOKEN = "cuda-test-token"


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Transformer:
    return load_model(tiny_model, LoadSpec(device=DEVICE)).model


def decoder(model: Transformer, graphs: bool, batch: int = 3) -> Decoder:
    kv = KVCache.allocate(model.config, model.tp, batch, 64, model.device, model.dtype)
    made = Decoder(model, kv, graphs)
    made.warm_up()
    return made


def test_a_later_graphed_decoder_of_the_host_reads_the_longest_prefill_time_instead_of_running_it(
    model: Transformer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOTWEIGHTS_HOME", str(tmp_path))
    positions = 4 * GRAPHED_PREFILL  # the longest prefill is not a graphed one's too
    first = Decoder(model, KVCache.allocate(model.config, model.tp, 3, positions, model.device, model.dtype), True)
    first.warm_up()
    longest = (1, positions)
    assert first.prefill_times[longest] > 0
    later = Decoder(model, KVCache.allocate(model.config, model.tp, 3, positions, model.device, model.dtype), True)
    ran: list[tuple[int, int]] = []
    timed = later._timed_prefill
    monkeypatch.setattr(later, "_timed_prefill", lambda rows, length: ran.append((rows, length)) or timed(rows, length))
    later.warm_up()
    assert longest not in ran and ran  # the graphed prefills' first replays still ran
    assert later.prefill_times[longest] == first.prefill_times[longest]
    assert first.warm_up_times.prefills_run == [longest] and later.warm_up_times.prefills_run == []  # what logs say


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


def test_split_kv_kernels_compute_their_reference_and_masked_sdpa_on_the_gpu() -> None:
    """The CPU tests' cases (``tests/attentionhelpers.py``) compiled for the GPU: every group, head dim and dtype,
    rows at lengths around a split's bounds, within the dtype's tolerance, a row's bits the same alone; a small
    model's decode steps with split-KV attention against masked SDPA."""
    assert mismatches(DEVICE) + model_mismatches(DEVICE) == []


def test_the_kernels_serve_power_of_two_head_dims_up_to_128_in_16_and_32_bit_floats() -> None:
    cuda = torch.device(DEVICE)
    head_dims = {hd: supported(cuda, torch.bfloat16, hd) for hd in (8, 16, 64, 80, 128, 256)}
    assert head_dims == {8: False, 16: True, 64: True, 80: False, 128: True, 256: False}
    dtypes = {dtype: supported(cuda, dtype, 64) for dtype in (torch.float16, torch.float32, torch.float64)}
    assert dtypes == {torch.float16: True, torch.float32: True, torch.float64: False}
    assert not supported(torch.device("cpu"), torch.bfloat16, 64)


def test_one_graph_per_batch_size_serves_every_kv_length_as_eager_steps_do(model: Transformer) -> None:
    """A graphed decoder reads each row's own length: one decode graph per batch size, and at positions on both sides
    of every old KV length bucket (16 .. 512) and of the kernels' splits (256, 512), rows far apart in one step,
    each row's logits are the eager (masked SDPA) step's."""
    max_tokens, batch = 600, 3
    graphed, eager = (
        Decoder(model, KVCache.allocate(model.config, model.tp, batch, max_tokens, model.device, model.dtype), graphs)
        for graphs in (True, False)
    )
    graphed.warm_up()
    assert graphed.split_kv and graphed.kv_lengths == [max_tokens]
    assert sorted(graphed._graphs) == [(n, max_tokens) for n in graphed.graph_batches] == [(1, 600), (2, 600), (3, 600)]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (590,), generator=g).tolist() for _ in range(batch)]
    for d in (graphed, eager):
        for slot, prompt in enumerate(prompts):
            d.prefill(slot, [prompt])
    bounds = [15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 255, 256, 257, 511, 512, 513, 598, 599]
    for position in bounds:
        for positions in ([position], [position, max(position - 200, 0), (position * 7) % 590]):
            tokens = [(position + i) % model.config.vocab_size for i in range(len(positions))]
            logits, greedy = graphed.decode(tokens, positions)
            expected, expected_greedy = eager.decode(tokens, positions)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
            assert greedy == expected_greedy


def test_greedy_with_graphs_across_splits_equals_generate(model: Transformer) -> None:
    """A sequence whose decode steps cross the kernels' first split (256 positions): the graphed decoder's greedy
    tokens are ``generate``'s, whose steps attend with masked SDPA."""
    prompt, new = list(range(1, 250)), 40
    d = Decoder(model, KVCache.allocate(model.config, model.tp, 2, 320, model.device, model.dtype), graphs=True)
    d.warm_up()
    token = int(d.prefill(0, [prompt])[0].argmax())
    tokens = [token]
    for position in range(len(prompt), len(prompt) + new - 1):
        tokens.append(d.decode([tokens[-1]], [position])[1][0])
    assert tokens == list(generate(model, prompt, new))


def test_a_step_between_captured_batch_sizes_replays_the_next_one_with_free_rows(model: Transformer) -> None:
    """Batch 12 captures sizes 1, 2, 4, 8 and 12: steps of 11, 5 and 3 rows replay 12, 8 and 4, and each row's
    logits are the eager step's. Fewer rows each time, as the scheduler guarantees: the extra rows are free."""
    graphed, eager = decoder(model, graphs=True, batch=12), decoder(model, graphs=False, batch=12)
    assert graphed.graph_batches == [1, 2, 4, 8, 12]
    assert sorted(graphed._graphs) == [(n, 64) for n in (1, 2, 4, 8, 12)]  # one per batch size
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
    """Short prefills replay a capture per prompt count of ``batch_buckets``, whatever their first slot (the graph
    writes through its copy of their rows' block table): the same logits and keys as the eager pass of a decoder
    without graphs, at every first slot, including prompts that wait together; three prompts replay the capture of
    four, whose padding row leaves the slot after them as it was."""
    graphed, eager = decoder(model, graphs=True, batch=5), decoder(model, graphs=False, batch=5)
    assert graphed.prefill_rows == [1, 2, 4, 5]
    assert graphed.graphed_prefills() == [(1, 64), (2, 32), (4, 16)]  # prompts x length within the cache's 64
    trio = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
    cases = [(3, PROMPTS[1:2]), (0, PROMPTS[:1]), (2, PROMPTS[1:2]), (1, PROMPTS[2:4]), (0, trio), (4, PROMPTS[5:])]
    for first, prompts in cases:
        assert graphed.graphed_shape(len(prompts), max(map(len, prompts))) in graphed.graphed_prefills()
        got, expected = graphed.prefill(first, prompts), eager.prefill(first, prompts)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
        for i, prompt in enumerate(prompts):
            torch.testing.assert_close(held(graphed.kv, first + i, len(prompt)), held(eager.kv, first + i, len(prompt)))
    # Slot 3 held PROMPTS[1] before the trio's padded prefill of slots 0 .. 3.
    torch.testing.assert_close(held(graphed.kv, 3, len(PROMPTS[1])), held(eager.kv, 3, len(PROMPTS[1])))


def test_batched_greedy_with_graphs_equals_generate(model: Transformer) -> None:
    params = [SamplingParams(n) for n in MAX_TOKENS]
    batched, sizes, _ = run(model, 3, params, graphs=True)
    assert max(sizes) == 3
    for prompt, p, b in zip(PROMPTS, params, batched, strict=True):
        assert b.tokens == list(generate(model, prompt, p.max_tokens))


def test_sequences_waiting_for_kv_blocks_with_graphs_equal_generate(model: Transformer) -> None:
    """Graphed decode and prefill through block tables the scheduler fills as sequences come and go over a pool of 5
    blocks (they wait for blocks as well as slots): each sequence's greedy tokens are ``generate``'s."""
    params = [SamplingParams(n) for n in MAX_TOKENS]
    batched, sizes, _ = run(model, 3, params, graphs=True, blocks=6)
    assert max(sizes) >= 2
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


def test_fused_kernels_compute_plain_torch_on_the_gpu() -> None:
    """The CPU tests' cases (``tests/fusedhelpers.py``) compiled for the GPU: RMSNorm with and without the residual
    add, RoPE in decode's and prefill's layouts, SwiGLU, every dtype, within tolerance of plain torch, and RMSNorm's
    rows bitwise the same alone as in a batch."""
    assert fusedhelpers.mismatches(DEVICE) == []


def _fused_probe(out: Path, cache: Path) -> subprocess.Popen[str]:
    command = [sys.executable, fusedhelpers.__file__, "probe", str(out)]
    return subprocess.Popen(command, env=ENV | {"TRITON_CACHE_DIR": str(cache)}, stdout=subprocess.PIPE, text=True)


def _cached(cache: Path) -> list[Path]:
    return sorted(path.relative_to(cache) for path in cache.rglob("*"))


def test_engines_compiling_at_once_fuse_kernels_alike_and_a_later_one_only_loads_them(tmp_path: Path) -> None:
    """Two processes, each with an empty Triton cache and compiling at the same time (a group's engines starting on a
    fresh machine), compute the fused kernels bitwise alike (``standby.fused``: no kernel chosen by timing it), so a
    continuation decoding on one engine's keys and values computes what the other engine would have. A third process
    on the first one's cache (a later engine of the host) compiles nothing: the cache gains no file, and its outputs
    are the same bits. (Each kernel's first call there is timed by ``bench/warmup.py``'s kernel check, not bounded
    here.)"""
    caches, outputs = [tmp_path / f"triton-{i}" for i in range(2)], [tmp_path / f"{i}.safetensors" for i in range(3)]
    processes = [_fused_probe(out, cache) for out, cache in zip(outputs[:2], caches, strict=True)]
    try:
        assert [p.wait(timeout=240) for p in processes] == [0, 0]
        compiled = _cached(caches[0])
        later = _fused_probe(outputs[2], caches[0])
        processes.append(later)
        stdout, _ = later.communicate(timeout=240)
        assert later.returncode == 0
    finally:
        for p in processes:
            p.kill()
            p.communicate()
    assert _cached(caches[0]) == compiled
    first_calls = json.loads(stdout.splitlines()[-1])["first_call_s"]
    assert set(first_calls) == {"rms_norm", "add_rms_norm", "rope", "silu_mul"}
    first, *others = (load_file(out) for out in outputs)
    for other in others:
        assert first.keys() == other.keys()
        assert [name for name in first if not torch.equal(first[name], other[name])] == []
