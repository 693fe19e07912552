"""The load pipeline and binding, on real checkpoints written to disk."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from hotweights import quant
from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.pipeline import load_processed, processed_config
from hotweights.errors import BindingError, ConfigError
from hotweights.layout import ModelConfig
from hotweights.spawn import hotweights_command
from hotweights.standby.model import TensorParallel
from hotweights.standby.weights import bind, build_meta_model, build_model, expected_tensors, load_from_disk
from tests.conftest import make_checkpoint


def logits_of(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids]))


def recombine(shards: list[dict[str, torch.Tensor]], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Undo a TP split: the inverse of the pipeline's shard + fuse, written independently."""
    tp = len(shards)
    hd = config.head_dim
    q, kv = config.num_attention_heads * hd // tp, config.num_key_value_heads * hd // tp
    inter = config.intermediate_size // tp
    out: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        if name.endswith("qkv_proj.weight"):
            qs, ks, vs = zip(*(p.split([q, kv, kv]) for p in parts), strict=True)
            out[name] = torch.cat([*qs, *ks, *vs])
        elif name.endswith("gate_up_proj.weight"):
            gates, ups = zip(*(p.split([inter, inter]) for p in parts), strict=True)
            out[name] = torch.cat([*gates, *ups])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = torch.cat(parts, dim=1)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            out[name] = torch.cat(parts)
        else:
            assert all(torch.equal(parts[0], p) for p in parts), f"replicated {name} differs across ranks"
            out[name] = parts[0]
    return out


def test_processed_names_match_the_meta_model(tiny_model: Path) -> None:
    checkpoint = read_checkpoint(tiny_model)
    tensors = load_processed(checkpoint, LoadSpec(), progress=False)
    meta = build_meta_model(checkpoint.config, torch.float32, TensorParallel())
    expected = expected_tensors(meta)
    assert set(tensors) == set(expected)
    for name, tensor in tensors.items():
        assert (tuple(tensor.shape), tensor.dtype) == expected[name], name


def test_binding_is_zero_copy_and_leaves_nothing_on_meta(tiny_model: Path) -> None:
    checkpoint = read_checkpoint(tiny_model)
    tensors = load_processed(checkpoint, LoadSpec(), progress=False)
    model = build_model(checkpoint.config, torch.float32, TensorParallel(), tensors)
    params = dict(model.named_parameters())
    for name, tensor in tensors.items():
        assert params[name].data_ptr() == tensor.data_ptr(), f"{name} was copied"
        assert not params[name].is_meta


def test_binding_names_the_offending_tensor(tiny_model: Path) -> None:
    checkpoint = read_checkpoint(tiny_model)
    tensors = load_processed(checkpoint, LoadSpec(), progress=False)
    meta = lambda: build_meta_model(checkpoint.config, torch.float32, TensorParallel())  # noqa: E731

    missing = {k: v for k, v in tensors.items() if k != "layers.1.mlp.down_proj.weight"}
    with pytest.raises(BindingError, match=r"layers\.1\.mlp\.down_proj\.weight"):
        bind(meta(), missing)
    with pytest.raises(BindingError, match=r"bogus\.weight"):
        bind(meta(), {**tensors, "bogus.weight": torch.zeros(1)})
    wrong_shape = {**tensors, "norm.weight": torch.zeros(7)}
    with pytest.raises(BindingError, match=r"norm\.weight.*\[7\]"):
        bind(meta(), wrong_shape)
    wrong_dtype = {**tensors, "norm.weight": tensors["norm.weight"].half()}
    with pytest.raises(BindingError, match=r"norm\.weight.*float16"):
        bind(meta(), wrong_dtype)


