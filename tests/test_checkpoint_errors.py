"""Every kind of bad checkpoint fails with a clear error naming the file and tensor."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from hotweights.cache.checkpoint import read_checkpoint
from hotweights.errors import CheckpointError
from hotweights.spawn import hotweights_command


@pytest.fixture
def ckpt(tiny_model: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_model, tmp_path / "ckpt"))


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def first_shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("model-*.safetensors"))[0]


def test_valid_checkpoint_reads(ckpt: Path) -> None:
    checkpoint = read_checkpoint(ckpt)
    assert checkpoint.config.num_hidden_layers == 2
    assert len(checkpoint.files) > 1


def test_missing_directory() -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint("/nonexistent/model")


def test_missing_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        read_checkpoint(ckpt)


def test_config_not_json(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        read_checkpoint(ckpt)


def test_unsupported_architecture(ckpt: Path) -> None:
    edit_json(ckpt / "config.json", architectures=["MixtralForCausalLM"])
    with pytest.raises(CheckpointError, match=r"unsupported architecture.*MixtralForCausalLM"):
        read_checkpoint(ckpt)


def test_config_field_of_wrong_type(ckpt: Path) -> None:
    edit_json(ckpt / "config.json", hidden_size="256")
    with pytest.raises(CheckpointError, match="'hidden_size' must be int, found str"):
        read_checkpoint(ckpt)


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        ({"quant_method": "fp8", "activation_scheme": "static"}, "fp8-per-tensor"),
        ({"quant_method": "awq", "bits": 4}, "awq"),
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "marlin"}, "marlin"),
        ({"quant_method": "mystery-q"}, "mystery-q"),
    ],
)
def test_refused_quantization(ckpt: Path, quantization_config: dict, named: str) -> None:
    edit_json(ckpt / "config.json", quantization_config=quantization_config)
    with pytest.raises(CheckpointError, match=f"quantization method '{named}' is refused: .+") as err:
        read_checkpoint(ckpt)
    assert "would compute wrong values" in str(err.value)


def test_fp8_with_other_block_size_is_refused(ckpt: Path) -> None:
    edit_json(ckpt / "config.json", quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]})
    with pytest.raises(CheckpointError, match=r"weight_block_size=\[64, 64\].*refused"):
        read_checkpoint(ckpt)


def test_index_names_a_missing_file(ckpt: Path) -> None:
    first_shard(ckpt).unlink()
    with pytest.raises(CheckpointError, match=r"names model-00001-of-\d+\.safetensors, which does not exist"):
        read_checkpoint(ckpt)


def test_index_places_tensor_in_wrong_file(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = (
        files[0] if index["weight_map"]["model.norm.weight"] != files[0] else files[-1]
    )
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"places tensor 'model\.norm\.weight' in model-\d+-of-\d+\.safetensors, which lacks it"
    ):
        read_checkpoint(ckpt)


def test_truncated_shard(ckpt: Path) -> None:
    shard = first_shard(ckpt)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated: tensor '.+' ends at byte"):
        read_checkpoint(ckpt)


def test_shard_cut_inside_header(ckpt: Path) -> None:
    shard = first_shard(ckpt)
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt or truncated safetensors header"):
        read_checkpoint(ckpt)


def test_corrupt_header(ckpt: Path) -> None:
    shard = first_shard(ckpt)
    data = bytearray(shard.read_bytes())
    data[8 : 8 + 10] = b"\xff" * 10
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt safetensors header"):
        read_checkpoint(ckpt)


def test_shape_disagrees_with_config(ckpt: Path) -> None:
    edit_json(ckpt / "config.json", intermediate_size=640)
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[512, 256\] but config.json implies \[640, 256\]",
    ):
        read_checkpoint(ckpt)


def test_missing_tensor(ckpt: Path) -> None:
    edit_json(ckpt / "config.json", tie_word_embeddings=False, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.2\..+' is missing"):
        read_checkpoint(ckpt)


def test_cli_reports_bad_checkpoint_without_traceback(ckpt: Path) -> None:
    edit_json(ckpt / "config.json", quantization_config={"quant_method": "awq"})
    result = subprocess.run(
        hotweights_command("generate", "--model", str(ckpt), "--prompt", "hi"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "quantization method 'awq' is refused" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("attention_bias", True),
        ("mlp_bias", True),
        ("hidden_act", "gelu"),
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
    ],
)
def test_llama_variant_the_model_does_not_implement_is_refused(ckpt: Path, field: str, value: object) -> None:
    edit_json(ckpt / "config.json", **{field: value})
    with pytest.raises(CheckpointError, match=rf"field '{field}'=.* is not supported"):
        read_checkpoint(ckpt)


def test_index_decides_where_a_duplicated_tensor_is_read_from(ckpt: Path) -> None:
    from safetensors.torch import load_file, save_file

    from hotweights.cache.loadspec import LoadSpec
    from hotweights.cache.pipeline import load_processed

    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    last = list(dict.fromkeys(weight_map.values()))[-1]
    name = next(n for n, f in weight_map.items() if f != last)
    original = load_file(ckpt / weight_map[name])[name]
    stale = load_file(ckpt / last)
    stale[name] = original + 1  # a stale copy in a shard the index does not name for it
    save_file(stale, ckpt / last)
    checkpoint = read_checkpoint(ckpt)
    assert checkpoint.tensors[name].file.name == weight_map[name]
    processed = load_processed(checkpoint, LoadSpec(), progress=False)
    assert torch.equal(processed[name.removeprefix("model.")], original)


def test_header_entry_with_mistyped_offsets(ckpt: Path) -> None:
    shard = first_shard(ckpt)
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(n for n in header if n != "__metadata__")
    header[name]["data_offsets"] = [str(v) for v in header[name]["data_offsets"]]
    blob = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + length :])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt header entry for tensor '{name}'"):
        read_checkpoint(ckpt)


@pytest.mark.parametrize("escape", ["../../../../etc/passwd", "sub/../../other/model.safetensors", "absolute"])
def test_index_entry_outside_the_checkpoint_is_refused(ckpt: Path, tiny_model: Path, escape: str) -> None:
    """An absolute path to another checkpoint's (valid) shard, or any '..', would be read from outside."""
    if escape == "absolute":
        escape = str(first_shard(tiny_model))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = escape
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(ckpt)
    message = str(refused.value)
    assert "model.safetensors.index.json" in message and "'model.norm.weight'" in message
    assert escape in message and "outside the checkpoint directory" in message


