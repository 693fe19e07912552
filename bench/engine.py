"""Measure a real ``hotweights engine`` process: promote time, health latency under load, tokens/s.

    python bench/engine.py [--device cpu|cuda:N] [--model DIR] [--cycles 50] [--gen-tokens 1000]

Starts one engine as a standby (the embedded tiny model unless --model), then:
- promote/demote ``--cycles`` times: p50/max of the promote reply's ``duration_ms`` and of the
  wall time of the POST as the client sees it;
- GET /primary as fast as one client can while a ``--gen-tokens`` generation runs: p50/p99/max;
- tokens/s of one greedy sequence, and of --max-batch sequences at once.
Prints a table to stderr; the last stdout line is one JSON object with the numbers and targets
(promote <= 50 ms on CPU, <= 20 ms on CUDA; p99 health <= 10 ms). The engine is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from hotweights.contract import Endpoint, Role
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command
from hotweights.stats import percentile

REPO = Path(__file__).resolve().parents[1]
HEALTH_TARGET_MS = 10.0


def start_engine(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    command = hotweights_command("engine", "--role", Role.STANDBY, "--port", str(port))
    command += ["--device", args.device, "--max-batch", str(args.max_batch)]
    command += ["--kv-cache-tokens", str(args.kv_cache_tokens)] + (["--model", args.model] if args.model else [])
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=out)


def wait_ready(client: httpx.Client, process: subprocess.Popen, log: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"engine exited with {process.returncode}:\n{log.read_text()}")
        try:
            if client.get(Endpoint.READY).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"engine not ready after {timeout_s} s:\n{log.read_text()}")


def measure_promote(client: httpx.Client, cycles: int) -> dict[str, float]:
    reported, wall = [], []
    for _ in range(cycles):
        start = time.perf_counter()
        reply = client.post(Endpoint.PROMOTE).json()
        wall.append((time.perf_counter() - start) * 1000)
        assert reply["changed"], reply
        reported.append(reply["duration_ms"])
        client.post(Endpoint.DEMOTE).raise_for_status()
    return {
        "promote_ms_p50": round(percentile(reported, 50), 3),
        "promote_ms_max": round(max(reported), 3),
        "promote_wall_ms_p50": round(percentile(wall, 50), 3),
        "promote_wall_ms_max": round(max(wall), 3),
    }


def complete(client: httpx.Client, max_tokens: int, prompt: str = "The quick brown fox") -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = client.post(Endpoint.COMPLETIONS, json=body, timeout=600)
    reply.raise_for_status()
    return reply.json()["usage"]["completion_tokens"]


def measure_health_under_load(client: httpx.Client, url: str, gen_tokens: int) -> dict[str, float]:
    done = threading.Event()
    worker = threading.Thread(target=lambda: (complete(httpx.Client(base_url=url), gen_tokens), done.set()))
    worker.start()
    time.sleep(0.1)  # let the prefill start
    latencies = []
    while not done.is_set():
        start = time.perf_counter()
        status = client.get(Endpoint.PRIMARY).status_code
        latencies.append((time.perf_counter() - start) * 1000)
        assert status == 200, status
    worker.join()
    return {
        "health_samples": len(latencies),
        "health_p50_ms": round(percentile(latencies, 50), 3),
        "health_p99_ms": round(percentile(latencies, 99), 3),
        "health_max_ms": round(max(latencies), 3),
    }


def measure_throughput(url: str, gen_tokens: int, sequences: int) -> float:
    clients = [httpx.Client(base_url=url) for _ in range(sequences)]
    start = time.perf_counter()
    with ThreadPoolExecutor(sequences) as pool:
        tokens = sum(pool.map(lambda c: complete(c, gen_tokens, prompt=f"Story {id(c)}:"), clients))
    return round(tokens / (time.perf_counter() - start), 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--cycles", type=int, default=50, help="promote/demote cycles (default 50)")
    parser.add_argument("--gen-tokens", type=int, default=1000, help="tokens per generation (default 1000)")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--kv-cache-tokens", type=int, default=4096)
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix="bench-engine-", suffix=".log")[1])
    process = start_engine(args, port, log)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            wait_ready(client, process, log)
            results = {"device": args.device, "model": client.get(Endpoint.READY).json()["model"]}
            results |= measure_promote(client, args.cycles)
            client.post(Endpoint.PROMOTE).raise_for_status()
            results["kv_cache_bytes"] = client.get(Endpoint.PRIMARY).json()["kv_cache_bytes"]
            results |= measure_health_under_load(client, url, args.gen_tokens)
            results["tokens_per_s"] = measure_throughput(url, args.gen_tokens, 1)
            results[f"tokens_per_s_{args.max_batch}_concurrent"] = measure_throughput(
                url, args.gen_tokens, args.max_batch
            )
    finally:
        process.kill()
        process.wait(timeout=30)
        log.unlink(missing_ok=True)

    promote_target = 20.0 if args.device.startswith("cuda") else 50.0
    results["targets"] = {"promote_ms": promote_target, "health_p99_ms": HEALTH_TARGET_MS}
    results["met"] = {
        "promote_ms": results["promote_ms_max"] <= promote_target,
        "health_p99_ms": results["health_p99_ms"] <= HEALTH_TARGET_MS,
    }
    width = max(map(len, results))
    for key, value in results.items():
        print(f"{key:<{width}}  {value}", file=sys.stderr)
    print(json.dumps(results))
    return 0 if all(results["met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
