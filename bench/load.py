"""Off-mode load time: the full pipeline (safetensors -> TP shard -> fuse -> device) in process.

    python bench/load.py                       # writes the 'medium' preset (~1.7 GB) to a temp dir
    python bench/load.py --model DIR --device cuda:0

Reports a cold-ish first load and a warm (page-cache) second load, in seconds and GB/s of
checkpoint bytes. The last stdout line is one JSON object.
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

from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.makemodel import PRESETS, write_checkpoint
from hotweights.cache.pipeline import LoadSpec, load_processed
from hotweights.quant import QUANT_METHODS


def timed_load(model_dir: Path, spec: LoadSpec) -> float:
    start = time.perf_counter()
    tensors = load_processed(model_dir, spec, progress=False)
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
        gb = read_checkpoint(model_dir).nbytes / 1e9
        spec = LoadSpec(device=args.device, tp_size=args.tp_size, quantize=args.quantize)
        first = timed_load(model_dir, spec)
        warm = timed_load(model_dir, spec)
        print(
            f"{gb:.2f} GB: first load {first:.2f} s ({gb / first:.2f} GB/s), warm {warm:.2f} s ({gb / warm:.2f} GB/s)",
            file=sys.stderr,
        )
        print(
            json.dumps(
                {
                    "model": str(model_dir),
                    "gb": round(gb, 3),
                    "device": args.device,
                    "tp_size": args.tp_size,
                    "quantize": args.quantize,
                    "first_load_s": round(first, 3),
                    "first_gbps": round(gb / first, 3),
                    "warm_load_s": round(warm, 3),
                    "warm_gbps": round(gb / warm, 3),
                }
            )
        )
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
