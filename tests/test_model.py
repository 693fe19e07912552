"""The reference model against independent, naive implementations of what it should compute."""

from __future__ import annotations

import math
import queue
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from hotweights import quant
from hotweights.layout import ModelConfig, processed_tensors
from hotweights.standby.decoder import Decoder, length_buckets
from hotweights.standby.model import Fp8BlockLinear, KVCache, TensorParallel, Transformer, generate
from tests.attentionhelpers import held

CONFIG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=64,
)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A full (TP=1) float32 state dict; norms near one so a wrong norm weight shows."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Transformer(config, torch.float32).named_parameters()}
    g = torch.Generator().manual_seed(seed)
    return {
        name: (1.0 if "norm" in name else 0.0) + 0.15 * torch.randn(shape, generator=g)
        for name, shape in shapes.items()
    }


def build(config: ModelConfig, state: dict[str, torch.Tensor], tp: TensorParallel | None = None) -> Transformer:
    model = Transformer(config, torch.float32, tp or TensorParallel())
    model.load_state_dict(state, strict=True)
    return model


def shard(state: dict[str, torch.Tensor], config: ModelConfig, size: int, rank: int) -> dict[str, torch.Tensor]:
    """Split a TP=1 state dict for one rank, following docs/architecture.md's table."""
    hd = config.head_dim
    sizes = [config.num_attention_heads * hd, config.num_key_value_heads * hd, config.num_key_value_heads * hd]
    out = {}
    for name, w in state.items():
        if name.endswith("qkv_proj.weight"):
            out[name] = torch.cat([part.chunk(size)[rank] for part in w.split(sizes)])
        elif name.endswith("gate_up_proj.weight"):
            out[name] = torch.cat([part.chunk(size)[rank] for part in w.chunk(2)])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = w.chunk(size, dim=1)[rank]
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            out[name] = w.chunk(size)[rank]
        else:
            out[name] = w
    return out


