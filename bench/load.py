"""Off-mode load time: the full pipeline (safetensors -> TP shard -> fuse -> device) in process.

    python bench/load.py                       # writes the 'medium' preset (~1.7 GB) to a temp dir
    python bench/load.py --model DIR --device cuda:0

Four loads in one run, in seconds and GB/s of checkpoint bytes: buffered reads from a cold page cache (the
shards' pages dropped first, POSIX_FADV_DONTNEED), buffered from the warm page cache, O_DIRECT
(``--direct-io``: past the page cache, so cold whatever it holds), and O_DIRECT again; beside them the disk's
cold sequential read rate over the same shards (one thread, 64 MiB reads), and the ratios to it. The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.recover import evict, sequential_read_gbps
from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.makemodel import PRESETS, write_checkpoint
from hotweights.cache.pipeline import load_processed
from hotweights.quant import QUANT_METHODS


def timed_load(model_dir: Path, spec: LoadSpec, *, direct_io: bool = False) -> float:
    start = time.perf_counter()
    tensors = load_processed(model_dir, spec, progress=False, direct_io=direct_io)
    if spec.device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del tensors
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint to load (default: write --preset to a temp dir)")
    parser.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--quantize", choices=QUANT_METHODS)
    args = parser.parse_args()

    workdir = None
    model_dir = Path(args.model) if args.model else None
    if model_dir is None:
        workdir = Path(tempfile.mkdtemp(prefix="hw-load-"))
        model_dir = workdir / args.preset
        start = time.perf_counter()
        write_checkpoint(
            model_dir,
            PRESETS[args.preset],
            dtype=torch.bfloat16,
            quant=None,
            seed=0,
            shard_size=2 * 10**9,
            device=args.device if args.device.startswith("cuda") else "cpu",
        )
        print(f"wrote {args.preset} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    try:
        checkpoint = read_checkpoint(model_dir)
        gb = checkpoint.nbytes / 1e9
        spec = LoadSpec(device=args.device, tp_size=args.tp_size, quantize=args.quantize)
        result = {"model": str(model_dir), "gb": round(gb, 3), "device": args.device, "tp_size": args.tp_size}
        result |= {"quantize": args.quantize, "disk_seq_read_gbps": round(sequential_read_gbps(checkpoint.files), 3)}
        evict(list(checkpoint.files))
        loads = {
            "cold_buffered": timed_load(model_dir, spec),
            "warm": timed_load(model_dir, spec),
            "direct": timed_load(model_dir, spec, direct_io=True),
            "direct_again": timed_load(model_dir, spec, direct_io=True),
        }
        for name, seconds in loads.items():
            result |= {f"{name}_load_s": round(seconds, 3), f"{name}_gbps": round(gb / seconds, 3)}
            print(f"{gb:.2f} GB, {name}: {seconds:.2f} s ({gb / seconds:.2f} GB/s)", file=sys.stderr)
        for name in ("cold_buffered", "direct"):
            result[f"{name}_vs_disk"] = round(result[f"{name}_gbps"] / result["disk_seq_read_gbps"], 3)
        result["direct_vs_warm"] = round(result["direct_gbps"] / result["warm_gbps"], 3)
        print(json.dumps(result))
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
