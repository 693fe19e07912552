"""Where a reference engine's start to ready goes on a GPU, and a decode step's cost by KV length: split-KV attention
(one decode graph per batch size, ``standby.decodeattention``) against masked SDPA (a graph per KV length bucket).

    python bench/warmup.py --device cuda:0 --model DIR [--kv-cache-tokens N] [--max-batch N] [--steps 50]
    python bench/warmup.py --device cuda:0 --model DIR --cold-shapes

``--cold-shapes`` instead measures, on a decoder that did not warm up, each prefill shape's first run in the process
against its second (``prefill_first_runs``, ``worst_first_run_extra_ms``): what a shape that warm-up skipped costs
its first request.

In this one process, each part timed in the order an engine pays it: ``imports_s`` (torch, then the engine's
modules), ``context_s`` (the CUDA context: the device's first allocation, synchronized), ``load_s`` (the weights
from DIR through the off mode's pipeline; an engine attaching from a daemon pays its attach here instead, see
``bench/attach.py``), then ``warm_up_s``: a decoder at the engine's defaults (``--kv-cache-tokens``, its KV pool,
``--max-batch``, CUDA graphs) warmed up as the engine does it, with its parts (``Decoder.warm_up_times``):
``eager_s`` (the prefills), ``sampling_s``, each decode graph's first run (``decode_first_runs_s``, by batch size;
the first one compiles the fused elementwise and the attention kernels, or reads them from Triton's on-disk cache:
``compile_s`` is it less the median of the others) and its capture with a first replay
(``decode_captures_s``), ``prefill_graphs_s``, and ``kernel_check_s`` (0 where an earlier engine of the host left its
verdict, ``standby.kernelcheck``; ``split_kv`` and ``fused`` say what it allowed). ``start_to_ready_s``: imports,
context, load and warm-up.
``graphs``: the decode and prefill graphs captured.

Then the steady decode step, a graph replay and its wait (median ms of --steps), at batch 1, 2 and 4 and KV lengths
16, 512 and the cache's, every row at that length: ``split_kv`` with one graph per batch size as the engine now
captures them, ``masked`` with a graph of that length captured here for the comparison only (what the engine
captured per KV length before). Prints a table to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

BATCHES = (1, 2, 4)
SHORT_LENGTHS = (16, 512)  # then the cache's own length


def seconds_since(start: float) -> float:
    return round(time.perf_counter() - start, 3)


def median_step_ms(graph: object, inputs: object, steps: int) -> float:
    """The median wall time of ``graph.run(inputs)`` (a ``DecodeGraph``) and the device's finish, after one run."""
    import torch

    graph.run(inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        graph.run(inputs)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 3)


def steady_steps(decoder: object, kv_lengths: list[int], steps: int) -> dict[str, dict[str, float]]:
    """``"BxL"`` -> ms per step of split-KV and masked-SDPA decode graphs at batch B, every row at KV length L."""
    import torch

    from hotweights.standby.decoder import DecodeGraph

    model, kv = decoder.model, decoder.kv
    pool = torch.cuda.graph_pool_handle()
    results = {}
    for batch in (b for b in BATCHES if b <= kv.batch):
        graphs = {"split_kv": DecodeGraph(model, kv, batch, None, pool)}
        for length in kv_lengths:
            graphs["masked"] = DecodeGraph(model, kv, batch, length, pool)
            inputs = torch.tensor([[1] * batch, [length - 1] * batch], dtype=torch.long)
            results[f"{batch}x{length}"] = {name: median_step_ms(g, inputs, steps) for name, g in graphs.items()}
            log_row(f"{batch}x{length}", results[f"{batch}x{length}"])
    return results


def cold_shapes(decoder: object) -> dict[str, object]:
    """Each prefill shape's first run in this process (after one run of the shortest, which pays the libraries'
    own start) against its second, on a decoder that did not warm up: what serving a shape that warm-up skipped
    would cost its first request."""
    import torch

    def timed(rows: int, length: int) -> float:
        mark = time.perf_counter()
        decoder.prefill(0, [[1] * length] * rows)
        torch.cuda.synchronize(decoder.model.device)
        return round((time.perf_counter() - mark) * 1000, 2)

    timed(1, decoder.lengths[0])
    shapes = {}
    for rows in range(1, decoder.batch + 1):
        for length in decoder.lengths:
            if decoder.prefill_fits(rows, length):
                shapes[f"{rows}x{length}"] = {"first_ms": timed(rows, length), "again_ms": timed(rows, length)}
                print(f"  prefill {rows}x{length}: {shapes[f'{rows}x{length}']}", file=sys.stderr)
    worst = max(shapes, key=lambda k: shapes[k]["first_ms"] - shapes[k]["again_ms"])
    extra = shapes[worst]["first_ms"] - shapes[worst]["again_ms"]
    return {"prefill_first_runs": shapes, "worst_first_run_extra_ms": round(extra, 2), "worst_shape": worst}