def naive_forward(config: ModelConfig, state: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Llama written out head by head with explicit loops and masks: the reference for the model."""
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    T = ids.shape[1]

    def rms(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w

    def rotate(x):  # (T, hd), rotate-half: dims i and i + hd/2 form a pair
        half = hd // 2
        out = torch.empty_like(x)
        for t in range(T):
            for i in range(half):
                angle = t / config.rope_theta ** (2 * i / hd)
                c, s = math.cos(angle), math.sin(angle)
                out[:, t, i] = x[:, t, i] * c - x[:, t, i + half] * s
                out[:, t, i + half] = x[:, t, i + half] * c + x[:, t, i] * s
        return out

    x = state["embed_tokens.weight"][ids]  # (B, T, H)
    causal = torch.ones(T, T).tril().bool()
    for layer in range(config.num_hidden_layers):
        p = f"layers.{layer}."
        h = rms(x, state[p + "input_layernorm.weight"])
        wq, wk, wv = state[p + "self_attn.qkv_proj.weight"].split([nh * hd, nkv * hd, nkv * hd])
        heads = []
        for i in range(nh):
            j = i // (nh // nkv)  # the kv head this q head shares
            q = rotate(h @ wq[i * hd : (i + 1) * hd].T)
            k = rotate(h @ wk[j * hd : (j + 1) * hd].T)
            v = h @ wv[j * hd : (j + 1) * hd].T
            scores = (q @ k.transpose(1, 2) / math.sqrt(hd)).masked_fill(~causal, float("-inf"))
            heads.append(scores.softmax(-1) @ v)
        x = x + torch.cat(heads, -1) @ state[p + "self_attn.o_proj.weight"].T
        h = rms(x, state[p + "post_attention_layernorm.weight"])
        gate, up = (h @ state[p + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
        x = x + (gate * torch.sigmoid(gate) * up) @ state[p + "mlp.down_proj.weight"].T
    head = state.get("lm_head.weight", state["embed_tokens.weight"])
    return rms(x, state["norm.weight"]) @ head.T


def expected_shapes(config: ModelConfig, tp: int) -> dict[str, tuple[int, ...]]:
    """The table in docs/architecture.md, written out."""
    H, inter, V = config.hidden_size, config.intermediate_size, config.vocab_size
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes = {"embed_tokens.weight": (V // tp, H), "norm.weight": (H,)}
    for i in range(config.num_hidden_layers):
        shapes |= {
            f"layers.{i}.input_layernorm.weight": (H,),
            f"layers.{i}.self_attn.qkv_proj.weight": ((nh + 2 * nkv) // tp * hd, H),
            f"layers.{i}.self_attn.o_proj.weight": (H, nh // tp * hd),
            f"layers.{i}.post_attention_layernorm.weight": (H,),
            f"layers.{i}.mlp.gate_up_proj.weight": (2 * inter // tp, H),
            f"layers.{i}.mlp.down_proj.weight": (H, inter // tp),
        }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V // tp, H)
    return shapes


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_meta_build_has_exactly_the_documented_parameters(tied: bool, tp: int) -> None:
    config = ModelConfig(tie_word_embeddings=tied)
    with torch.device("meta"):
        model = Transformer(config, torch.bfloat16, TensorParallel(size=tp, rank=tp - 1))
    params = dict(model.named_parameters())
    assert {name: tuple(p.shape) for name, p in params.items()} == expected_shapes(config, tp)
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params.values())
    assert set(model.state_dict()) == set(params)
    assert list(model.buffers()) == []


def test_meta_build_fp8_adds_scales_to_projections_only() -> None:
    config = ModelConfig(quant="fp8-block", hidden_size=200, intermediate_size=300)
    with torch.device("meta"):
        model = Transformer(config, torch.bfloat16)
    params = dict(model.named_parameters())
    shapes = expected_shapes(config, 1)
    for name, shape in shapes.items():
        if name.endswith("_proj.weight"):
            assert params[name].dtype == torch.float8_e4m3fn
            scale = params[name.replace(".weight", ".weight_scale_inv")]
            assert (tuple(scale.shape), scale.dtype) == (quant.scale_shape(*shape), torch.float32)
        else:
            assert params[name].dtype == torch.bfloat16
    assert len(params) == len(shapes) + 4 * config.num_hidden_layers


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_shared_layout_lists_exactly_the_models_parameters(quantized: bool, tied: bool, tp: int) -> None:
    """The cache daemon learns its tensor list from hotweights.layout, the engine from its model: they agree."""
    config = ModelConfig(tie_word_embeddings=tied, quant="fp8-block" if quantized else None, hidden_size=200)
    with torch.device("meta"):
        model = Transformer(config, torch.bfloat16, TensorParallel(size=tp, rank=tp - 1))
    expected = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
    assert processed_tensors(config, torch.bfloat16, tp) == expected


def test_forward_matches_naive_reference() -> None:
    state = random_weights(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = build(CONFIG, state)(ids)
    assert logits.shape == (2, 9, CONFIG.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, naive_forward(CONFIG, state, ids), rtol=1e-4, atol=1e-4)


def test_tied_model_uses_embedding_as_head() -> None:
    config = ModelConfig(**{**CONFIG.__dict__, "tie_word_embeddings": True})
    state = random_weights(config)
    ids = torch.arange(6)[None]
    torch.testing.assert_close(build(config, state)(ids), naive_forward(config, state, ids), rtol=1e-4, atol=1e-4)


def test_kv_cache_decoding_matches_full_forward() -> None:
    model = build(CONFIG, random_weights(CONFIG))
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    full = model(ids)
    cache = KVCache.allocate(CONFIG, TensorParallel(), 2, 16, "cpu", torch.float32)
    assert cache.nbytes == 2 * (2 * 3 * 16 * 2 * 16) * 4  # k and v, each (L, blocks, 16, nkv, hd), fp32
    assert cache.max_tokens == 16 and cache.batch == 2 and cache.table.tolist() == [[1], [2]]  # block 0: the null one
    # A 5-token prefill, a 3-token chunk at start_pos 5 (needs the offset causal mask), then single tokens.
    pieces = [model(ids[:, :5], 0, cache), model(ids[:, 5:8], 5, cache)]
    pieces += [model(ids[:, t : t + 1], t, cache) for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="16"):
        model(ids[:, :5], 12, cache)


def test_batched_decode_matches_full_forward_per_row() -> None:
    """Three rows at different positions in one decode step, over more KV positions than any row uses:
    each row's logits are its own sequence's, as a full forward computes them."""
    model = build(CONFIG, random_weights(CONFIG))
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g) for n in (3, 9, 6)]
    cache = KVCache.allocate(CONFIG, TensorParallel(), 4, 32, "cpu", torch.float32)
    for slot, ids in enumerate(seqs):
        model(ids[None, :-1], 0, cache.rows(slot, 1))
    tokens = torch.stack([ids[-1] for ids in seqs])
    positions = torch.tensor([len(ids) - 1 for ids in seqs])
    logits = model.decode(tokens, positions, cache, kv_len=16)
    assert logits.shape == (3, CONFIG.vocab_size)
    for row, ids in enumerate(seqs):
        torch.testing.assert_close(logits[row], model(ids[None])[0, -1], rtol=1e-4, atol=1e-4)


def test_padded_prefill_matches_unpadded() -> None:
    """The decoder pads a prompt to a bucket length; the prompt's logits and keys are the unpadded ones."""
    assert length_buckets(100) == [16, 32, 64, 100] and length_buckets(16) == [16]
    model = build(CONFIG, random_weights(CONFIG))
    decoder = Decoder(model, KVCache.allocate(CONFIG, TensorParallel(), 2, 40, "cpu", torch.float32))
    prompt = list(range(20, 37))  # 17 tokens: padded to 32
    logits = decoder.prefill(1, [prompt])
    torch.testing.assert_close(logits[0], model(torch.tensor([prompt]))[0, -1], rtol=1e-4, atol=1e-4)
    reference = KVCache.allocate(CONFIG, TensorParallel(), 1, 40, "cpu", torch.float32)
    model(torch.tensor([prompt]), 0, reference)
    torch.testing.assert_close(held(decoder.kv, 1, 17), held(reference, 0, 17), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="1 prompts of up to 41 tokens"):
        decoder.prefill(0, [[1] * 41])


def test_prompts_prefilled_together_match_each_alone() -> None:
    """Two prompts in one pass (padded to the longer one's bucket): each one's logits and keys as if alone;
    a pass that would hold more than one slot's tokens is refused."""
    model = build(CONFIG, random_weights(CONFIG))
    decoder = Decoder(model, KVCache.allocate(CONFIG, TensorParallel(), 3, 64, "cpu", torch.float32))
    prompts = [[3, 1, 4], list(range(20, 37))]  # padded to 32 together
    logits = decoder.prefill(1, prompts)
    for row, prompt in enumerate(prompts):
        alone = KVCache.allocate(CONFIG, TensorParallel(), 1, 64, "cpu", torch.float32)
        torch.testing.assert_close(logits[row], model(torch.tensor([prompt]), 0, alone)[0, -1], rtol=1e-4, atol=1e-4)
        n = len(prompt)
        torch.testing.assert_close(held(decoder.kv, 1 + row, n), held(alone, 0, n), rtol=1e-5, atol=1e-5)
    assert decoder.prefill_fits(2, 32) and not decoder.prefill_fits(3, 32) and not decoder.prefill_fits(4, 1)
    with pytest.raises(ValueError, match="3 prompts of up to 17 tokens from slot 0"):
        decoder.prefill(0, [prompts[1]] * 3)
    with pytest.raises(ValueError, match="from slot 2"):
        decoder.prefill(2, prompts)


def test_fp8_block_linear_matches_blockwise_formula() -> None:
    g = torch.Generator().manual_seed(3)
    layer = Fp8BlockLinear(in_features=300, out_features=200)
    assert layer.weight.shape == (200, 300) and layer.weight_scale_inv.shape == (2, 3)
    assert not layer.weight.requires_grad and not layer.weight_scale_inv.requires_grad
    q = (torch.randn(200, 300, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) + 0.01
    layer.weight.copy_(q)
    layer.weight_scale_inv.copy_(s)
    rows, cols = torch.arange(200)[:, None] // 128, torch.arange(300)[None, :] // 128
    w = q.float() * s[rows, cols]
    x = torch.randn(4, 300, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_fp8_model_matches_float_model_with_dequantized_weights() -> None:
    config = ModelConfig(**{**CONFIG.__dict__, "quant": "fp8-block"})
    state, fp8_state = random_weights(CONFIG), {}
    for name, w in list(state.items()):
        if name.endswith("_proj.weight"):
            q, s = quant.quantize(w)
            fp8_state |= {name: q, name.replace(".weight", ".weight_scale_inv"): s}
            state[name] = quant.dequantize(q, s)
        else:
            fp8_state[name] = w
    ids = torch.arange(7)[None]
    torch.testing.assert_close(build(config, fp8_state)(ids), build(CONFIG, state)(ids), rtol=1e-5, atol=1e-5)


def greedy_without_cache(model: Transformer, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_generate_matches_argmax_of_full_forwards() -> None:
    model = build(CONFIG, random_weights(CONFIG))
    prompt = [5, 17, 99, 3]
    tokens = list(generate(model, prompt, 10))
    assert tokens == greedy_without_cache(model, prompt, 10)
    assert tokens == list(generate(model, prompt, 10))
    # top_p so small that only the most likely token survives is greedy, whatever the seed.
    assert list(generate(model, prompt, 10, temperature=1.0, top_p=1e-6, seed=7)) == tokens


def test_generate_stops_before_a_stop_id() -> None:
    model = build(CONFIG, random_weights(CONFIG))
    tokens = list(generate(model, [1, 2, 3], 10))
    stop = tokens[4]
    assert list(generate(model, [1, 2, 3], 10, stop_ids={stop})) == tokens[: tokens.index(stop)]


def test_sampling_is_deterministic_per_seed() -> None:
    model = build(CONFIG, random_weights(CONFIG))
    first, again, other = (list(generate(model, [1, 2], 16, temperature=1.0, seed=s)) for s in (0, 0, 1))
    assert len(first) == 16 and first == again
    assert first != other


def test_generate_validates_before_running() -> None:
    model = build(CONFIG, random_weights(CONFIG))
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], 4)
    with pytest.raises(ValueError, match=r"65 tokens.*64"):
        generate(model, [1] * 65, 4)
    small = KVCache.allocate(CONFIG, TensorParallel(), 1, 8, "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"9 tokens.*8"):
        generate(model, [1] * 9, 4, cache=small)
    # A full cache ends generation early instead of failing: 8 slots hold the prompt and 3 fed tokens.
    assert len(list(generate(model, [1] * 5, 10, cache=small))) == 4


@pytest.mark.parametrize(
    ("changes", "tp", "field"),
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 6}, 4, "num_attention_heads"),
        ({}, 4, "num_key_value_heads"),
        ({"intermediate_size": 511}, 2, "intermediate_size"),
        ({"vocab_size": 1023}, 2, "vocab_size"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, 1, "num_key_value_heads"),
    ],
)
def test_indivisible_tensor_parallel_is_rejected(changes: dict, tp: int, field: str) -> None:
    config = ModelConfig(**changes)
    with pytest.raises(ValueError, match=field) as info, torch.device("meta"):
        Transformer(config, torch.bfloat16, TensorParallel(size=tp))
    assert str(getattr(config, field)) in str(info.value)


