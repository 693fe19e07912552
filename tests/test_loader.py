"""The loader (cache/loader.py) on real files: byte ranges read in parallel pieces, buffered and with O_DIRECT;
the checkpoint pipeline through it against safetensors' own reader; snapshots through it; the fallback where a
file system refuses O_DIRECT; the progress bar on a terminal and nowhere else. CUDA paths: skipped without one."""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import re
import struct
import subprocess
import termios
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.recover import evict, resident_bytes
from hotweights import quant
from hotweights.cache import loader, snapshot
from hotweights.cache.backends import get_backend
from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.daemon import load_arena, pipeline_source
from hotweights.cache.loader import Loader, ReadError
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.pipeline import load_processed
from hotweights.cache.snapshot import load_snapshot, write_snapshot
from hotweights.layout import ModelConfig
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, fingerprint_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
RANGES = [(0, None), (1, 4095), (4095, 200_000), (123_457, 176_544), (-3, 3), (17, 0)]  # (offset, n); None: all


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 KiB pieces of 8 KiB parts, so that a file of a few hundred KiB crosses many of both."""
    monkeypatch.setattr(loader, "BUFFER_BYTES", 64 << 10)
    monkeypatch.setattr(loader, "PART_BYTES", 8 << 10)


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(300_001)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def ranges(data: bytes) -> list[tuple[int, int]]:
    return [(offset % len(data), len(data) if n is None else n) for offset, n in RANGES]


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_every_range_reads_the_files_bytes(data_file: tuple[Path, bytes], small_pieces: None, direct: bool) -> None:
    path, data = data_file
    with Loader("cpu", direct=direct) as reads:
        for offset, n in ranges(data):
            assert bytes(reads.read(path, offset, n).numpy()) == data[offset : offset + n], (offset, n)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_range_past_the_end_of_the_file_is_refused_naming_it(tmp_path: Path, direct: bool) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(1000))
    with Loader("cpu", direct=direct) as reads, pytest.raises(ReadError) as refused:
        reads.read(path, 900, 200)
    assert str(refused.value).startswith(f"{path} ends at byte 1000, but the load needs its bytes up to 1100")


def test_direct_reads_leave_the_page_cache_cold_and_buffered_ones_fill_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "cold.bin"
    path.write_bytes(os.urandom(8 << 20))
    evict([path])
    if resident_bytes([path]):
        pytest.skip("this file system keeps the file's pages after POSIX_FADV_DONTNEED")
    with caplog.at_level(logging.WARNING, logger=loader.__name__), Loader("cpu", direct=True) as reads:
        reads.read(path, 12345, (8 << 20) - 12345)
    assert "O_DIRECT refused" not in caplog.text  # the test's tmp_path is on a file system that takes it
    assert resident_bytes([path]) == 0
    with Loader("cpu") as reads:
        reads.read(path, 0, 8 << 20)
    assert resident_bytes([path]) == 8 << 20


def reference(hf: dict[str, torch.Tensor], config: ModelConfig, spec: LoadSpec, dtype: torch.dtype) -> dict:
    """The processed state dict from safetensors' own tensors: cut for the rank, fused, cast (fp8 and its
    scales kept as they are). Written independently of the pipeline."""

    scales = [name for name in hf if name.endswith(quant.SCALE_SUFFIX)]
    kept = {*scales, *(name.removesuffix(quant.SCALE_SUFFIX) for name in scales)}  # fp8 weights, their scales

    def cut(name: str, dim: int) -> torch.Tensor:
        tensor = hf[name].chunk(spec.tp_size, dim)[spec.tp_rank]
        return tensor if name in kept else tensor.to(dtype)

    suffixes = [".weight", f".weight{quant.SCALE_SUFFIX}"] if scales else [".weight"]
    out = {"embed_tokens.weight": cut("model.embed_tokens.weight", 0), "norm.weight": hf["model.norm.weight"].to(dtype)}
    for layer in range(config.num_hidden_layers):
        hf_layer, layer_out = f"model.layers.{layer}", f"layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{layer_out}.{norm}.weight"] = hf[f"{hf_layer}.{norm}.weight"].to(dtype)
        for suffix in suffixes:
            qkv = [cut(f"{hf_layer}.self_attn.{x}_proj{suffix}", 0) for x in "qkv"]
            gate_up = [cut(f"{hf_layer}.mlp.{x}_proj{suffix}", 0) for x in ("gate", "up")]
            out[f"{layer_out}.self_attn.qkv_proj{suffix}"] = torch.cat(qkv)
            out[f"{layer_out}.mlp.gate_up_proj{suffix}"] = torch.cat(gate_up)
            out[f"{layer_out}.self_attn.o_proj{suffix}"] = cut(f"{hf_layer}.self_attn.o_proj{suffix}", 1)
            out[f"{layer_out}.mlp.down_proj{suffix}"] = cut(f"{hf_layer}.mlp.down_proj{suffix}", 1)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = cut("lm_head.weight", 0)
    return out


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize(
    "which, spec",
    [
        ("tiny", LoadSpec(tp_size=2, tp_rank=1, dtype="bf16")),
        ("tiny", LoadSpec(tp_size=2, tp_rank=0)),
        ("tiny_fp8", LoadSpec(dtype="fp16")),
    ],
    ids=["tp2-rank1-bf16", "tp2-rank0", "fp8-on-disk"],
)
def test_the_pipeline_reads_what_safetensors_reads(
    tiny_model: Path, tiny_fp8_model: Path, which: str, spec: LoadSpec, direct: bool
) -> None:
    checkpoint = read_checkpoint(tiny_model if which == "tiny" else tiny_fp8_model)
    assert len(checkpoint.files) > 1
    hf = {name: tensor for file in checkpoint.files for name, tensor in load_file(file).items()}
    expected = reference(hf, checkpoint.config, spec, spec.torch_dtype or checkpoint.dtype)
    got = load_processed(checkpoint, spec, progress=False, direct_io=direct)
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch, small_pieces: None) -> None:
    """Snapshots read 64 KiB at a time (one loader piece each), so that a tiny arena is many reads."""
    monkeypatch.setattr(snapshot, "CHUNK_BYTES", 64 << 10)


def snapshot_from(model: Path, spec: LoadSpec, backend: str, out: Path) -> str:
    """Write the pipeline's arena for ``spec`` to ``out``; its content hash."""
    filled = load_arena(pipeline_source(read_checkpoint(model), spec), get_backend(backend))
    try:
        write_snapshot(out, filled.manifest, filled.arena.tensor)
    finally:
        filled.arena.close()
    return filled.manifest["content_hash"]