@pytest.mark.parametrize("content", ['{"x": 1}', "not json", "[]"])
def test_unreadable_tokenizer_is_one_line(ckpt: Path, content: str) -> None:
    (ckpt / "tokenizer.json").write_text(content)
    result = subprocess.run(
        hotweights_command("generate", "--model", str(ckpt), "--prompt", "hi", "--max-tokens", "1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"{ckpt / 'tokenizer.json'}: not a tokenizer" in result.stderr
    assert len([line for line in result.stderr.splitlines() if "error" in line.lower()]) == 1, result.stderr


@pytest.mark.parametrize("link", ["shard", "directory"])
def test_a_symlink_out_of_the_checkpoint_is_refused(ckpt: Path, tmp_path: Path, link: str) -> None:
    """A shard, or a directory holding one, that links to a (valid) file elsewhere would be read from outside."""
    shard = first_shard(ckpt)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(shard, outside / shard.name)
    if link == "shard":
        shard.symlink_to(outside / shard.name)
    else:
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: f"sub/{v}" if v == shard.name else v for k, v in index["weight_map"].items()}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
        (ckpt / "sub").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as refused:
        read_checkpoint(ckpt)
    assert str(outside) in str(refused.value)


def test_a_hugging_face_cache_snapshot_links_to_its_blobs(ckpt: Path, tmp_path: Path) -> None:
    """``<repo>/snapshots/<rev>/<shard>`` -> ``<repo>/blobs/<hash>`` is how the hub cache stores files."""
    repo = tmp_path / "models--x--tiny"
    snapshot = Path(shutil.copytree(ckpt, repo / "snapshots" / "abc"))
    (repo / "blobs").mkdir()
    for shard in snapshot.glob("*.safetensors"):
        shutil.move(shard, repo / "blobs" / shard.name)
        shard.symlink_to(repo / "blobs" / shard.name)
    assert read_checkpoint(snapshot).files