def batched_step(model: Transformer, tp: TensorParallel) -> torch.Tensor:
    """Prefill three prompts of different lengths into slots 0, 1 and 3 and run one decode step over
    slots 0..3 (slot 2 a dummy row): the (4, V) logits."""
    cache = KVCache.allocate(model.config, tp, 4, 32, "cpu", torch.float32)
    decoder = Decoder(model, cache)
    for slot, prompt in ((0, [4, 8, 15]), (1, [16, 23, 42, 7, 1]), (3, [9])):
        decoder.prefill(slot, [prompt])
    return decoder.decode([5, 6, 0, 7], [3, 5, 0, 1])[0]


def _tp_worker(rank: int, workdir: str, results: mp.Queue) -> None:
    """One TP=2 rank: shard the saved TP=1 weights, run forward and generate, send back the outputs."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=2)
    try:
        tp = TensorParallel(size=2, rank=rank, group=dist.group.WORLD)
        out = {}
        for key, (fields, state, ids) in torch.load(f"{workdir}/inputs.pt").items():
            config = ModelConfig(**fields)
            model = build(config, shard(state, config, 2, rank), tp)
            out[key] = (
                model(ids).numpy(),  # by value: a shared tensor's fd dies with this process
                list(generate(model, [4, 8, 15], 6)),
                list(generate(model, [4, 8, 15], 6, temperature=1.0, seed=3)),
                list(generate(model, [4, 8, 15], 6, temperature=1.0)),  # seed agreed across ranks
                batched_step(model, tp).numpy(),
            )
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_two_ranks_match_single_rank() -> None:
    tied = ModelConfig(**{**CONFIG.__dict__, "tie_word_embeddings": True})
    ids = torch.randint(0, CONFIG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    inputs = {"untied": (CONFIG, random_weights(CONFIG), ids), "tied": (tied, random_weights(tied, seed=5), ids)}
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as workdir:
        torch.save({k: (c.__dict__, s, i) for k, (c, s, i) in inputs.items()}, Path(workdir) / "inputs.pt")
        results = ctx.Queue()
        procs = [ctx.Process(target=_tp_worker, args=(rank, workdir, results), daemon=True) for rank in (0, 1)]
        try:
            for p in procs:
                p.start()
            outputs, deadline = {}, time.monotonic() + 60
            while len(outputs) < len(procs):
                try:
                    rank, out = results.get(timeout=0.5)
                    outputs[rank] = {key: (torch.from_numpy(logits), *rest) for key, (logits, *rest) in out.items()}
                except queue.Empty:
                    exits = [p.exitcode for p in procs]
                    if any(exits) or time.monotonic() > deadline:
                        pytest.fail(f"TP workers gave no result (exit codes {exits}); see their stderr above")
            for p in procs:
                p.join(timeout=10)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    for key, (config, state, ids) in inputs.items():
        model = build(config, state)
        expected = model(ids)
        greedy = list(generate(model, [4, 8, 15], 6))
        seeded = list(generate(model, [4, 8, 15], 6, temperature=1.0, seed=3))
        step = batched_step(model, TensorParallel())
        for rank in (0, 1):
            logits, rank_greedy, rank_seeded, _, rank_step = outputs[rank][key]
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(torch.from_numpy(rank_step), step, rtol=1e-4, atol=1e-4)
            assert rank_greedy == greedy and rank_seeded == seeded
        assert outputs[0][key][3] == outputs[1][key][3]