def read_back(path: Path, model: Path, backend: str, device: str, direct: bool) -> tuple[str, str, bytes]:
    """Load the snapshot at ``path``: its content hash, fill detail and used bytes (the arena closed after)."""
    filled = load_snapshot(path, fingerprint_of(model, device), get_backend(backend), torch.device(device),
                           direct_io=direct)  # fmt: skip
    try:
        used = filled.manifest["used_bytes"]
        return filled.manifest["content_hash"], filled.detail, bytes(filled.arena.tensor[:used].cpu().numpy())
    finally:
        filled.arena.close()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_snapshot_read_through_the_loader_has_its_content_hash(
    tiny_model: Path, tmp_path: Path, small_chunks: None, direct: bool
) -> None:
    content_hash = snapshot_from(tiny_model, LoadSpec(), "cpu-shm", tmp_path / "tiny.snap")
    read_hash, detail, data = read_back(tmp_path / "tiny.snap", tiny_model, "cpu-shm", "cpu", direct)
    assert read_hash == content_hash and ("(O_DIRECT)" if direct else "(buffered)") in detail
    assert (tmp_path / "tiny.snap").read_bytes().endswith(data)


def snapshot_command(model: Path, out: Path, *extra: str) -> list[str]:
    return hotweights_command("cache", "snapshot", "--model", str(model), *extra, str(out))


def namespace_probe() -> str | None:
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return None if probe.returncode == 0 else probe.stderr.decode().strip()


def test_a_file_system_that_refuses_o_direct_is_read_buffered_with_one_log_line(
    tiny_model: Path, own_world: Path
) -> None:
    """ramfs refuses O_DIRECT (tmpfs takes it since Linux 6.6): the checkpoint is copied into one, in a mount
    namespace of its own, and snapshotted from there with --direct-io."""
    if reason := namespace_probe():
        pytest.skip(f"no user and mount namespaces here: {reason}")
    ram = own_world / "ram"
    ram.mkdir()
    snap = " ".join(snapshot_command(ram / "tiny", own_world / "out.snap", "--direct-io"))
    script = f"mount -t ramfs none {ram} && cp -a {tiny_model} {ram}/tiny && {snap}"
    command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    refused = [line for line in done.stderr.splitlines() if "O_DIRECT refused" in line]
    assert len(refused) == 1 and "through the page cache" in refused[0], done.stderr
    # Same bytes as from the original checkpoint (the model path differs, so the fingerprint does).
    content_hash = snapshot_from(tiny_model, LoadSpec(), "cpu-shm", own_world / "here.snap")
    assert done.stdout.strip().endswith(f"content hash {content_hash}")


