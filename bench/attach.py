"""Attach time vs arena size, next to the off-mode load time: does mapping stay flat?

    python bench/attach.py --device cpu                 # 0.1 / 0.3 / 1 GB checkpoints on disk
    python bench/attach.py --device cuda --source synthetic --sizes-gb 1,10,80 --load-model DIR

Each size is served by a real daemon in a child process; this process attaches as an engine
would (socket round trip, import of the arena, one view per tensor, binding into a meta-built
model), ``--repeats`` times, and reports the median. The uncounted first round is the one that hashes the
arena's content (once per arena and host, ``cache.verified``): ``first_attach_ms``. ``disk`` sources also
time the off-mode load of the same checkpoint; ``synthetic`` sources fill the arena in device memory (no disk) and take
the load time from ``--load-model`` (without it, the JSON has no ``load_ms``, ``load_model_gb`` nor ``speedup``).
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.client import attach
from hotweights.cache.connection import hello
from hotweights.cache.daemon import ArenaSource, CacheDaemon, pipeline_source
from hotweights.cache.fingerprint import ARENA_FORMAT_VERSION, REFERENCE_LAYOUT, Fingerprint, compute_fingerprint
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.makemodel import write_checkpoint
from hotweights.cache.paths import DaemonPaths
from hotweights.cache.pipeline import load_processed
from hotweights.layout import ModelConfig
from hotweights.standby.model import TensorParallel
from hotweights.standby.weights import bind, build_meta_model, expected_tensors

DTYPE = torch.bfloat16


def shape_for(target_bytes: float, tensors: int) -> ModelConfig:
    """A tied Llama config of about ``target_bytes`` (bf16) holding about ``tensors`` tensors."""
    layers = math.ceil((tensors - 2) / 6)
    per_layer = target_bytes / layers / DTYPE.itemsize
    hidden = max(256, round(math.sqrt(per_layer / 8.5) / 128) * 128)
    heads = hidden // 128
    kv = max(d for d in range(1, heads + 1) if heads % d == 0 and d <= max(1, heads // 4))
    attention = hidden * (hidden + 2 * kv * 128) + hidden * hidden
    intermediate = max(128, round((per_layer - attention) / (3 * hidden) / 128) * 128)
    return ModelConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=128,
        tie_word_embeddings=True,
    )


def synthetic_fingerprint(config: ModelConfig, device: torch.device) -> Fingerprint:
    cc = ".".join(map(str, torch.cuda.get_device_capability(device))) if device.type == "cuda" else "none"
    return Fingerprint(
        model_path=f"synthetic:{config.hidden_size}x{config.intermediate_size}x{config.num_hidden_layers}",
        config_hash="synthetic",
        weights_index_hash="synthetic",
        tp_size=1,
        tp_rank=0,
        pp_size=1,
        pp_rank=0,
        dp_size=1,
        dp_rank=0,
        quantization="none",
        quantization_config_hash="none",
        dtype="bfloat16",
        device_kind=device.type,
        compute_capability=cc,
        torch_version=torch.__version__,
        arena_format=ARENA_FORMAT_VERSION,
        layout=REFERENCE_LAYOUT,
    )


def synthetic_source(config: ModelConfig, device: torch.device) -> ArenaSource:
    """Random weights made in device memory: sizes beyond the disk, no disk time."""
    specs = expected_tensors(build_meta_model(config, DTYPE, TensorParallel()))

    def tensors():
        gen = torch.Generator(device=device).manual_seed(0)
        for name, (shape, dtype) in specs.items():
            yield name, torch.randn(shape, generator=gen, device=device, dtype=dtype)

    return ArenaSource(synthetic_fingerprint(config, device), lambda: specs, tensors, device)


def serve(args: argparse.Namespace) -> None:
    """Child process: serve one arena until killed."""
    device = torch.device(args.device)
    if args.serve_model:
        source = pipeline_source(read_checkpoint(args.serve_model), LoadSpec(device=args.device))
    else:
        source = synthetic_source(ModelConfig(**json.loads(args.serve_config)), device)
    backend = args.backend or ("cpu-shm" if device.type == "cpu" else "cuda-vmm")
    CacheDaemon(source, DaemonPaths(Path(args.socket)), backend=backend, allowed_uids=frozenset([os.getuid()])).run()


def measure_attach(socket_path: Path, fingerprint: Fingerprint, config: ModelConfig, device: str, repeats: int):
    """Median, min and first-round ms of attach (socket, import, views) + bind into a meta-built model.

    Building the meta model is left out: an engine pays it in every mode, and it grows with the
    number of layers, not with bytes. The first round (CUDA context, imports, the content hash of an arena
    this host has not checked yet) is not counted in the median and min.
    """
    times = []
    for _ in range(repeats + 1):
        model = build_meta_model(config, DTYPE, TensorParallel())
        start = time.perf_counter()
        attachment = attach(socket_path, fingerprint, device)
        bind(model, attachment.tensors)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
        del model
        attachment.close()
        gc.collect()  # unmapping happens when the last view dies: keep it out of the next round's timing
        times.append(elapsed)
    return statistics.median(times[1:]), min(times[1:]), times[0]


def start_daemon(args: argparse.Namespace, socket_path: Path, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, __file__, "--device", args.device, "--socket", str(socket_path), *extra]
    if args.backend:
        command += ["--backend", args.backend]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"daemon exited with {child.returncode}")
        try:
            hello(socket_path, timeout=1)
            return child
        except Exception:
            time.sleep(0.2)
    child.kill()
    raise RuntimeError("daemon did not become ready")


def time_off_mode_load(model_dir: Path, device: str) -> float:
    start = time.perf_counter()
    tensors = load_processed(model_dir, LoadSpec(device=device), progress=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) * 1e3
    del tensors
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--source", choices=("disk", "synthetic"), default="disk")
    parser.add_argument("--sizes-gb", default="0.1,0.3,1.0")
    parser.add_argument("--tensors", type=int, default=1000, help="at least this many tensors per arena")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--backend", help="arena backend (default: cpu-shm on CPU, cuda-vmm on CUDA)")
    parser.add_argument("--models", help="disk source: existing bf16 checkpoints (comma-separated), not --sizes-gb")
    parser.add_argument("--load-model", help="synthetic source: checkpoint whose off-mode load is timed")
    parser.add_argument("--workdir", help="where disk checkpoints are written (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--serve-model", help=argparse.SUPPRESS)
    parser.add_argument("--serve-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.socket:
        serve(args)
        return

    sizes = [float(s) for s in args.sizes_gb.split(",")]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hw-bench-"))
    socket_path = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp")) / "bench.sock"
    rows = []
    if args.models:
        targets = [(read_checkpoint(m).config, Path(m)) for m in args.models.split(",")]
    else:
        targets = [(shape_for(size * 1e9, args.tensors), workdir / f"model-{size}gb") for size in sizes]
    for config, model_dir in targets:
        if args.source == "disk":
            if not model_dir.exists():
                write_checkpoint(
                    model_dir,
                    config,
                    dtype=DTYPE,
                    quant=None,
                    seed=0,
                    shard_size=2 * 10**9,
                    device=args.device,
                    progress=False,
                )
            if not rows:
                time_off_mode_load(model_dir, args.device)  # warm-up: imports, allocator, page cache
            load_ms = time_off_mode_load(model_dir, args.device)
            fingerprint = compute_fingerprint(read_checkpoint(model_dir), LoadSpec(device=args.device))
            extra = ["--serve-model", str(model_dir)]
        else:
            load_ms = None
            fingerprint = synthetic_fingerprint(config, torch.device(args.device))
            extra = ["--serve-config", json.dumps(asdict(config))]
        child = start_daemon(args, socket_path, extra)
        try:
            median_ms, min_ms, first_ms = measure_attach(socket_path, fingerprint, config, args.device, args.repeats)
        finally:
            child.kill()
            child.wait()
        specs = expected_tensors(build_meta_model(config, DTYPE, TensorParallel()))
        n_tensors = len(specs)
        actual_gb = sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values()) / 1e9
        rows.append(
            {
                "size_gb": round(actual_gb, 3),
                "tensors": n_tensors,
                "attach_ms": round(median_ms, 3),
                "attach_min_ms": round(min_ms, 3),
                "first_attach_ms": round(first_ms, 3),
                **({} if load_ms is None else {"load_ms": round(load_ms, 1)}),
            }
        )
        print(
            f"{actual_gb:8.3f} GB  {n_tensors:5d} tensors  attach {median_ms:8.2f} ms (min {min_ms:.2f}, "
            f"first {first_ms:.2f})" + ("" if load_ms is None else f"  off-mode load {load_ms:9.1f} ms"),
            file=sys.stderr,
            flush=True,
        )

    load_ms = rows[-1].get("load_ms")
    load_model_gb = rows[-1]["size_gb"]
    if args.load_model:
        load_ms = time_off_mode_load(Path(args.load_model), args.device)
        load_model_gb = read_checkpoint(args.load_model).nbytes / 1e9
    attach_ms = [r["attach_ms"] for r in rows]
    result = {
        "device": args.device,
        "backend": args.backend or ("cpu-shm" if args.device == "cpu" else "cuda-vmm"),
        "source": args.source,
        "sizes_gb": [r["size_gb"] for r in rows],
        "tensors": [r["tensors"] for r in rows],
        "attach_ms": attach_ms,
        "first_attach_ms": [r["first_attach_ms"] for r in rows],
        "flatness": round(attach_ms[-1] / attach_ms[0], 3),
    }
    if load_ms is not None:  # a disk source's, or --load-model's: a synthetic source alone loads nothing
        result["load_ms"] = [r["load_ms"] for r in rows] if args.source == "disk" else load_ms
        result |= {"load_model_gb": round(load_model_gb, 3), "speedup": round(load_ms / attach_ms[-1], 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
