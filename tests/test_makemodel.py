"""make-model: the checkpoint layout, determinism, block FP8, the tokenizer and the CLI."""

from __future__ import annotations

import json
import math
import os
import re
import resource
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer

from hotweights import quant
from hotweights.cache import makemodel, maketokenizer
from hotweights.cache.makemodel import PRESETS, write_checkpoint
from hotweights.cli import main
from hotweights.errors import ConfigError
from hotweights.layout import ModelConfig, checkpoint_tensors
from hotweights.spawn import hotweights_command

TINY = PRESETS["tiny"]
# Dims that are not multiples of 128 and heads != kv heads, so shapes and FP8 padding are exercised.
ODD = ModelConfig(
    vocab_size=320,
    hidden_size=192,
    intermediate_size=200,
    num_hidden_layers=1,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
)


def write(out: Path, config: ModelConfig = TINY, **kwargs) -> Path:
    return write_checkpoint(out, config, progress=False, **kwargs)


def load_all(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def currentcurrent_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("tiny") / "model")


def test_layout_and_index(tiny: Path) -> None:
    assert sorted(p.name for p in tiny.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    index = read_json(tiny / "model.safetensors.index.json")
    tensors = load_all(tiny)
    assert set(index["weight_map"]) == set(tensors) == set(makemodel.tensor_names(TINY, None))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    with safe_open(tiny / "model-00001-of-00001.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_hf_names_and_shapes(tmp_path: Path) -> None:
    tensors = load_all(write(tmp_path / "m", ODD))
    h, i, v = 192, 200, 320
    expected = {
        "model.embed_tokens.weight": (v, h),
        "model.layers.0.self_attn.q_proj.weight": (6 * 32, h),
        "model.layers.0.self_attn.k_proj.weight": (2 * 32, h),
        "model.layers.0.self_attn.v_proj.weight": (2 * 32, h),
        "model.layers.0.self_attn.o_proj.weight": (h, 6 * 32),
        "model.layers.0.mlp.gate_proj.weight": (i, h),
        "model.layers.0.mlp.up_proj.weight": (i, h),
        "model.layers.0.mlp.down_proj.weight": (h, i),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected


def test_tied_embeddings_omit_lm_head(tmp_path: Path) -> None:
    out = write(tmp_path / "m", ModelConfig(tie_word_embeddings=True))
    assert "lm_head.weight" not in read_json(out / "model.safetensors.index.json")["weight_map"]
    assert read_json(out / "config.json")["tie_word_embeddings"] is True


def test_config_files(tiny: Path) -> None:
    config = read_json(tiny / "config.json")
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id("<|begin_of_text|>"), tokenizer.token_to_id("<|end_of_text|>")
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": TINY.rms_norm_eps,
        "rope_theta": TINY.rope_theta,
        "max_position_embeddings": TINY.max_position_embeddings,
        "tie_word_embeddings": False,
        "vocab_size": 1024,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    assert tokenizer.get_vocab_size() <= config["vocab_size"]
    generation = read_json(tiny / "generation_config.json")
    assert generation == {
        "bos_token_id": bos,
        "eos_token_id": eos,
        "do_sample": False,
        "max_length": TINY.max_position_embeddings,
    }
    tokenizer_config = read_json(tiny / "tokenizer_config.json")
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == (
        "<|begin_of_text|>",
        "<|end_of_text|>",
    )


def test_dtype_recorded(tmp_path: Path) -> None:
    out = write(tmp_path / "m", dtype=torch.float16)
    assert read_json(out / "config.json")["torch_dtype"] == "float16"
    assert {t.dtype for t in load_all(out).values()} == {torch.float16}


def test_same_seed_is_byte_identical_and_seed_matters(tmp_path: Path, tiny: Path) -> None:
    again = write(tmp_path / "again")
    other = write(tmp_path / "other", seed=1)
    shard = "model-00001-of-00001.safetensors"
    assert (again / shard).read_bytes() == (tiny / shard).read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    a, b = load_all(tiny), load_all(other)
    assert all(not torch.equal(a[name], b[name]) for name in a if not name.endswith("norm.weight"))
    assert not torch.equal(a["model.norm.weight"], b["model.norm.weight"])


def test_shard_size_splits_without_changing_values(tmp_path: Path, tiny: Path) -> None:
    out = write(tmp_path / "m", shard_size=600_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    index = read_json(out / "model.safetensors.index.json")
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:
        assert {n for n, f in index["weight_map"].items() if f == shard} == set(load_file(out / shard))
    split, whole = load_all(out), load_all(tiny)
    assert split.keys() == whole.keys()
    assert all(torch.equal(split[name], whole[name]) for name in whole)


def test_weights_are_cast_from_init_tensor(tiny: Path) -> None:
    tensors = load_all(tiny)
    for spec in checkpoint_tensors(TINY):
        assert torch.equal(tensors[spec.name], makemodel.init_tensor(spec, seed=0).bfloat16())


def test_fp8_block(tmp_path: Path) -> None:
    out = write(tmp_path / "m", ODD, quant="fp8-block")
    assert read_json(out / "config.json")["quantization_config"] == quant.QUANT_CONFIG
    tensors = load_all(out)
    assert set(tensors) == set(makemodel.tensor_names(ODD, "fp8-block"))
    quantized = [s for s in checkpoint_tensors(ODD) if s.name.endswith("_proj.weight")]
    assert len(quantized) == 7
    for spec in checkpoint_tensors(ODD):
        if spec not in quantized:
            assert tensors[spec.name].dtype == torch.bfloat16
            continue
        q, s = tensors[spec.name], tensors[spec.name.removesuffix(".weight") + ".weight_scale_inv"]
        rows, cols = spec.shape
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert tuple(s.shape) == (math.ceil(rows / 128), math.ceil(cols / 128))
        r, c = torch.arange(rows)[:, None] // 128, torch.arange(cols)[None, :] // 128
        expanded = s[r, c]
        ref = makemodel.init_tensor(spec, seed=0)
        # e4m3: 3 mantissa bits -> relative error <= 2^-4; subnormal steps are 2^-9 of the scale.
        bound = ref.abs() * 2**-4 + expanded * 2**-9 + 1e-12
        assert ((q.float() * expanded - ref).abs() <= bound).all(), spec.name


def test_tokenizer_round_trip(tiny: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    text = "The GPU failover took 0.63 s, then the standby served 1024 tokens!\n\tdef f(x): return x"
    ids = tokenizer.encode(text).ids
    assert ids[0] == tokenizer.token_to_id("<|begin_of_text|>")
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # BPE learned real merges
    assert tokenizer.decode(tokenizer.encode("naïve café 東京").ids) == "naïve café 東京"


def test_tokenizer_training_is_deterministic() -> None:
    first, second = maketokenizer._train_tokenizer(1024), maketokenizer._train_tokenizer(1024)
    assert first.to_str() == second.to_str()
    assert first.get_vocab_size() == 1024


def test_presets() -> None:
    assert PRESETS["tiny"] == ModelConfig()
    for name, config in PRESETS.items():
        assert config.num_attention_heads % config.num_key_value_heads == 0, name
        if name != "tiny":
            assert config.num_key_value_heads * config.head_dim % 128 == 0, name
    gb = {name: makemodel.count_params(c) * 2 / 1e9 for name, c in PRESETS.items()}
    assert 20 < gb["small"] * 1000 < 40
    assert 1.5 <= gb["medium"] <= 2.0
    assert 15 <= gb["large"] <= 17
    assert gb["xl"] >= 30


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GB", 2 * 10**9), ("500MB", 5 * 10**8), ("1GiB", 2**30), ("123", 123), ("1.5kb", 1500)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert makemodel.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "2XB", "-1GB", "0", "GB", "1.2.3MB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="--shard-size"):
        makemodel.parse_size(text)


def test_cli_writes_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    argv = ["make-model", str(out), "--layers", "1", "--hidden", "128", "--vocab", "512", "--quiet"]
    assert main([*argv, "--no-tie-embeddings", "--dtype", "fp32", "--shard-size", "300KB", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert "params" in captured.err and "shard(s)" in captured.err
    config = read_json(out / "config.json")
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (1, 128, 512)
    assert config["torch_dtype"] == "float32"
    assert len(list(out.glob("model-*.safetensors"))) > 1


def test_cli_preset_and_quant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    assert main(["make-model", str(out), "--preset", "tiny", "--quant", "fp8-block", "--quiet"]) == 0
    assert "quantization_config" in read_json(out / "config.json")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--heads", "3", "--kv-heads", "2"], "--heads"),
        (["--hidden", "0"], "--hidden"),
        (["--kv-heads", "-1"], "--kv-heads"),
        (["--vocab", "100"], "--vocab"),
        (["--shard-size", "lots"], "--shard-size"),
    ],
)
def test_cli_rejects_bad_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    assert main(["make-model", str(tmp_path / "m"), "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "expected" in err and "found" in err
    assert not (tmp_path / "m").exists()


def test_refuses_non_empty_out_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--force"):
        write(out)
    assert main(["make-model", str(out), "--quiet"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["make-model", str(out), "--quiet", "--force"]) == 0
    assert not (out / "keep.txt").exists()
    assert (out / "model.safetensors.index.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_empty_out_dir_is_used(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    assert write(out) == out
    assert (out / "config.json").exists()


def test_interrupted_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(makemodel, "write_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        write(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_ensure_default_model_creates_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTWEIGHTS_HOME", str(tmp_path))
    path = makemodel.ensure_default_model()
    assert path == tmp_path / "models" / "tiny-bf16-seed0"
    assert read_json(path / "config.json")["hidden_size"] == TINY.hidden_size

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("regenerated an existing default model")

    monkeypatch.setattr(makemodel, "write_checkpoint", fail)
    assert makemodel.ensure_default_model() == path


def test_ensure_default_model_losing_a_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTWEIGHTS_HOME", str(tmp_path))
    real = makemodel.write_checkpoint

    def racing(out: Path, config: ModelConfig, **kwargs: object) -> Path:
        real(out, config, **kwargs)  # the other process finishes first
        return real(out, config, **kwargs)

    monkeypatch.setattr(makemodel, "write_checkpoint", racing)
    path = makemodel.ensure_default_model()
    assert (path / "model.safetensors.index.json").exists()
    assert [p.name for p in path.parent.iterdir()] == ["tiny-bf16-seed0"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama (rotate-half) rotary embedding on [T, heads, hd]."""
    t, _, hd = x.shape
    freqs = torch.outer(torch.arange(t).float(), theta ** (-torch.arange(0, hd, 2).float() / hd))
    cos, sin = freqs.cos().repeat(1, 2)[:, None], freqs.sin().repeat(1, 2)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def reference_logits(w: dict[str, torch.Tensor], c: ModelConfig, ids: list[int]) -> torch.Tensor:
    """A plain fp32 Llama forward over the HF tensors, independent of the project's model."""
    x = w["model.embed_tokens.weight"][ids]
    t, nh, nkv, hd = len(ids), c.num_attention_heads, c.num_key_value_heads, c.head_dim
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, hd), c.rope_theta)
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd), c.rope_theta)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / hd**0.5 + mask, dim=-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(t, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["model.norm.weight"], c.rms_norm_eps) @ w["lm_head.weight"].T


def test_greedy_generation_is_not_degenerate(tiny: Path) -> None:
    weights = {name: t.float() for name, t in load_all(tiny).items()}
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    ids = tokenizer.encode("The weather today is").ids
    generated = []
    for _ in range(24):
        next_id = int(reference_logits(weights, TINY, ids)[-1].argmax())
        generated.append(next_id)
        ids.append(next_id)
    assert len(set(generated)) >= 8, generated
    assert max(generated.count(i) for i in generated) <= len(generated) // 3, generated


def test_permissions_follow_umask(tiny: Path) -> None:
    assert tiny.stat().st_mode & 0o777 == 0o777 & ~current_umask()
    assert {p.stat().st_mode & 0o777 for p in tiny.iterdir()} == {0o666 & ~current_umask()}


def _limit_file_size(limit: int):
    """A real write failure: RLIMIT_FSIZE makes write() fail with EFBIG (Python ignores SIGXFSZ)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize(
    ("flags", "limit", "failing"),
    [
        ((), 100_000, r"model-00001-of-00001\.safetensors"),  # the 3.4 MB shard
        # 62 shards of < 5 KB and a 45 KB index: the index is the write that fails
        (
            (
                *("--vocab", "300", "--hidden", "8", "--heads", "1", "--kv-heads", "1", "--head-dim", "8"),
                *("--intermediate", "8", "--layers", "60", "--shard-size", "1KB"),
            ),
            20_000,
            r"model\.safetensors\.index\.json",
        ),
    ],
)
def test_write_failure_is_one_line_and_leaves_nothing(tmp_path: Path, flags: tuple, limit: int, failing: str) -> None:
    out = tmp_path / "m"
    result = subprocess.run(
        hotweights_command("make-model", str(out), "--quiet", *flags),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_file_size(limit),
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert re.search(rf"cannot write the checkpoint {re.escape(str(out))} \({failing}: .*File too large", result.stderr)
    assert list(tmp_path.iterdir()) == [], "a partial checkpoint was left behind"
