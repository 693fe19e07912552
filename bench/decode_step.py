"""Where a batch-1 decode step's device time goes, and its matrix products against a Triton GEMV.

    python bench/decode_step.py --model DIR [--device cuda:0] [--kv-length 100] [--bandwidth-tbps 3.35]

Loads the checkpoint onto the device (the off mode's pipeline) and captures the engine's batch-1 decode step as the
engine does (``standby.decoder.DecodeGraph``: split-KV attention, the fused kernels), then:

- ``replay_ms``: the step's replay and its wait, median of REPLAYS (``bench/warmup.py``'s), at KV lengths 16 and 256;
- ``kernels``: ``torch.profiler``'s device time per kernel over PROFILED replays at ``--kv-length``, per step
  (``device_ms``: their sum; ``bound_ms``: the weights' bytes over ``--bandwidth-tbps``, the HBM bound one step
  cannot beat, and ``device_share_of_bound``: the bound over the device's time);
- ``products``: per weight matrix of a layer (qkv, o, gate_up, down; each timed over its 48 layers' own weights in
  one captured graph, so none is read from L2) and the LM head, a batch-1 product through ``F.linear`` (cuBLAS)
  against a Triton GEMV (one program per BLOCK_N rows, K in tiles of BLOCK_K summed in float32, no split-K; the best
  of CONFIGS): microseconds each, TB/s, the GEMV's largest difference over the largest value of cuBLAS's result;
- ``scheduler``: the engine's inference loop without its HTTP server (``standby.scheduler.Scheduler`` on a graphed
  decoder of the engine's shapes, warmed up as an engine's), STREAMS greedy streams of STREAM_TOKENS tokens one after
  the other: ms a token from each stream's first token to its last, and their share of the bound (against one
  stream through the gateway, ``bench/concurrency.py``'s ``batch1_decode_tokens_per_s``, it tells the host's
  part of serving a token from the loop's).

A table goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from bench.warmup import median_step_ms

REPLAYS = 30
PROFILED = 5
TIMED = 20  # replays of a product's graph
STREAMS, STREAM_TOKENS = 3, 256  # the scheduler's streams, one after the other
PROMPT = list(range(1, 17))
MAX_BATCH = 64  # the scheduler's decoder: the engine's default on an H100 or H200 with xl
# (BLOCK_N, BLOCK_K, warps, stages) tried for the Triton GEMV
CONFIGS = [c for c in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (1, 2)) if c[0] * c[1] <= 16384]


def gemv_kernel() -> Callable:
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x_ptr, w_ptr, y_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[n] = sum_k x[k] w[n, k] for BLOCK_N rows of a row-major w (N and K multiples of the blocks)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], eviction_policy="evict_first")
            acc += w.to(tl.float32) * tl.load(x_ptr + cols)[None, :].to(tl.float32)
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))

    def launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config: tuple[int, int, int, int]) -> None:
        block_n, block_k, warps, stages = config
        gemv[(w.shape[0] // block_n,)](x, w, y, w.shape[1], BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                       num_stages=stages)  # fmt: skip

    return launch


def graph_ms(work: Callable[[], object]) -> float:
    """Median device ms of one replay of a CUDA graph of ``work`` (warmed on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    graph.replay()
    times = []
    for _ in range(TIMED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernels(step: object, length: int) -> dict[str, dict[str, float]]:
    """Device ms and launches per step of each kernel of ``step``'s replay at KV length ``length``."""
    from torch.profiler import ProfilerActivity, profile

    step.inputs.copy_(torch.tensor([[1], [length - 1]], dtype=torch.long))
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        for _ in range(PROFILED):
            step.graph.replay()
        torch.cuda.synchronize()
    rows = {}
    for event in profiled.key_averages():
        if event.device_time_total:
            rows[event.key[:100]] = {"ms": event.device_time_total / 1000 / PROFILED, "count": event.count / PROFILED}
    return dict(sorted(rows.items(), key=lambda item: -item[1]["ms"]))


def products(model: object) -> dict[str, dict[str, object]]:
    """cuBLAS against the Triton GEMV per product (module docstring)."""
    launch = gemv_kernel()
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    weights = {
        "qkv": [layer.self_attn.qkv_proj.weight for layer in model.layers],
        "o": [layer.self_attn.o_proj.weight for layer in model.layers],
        "gate_up": [layer.mlp.gate_up_proj.weight for layer in model.layers],
        "down": [layer.mlp.down_proj.weight for layer in model.layers],
        "lm_head": [head],
    }
    results = {}
    for name, ws in weights.items():
        n, k = ws[0].shape
        x = torch.randn(1, k, device=ws[0].device, dtype=ws[0].dtype)
        ys = [torch.empty(n, device=ws[0].device, dtype=ws[0].dtype) for _ in ws]
        nbytes = sum(w.nbytes for w in ws)
        cublas = graph_ms(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
        fits = [c for c in CONFIGS if n % c[0] == 0 and k % c[1] == 0]

        def gemvs(config: tuple[int, int, int, int], x: torch.Tensor = x, ws: list = ws, ys: list = ys) -> None:
            for w, y in zip(ws, ys, strict=True):
                launch(x[0], w, y, config)

        timed = {config: graph_ms(lambda config=config: gemvs(config)) for config in fits}
        best = min(timed, key=timed.__getitem__)
        expected = F.linear(x, ws[0]).float()[0]
        launch(x[0], ws[0], ys[0], best)
        departure = float((ys[0].float() - expected).abs().max() / expected.abs().max())
        results[name] = {
            "shape": [n, k],
            "cublas_us": round(cublas * 1000 / len(ws), 1),
            "cublas_tbps": round(nbytes / (cublas / 1000) / 1e12, 2),
            "triton_us": round(timed[best] * 1000 / len(ws), 1),
            "triton_tbps": round(nbytes / (timed[best] / 1000) / 1e12, 2),
            "triton_config": list(best),
            "triton_departure": round(departure, 5),
        }
        print(f"{name:>8}: {results[name]}", file=sys.stderr)
    return results


def scheduler_streams(model: object, bound_ms: float) -> dict[str, object]:
    """ms a token of STREAMS greedy streams through the engine's scheduler (module docstring)."""
    from hotweights.standby.engine import new_decoder
    from hotweights.standby.scheduler import Finish, SamplingParams, Scheduler, Sequence

    decoder = new_decoder(model, MAX_BATCH, 4096, MAX_BATCH * 512, batch_invariant=False, graphs=True)
    decoder.warm_up()
    scheduler = Scheduler()
    scheduler.attach_kv(decoder)
    scheduler.start()
    per_token = []
    try:
        for _ in range(STREAMS):
            times: list[float] = []
            done = threading.Event()

            def sink(event: object, times: list[float] = times, done: threading.Event = done) -> None:
                if isinstance(event, Finish):
                    done.set()
                else:
                    times.append(time.perf_counter())

            scheduler.submit(Sequence(PROMPT, SamplingParams(max_tokens=STREAM_TOKENS), sink))
            if not done.wait(120):
                raise TimeoutError("a stream did not finish within 120 s")
            per_token.append(round((times[-1] - times[0]) * 1000 / (len(times) - 1), 3))
    finally:
        scheduler.stop(10)
        decoder.close()
    return {"ms_per_token": per_token, "share_of_bound": [round(bound_ms / ms, 3) for ms in per_token]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--kv-length", type=int, default=100, help="the profiled step's (default %(default)s)")
    parser.add_argument("--bandwidth-tbps", type=float, default=3.35, help="the card's (default %(default)s: H100)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not args.device.startswith("cuda"):
        print(f"--device: expected a CUDA device (cuda:N) on a host with one, found {args.device!r}", file=sys.stderr)
        return 2
    torch.cuda.set_device(args.device)
    from hotweights.cache.loadspec import LoadSpec
    from hotweights.standby.decoder import DecodeGraph
    from hotweights.standby.engine import new_decoder
    from hotweights.standby.weights import load_model

    model = load_model(args.model, LoadSpec(device=args.device)).model
    decoder = new_decoder(model, 1, 4096, 4096, batch_invariant=False)
    step = DecodeGraph(model, decoder.kv, 1, None, torch.cuda.graph_pool_handle())
    result: dict[str, object] = {"device": torch.cuda.get_device_name(args.device), "model": args.model}
    result["replay_ms"] = {
        str(length): median_step_ms(step, torch.tensor([[1], [length - 1]]), REPLAYS) for length in (16, 256)
    }
    per_kernel = kernels(step, args.kv_length)
    device_ms = sum(row["ms"] for row in per_kernel.values())
    bound_ms = sum(p.nbytes for p in model.parameters()) / (args.bandwidth_tbps * 1e12) * 1000
    result |= {"device_ms": round(device_ms, 3), "bound_ms": round(bound_ms, 3)}
    result["device_share_of_bound"] = round(bound_ms / device_ms, 3)
    result["kernels"] = {name: {"ms": round(row["ms"], 3), "count": row["count"]} for name, row in per_kernel.items()}
    for name, row in list(per_kernel.items())[:15]:
        print(f"{row['ms']:8.3f} ms {row['count']:5.0f}x  {name}", file=sys.stderr)
    result["products"] = products(model)
    del step
    decoder.close()
    result["scheduler"] = scheduler_streams(model, bound_ms)
    print(f"scheduler: {result['scheduler']}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