def test_tp2_recombined_gives_tp1_logits(tiny_model: Path) -> None:
    checkpoint = read_checkpoint(tiny_model)
    whole = load_processed(checkpoint, LoadSpec(), progress=False)
    shards = [load_processed(checkpoint, LoadSpec(tp_size=2, tp_rank=r), progress=False) for r in range(2)]
    assert (
        shards[0]["layers.0.self_attn.qkv_proj.weight"].shape[0] * 2
        == whole["layers.0.self_attn.qkv_proj.weight"].shape[0]
    )
    rebuilt = recombine(shards, checkpoint.config)
    ids = [5, 17, 300, 2, 9, 44]
    reference = logits_of(build_model(checkpoint.config, torch.float32, TensorParallel(), whole), ids)
    candidate = logits_of(build_model(checkpoint.config, torch.float32, TensorParallel(), rebuilt), ids)
    torch.testing.assert_close(candidate, reference, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_have_no_lm_head(tiny_tied_model: Path) -> None:
    tensors = load_processed(tiny_tied_model, LoadSpec(), progress=False)
    assert "lm_head.weight" not in tensors
    model = load_from_disk(read_checkpoint(tiny_tied_model), LoadSpec())
    assert logits_of(model, [1, 2, 3]).shape[-1] == 1024


def test_fp8_checkpoint_keeps_block_scales(tiny_fp8_model: Path) -> None:
    checkpoint = read_checkpoint(tiny_fp8_model)
    assert checkpoint.config.quant == "fp8-block"
    tensors = load_processed(checkpoint, LoadSpec(), progress=False)
    qkv = tensors["layers.0.self_attn.qkv_proj.weight"]
    scale = tensors["layers.0.self_attn.qkv_proj.weight_scale_inv"]
    assert qkv.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert tuple(scale.shape) == quant.scale_shape(*qkv.shape)
    model = load_from_disk(checkpoint, LoadSpec())
    assert torch.isfinite(logits_of(model, [3, 4, 5])).all()


def test_fp8_checkpoint_refuses_a_split_off_block_edges(tiny_fp8_model: Path) -> None:
    with pytest.raises(ConfigError, match="multiple of 128"):
        load_processed(tiny_fp8_model, LoadSpec(tp_size=2, tp_rank=0), progress=False)


def test_quantize_at_load_is_within_e4m3_error(tiny_model: Path) -> None:
    checkpoint = read_checkpoint(tiny_model)
    plain = load_processed(checkpoint, LoadSpec(), progress=False)
    quantized = load_processed(checkpoint, LoadSpec(quantize="fp8-block"), progress=False)
    assert processed_config(checkpoint, LoadSpec(quantize="fp8-block")).quant == "fp8-block"
    for name in ("layers.0.self_attn.qkv_proj.weight", "layers.1.mlp.down_proj.weight"):
        original = plain[name]
        restored = quant.dequantize(quantized[name], quantized[name + "_scale_inv"])
        # e4m3 keeps 3 mantissa bits: rounding error <= 2**-4 relative, or half the subnormal step (2**-10 * s).
        scale = quantized[name + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
        bound = original.abs() * 2**-4 + scale[: original.shape[0], : original.shape[1]] * 2**-10
        assert ((restored - original).abs() <= bound).all(), name
        assert not torch.equal(restored, original)


def test_bad_tp_request_names_the_field(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads=2 is not divisible by --tp-size 4"):
        load_processed(tiny_model, LoadSpec(tp_size=4, tp_rank=0), progress=False)
    with pytest.raises(ConfigError, match="--tp-rank"):
        load_processed(tiny_model, LoadSpec(tp_size=2, tp_rank=2), progress=False)
    with pytest.raises(ConfigError, match="--tp-size must be >= 1, found 0"):
        load_processed(tiny_model, LoadSpec(tp_size=0, tp_rank=0), progress=False)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(hotweights_command(*args), capture_output=True, text=True, timeout=240)


def test_generate_cli_is_deterministic_and_tp2_agrees(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "m", seed=3)
    first = run_cli("generate", "--model", str(model), "--prompt", "The weather", "--max-tokens", "12")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip(), "no completion printed"
    second = run_cli("generate", "--model", str(model), "--prompt", "The weather", "--max-tokens", "12")
    assert second.stdout == first.stdout
    tp2 = run_cli("generate", "--model", str(model), "--prompt", "The weather", "--max-tokens", "12", "--tp-size", "2")
    assert tp2.returncode == 0, tp2.stderr
    assert tp2.stdout == first.stdout


def test_generate_fp8_checkpoint_from_cli(tiny_fp8_model: Path) -> None:
    result = run_cli("generate", "--model", str(tiny_fp8_model), "--prompt", "Hello", "--max-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_generate_refuses_bad_sampling_flags_before_loading(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"  # never read: the flags are checked first
    for flag, value, expected in (("--temperature", "-1", "--temperature must be >= 0"), ("--top-p", "0", "--top-p")):
        result = run_cli("generate", "--model", str(missing), "--prompt", "hi", flag, value)
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