def log_row(name: str, row: dict[str, float]) -> None:
    print(f"  decode {name:>8}: " + "  ".join(f"{k} {v:8.3f} ms" for k, v in row.items()), file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-cache-tokens", type=int, default=None, help="default: the engine's")
    parser.add_argument("--max-batch", type=int, default=None, help="default: the engine's")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--cold-shapes",
        action="store_true",
        help="instead: each prefill shape's first run against its second on a decoder that did not warm up",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")

    start = time.perf_counter()
    import torch

    imports = {"torch": seconds_since(start)}
    mark = time.perf_counter()
    from hotweights.cache.loadspec import LoadSpec
    from hotweights.standby.engine import new_decoder, pool_sizes
    from hotweights.standby.engineflags import LIMITS
    from hotweights.standby.kvpool import ENGINE_KV_SHARE
    from hotweights.standby.weights import load_model

    imports["engine"] = seconds_since(mark)
    if not torch.cuda.is_available() or not args.device.startswith("cuda"):
        print(f"--device: expected a CUDA device (cuda:N) on a host with one, found {args.device!r}", file=sys.stderr)
        return 2
    kv_tokens = args.kv_cache_tokens or LIMITS.kv_cache_tokens

    mark = time.perf_counter()
    torch.zeros(1, device=args.device)
    torch.cuda.synchronize(args.device)
    context_s = seconds_since(mark)

    mark = time.perf_counter()
    model = load_model(args.model, LoadSpec(device=args.device)).model
    torch.cuda.synchronize(args.device)
    load_s = seconds_since(mark)
    sizes = pool_sizes(model, args.max_batch or LIMITS.max_batch, kv_tokens, LIMITS.kv_pool_tokens, ENGINE_KV_SHARE)
    max_batch, pool_tokens = sizes

    if args.cold_shapes:
        cold = cold_shapes(new_decoder(model, max_batch, kv_tokens, pool_tokens, batch_invariant=False))
        print(json.dumps({"device": torch.cuda.get_device_name(args.device), "model": args.model, **cold}))
        return 0
    mark = time.perf_counter()
    decoder = new_decoder(model, max_batch, kv_tokens, pool_tokens, batch_invariant=False, graphs=True)
    decoder.warm_up()
    warm_up_s = seconds_since(mark)
    times = decoder.warm_up_times
    first_runs = {f"{n}x{kv}": round(s, 3) for (n, kv), s in times.decode_first_runs.items()}
    first, *later = times.decode_first_runs.values()
    compile_s = first - (statistics.median(later) if later else 0.0)
    result = {
        "device": torch.cuda.get_device_name(args.device),
        "torch": torch.__version__,
        "model": args.model,
        "kv_cache_tokens": kv_tokens,
        "max_batch": max_batch,
        "kv_pool_tokens": pool_tokens,
        "split_kv": decoder.split_kv,
        "fused": decoder.fused,
        "imports_s": imports,
        "context_s": context_s,
        "load_s": load_s,
        "warm_up_s": warm_up_s,
        "eager_s": round(times.eager, 3),
        "sampling_s": round(times.sampling, 3),
        "decode_first_runs_s": first_runs,
        "compile_s": round(compile_s, 3),
        "decode_captures_s": {f"{n}x{kv}": round(s, 3) for (n, kv), s in times.decode_captures.items()},
        "prefill_graphs_s": round(times.prefill_graphs, 3),
        "kernel_check_s": round(times.kernel_check, 3),
        "graphs": {"decode": len(times.decode_captures), "prefill": len(decoder.graphed_prefills())},
        "start_to_ready_s": round(sum(imports.values()) + context_s + load_s + warm_up_s, 3),
    }
    for key, value in result.items():
        print(f"{key:>20}: {value}", file=sys.stderr)
    result["decode_ms"] = steady_steps(decoder, [*SHORT_LENGTHS, kv_tokens], args.steps)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