def stderr_through_a_terminal(command: list[str]) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``command`` with its stderr on a pseudo-terminal (120 columns); its stdout and what the terminal
    showed."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a new one has 0 columns
    with subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=terminal, text=True) as process:
        os.close(terminal)
        shown = b""
        while True:
            try:
                chunk = os.read(controller, 1 << 16)
            except OSError:  # EIO: every holder of the terminal's end has closed it
                break
            if not chunk:
                break
            shown += chunk
        stdout = process.stdout.read()
    os.close(controller)
    done = subprocess.CompletedProcess(command, process.returncode, stdout, "")
    return done, shown.decode(errors="replace")


def test_a_terminal_sees_a_byte_progress_bar_a_pipe_none_and_direct_io_changes_no_byte(
    tiny_model: Path, tmp_path: Path
) -> None:
    on_terminal, shown = stderr_through_a_terminal(snapshot_command(tiny_model, tmp_path / "a.snap", "--direct-io"))
    assert on_terminal.returncode == 0, shown
    assert re.search(r"loading: +\d+%\|.*\| [\d.]+[kMG]?/[\d.]+[kMG]? \[.*B/s\]", shown), shown  # bytes, not tensors
    piped = subprocess.run(snapshot_command(tiny_model, tmp_path / "b.snap"), env=ENV, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert piped.returncode == 0, piped.stderr
    assert "loading" not in piped.stderr and "%|" not in piped.stderr
    # fingerprint and content hash are the same, read either way
    assert on_terminal.stdout.split("; ")[1:] == piped.stdout.split("; ")[1:]
    assert (tmp_path / "a.snap").read_bytes() == (tmp_path / "b.snap").read_bytes()


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_the_pinned_ring_gives_the_cpu_paths_tensors_on_cuda(
    tiny_model: Path, tiny_fp8_model: Path, small_pieces: None, direct: bool
) -> None:
    """Small pieces make a tensor many copies through the ring, each buffer reused many times. (Quantizing at
    load is left out: its scales on CUDA differ from the CPU's in the last bits, whatever reads the bytes.)"""
    for model, spec in (
        (tiny_model, LoadSpec(tp_size=2, tp_rank=1, dtype="bf16")),
        (tiny_fp8_model, LoadSpec()),
    ):
        on_cpu = load_processed(model, spec, progress=False)
        on_gpu = load_processed(model, replace(spec, device="cuda:0"), progress=False, direct_io=direct)
        assert on_cpu.keys() == on_gpu.keys()
        for name, tensor in on_gpu.items():
            assert tensor.device.type == "cuda" and torch.equal(tensor.cpu(), on_cpu[name]), name


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_snapshot_onto_cuda_keeps_its_content_hash_and_the_cpu_arenas_bytes(
    tiny_model: Path, tmp_path: Path, small_chunks: None, direct: bool
) -> None:
    """Many reads through the pinned ring; the digest, computed on the device, equals the CPU arena's."""
    cpu_hash = snapshot_from(tiny_model, LoadSpec(), "cpu-shm", tmp_path / "cpu.snap")
    cuda_hash = snapshot_from(tiny_model, LoadSpec(device="cuda:0"), "cuda-ipc", tmp_path / "cuda.snap")
    assert cuda_hash == cpu_hash
    read_hash, _, data = read_back(tmp_path / "cuda.snap", tiny_model, "cuda-ipc", "cuda:0", direct)
    assert read_hash == cpu_hash and (tmp_path / "cpu.snap").read_bytes().endswith(data)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_the_ring_reads_every_range_onto_cuda_with_reads_ahead_of_copies(
    data_file: tuple[Path, bytes], small_pieces: None, direct: bool
) -> None:
    """Pieces of 64 KiB through the 4 pinned buffers: many pieces per range, reads running ahead of copies; each
    range's bytes, every piece reported to ``progress``, and a range past the end refused with the others intact."""
    path, data = data_file
    with Loader("cuda:0", direct=direct) as reads:
        for offset, n in ranges(data):
            dest, seen = torch.empty(n, dtype=torch.uint8, device="cuda:0"), []
            reads.read_into(path, offset, dest, progress=seen.append)
            assert bytes(dest.cpu().numpy()) == data[offset : offset + n] and sum(seen) == n, (offset, n)
        with pytest.raises(ReadError, match=f"{path} ends at byte {len(data)}"):
            reads.read(path, len(data) - 200_000, 200_001)
        assert bytes(reads.read(path, 5, 200_000).cpu().numpy()) == data[5:200_005]
