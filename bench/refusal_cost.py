"""What refusals cost an engine that answers them itself: its event loop's CPU, and the decoding it feeds.

    python bench/refusal_cost.py [--device cpu|cuda:N] [--model DIR] [--rates 100,200] [--requests 10]
                                 [--max-tokens 64]

Starts one ``hotweights engine`` (primary; the embedded tiny model unless --model) that generates one sequence at a
time and, once it has timed one, lets none wait (``--max-batch 1 --queue-budget 0``), then times --requests
completions of --max-tokens one after the other (a 429 is sent again): alone, and while other clients send
completions at each of --rates a second, which find the slot taken and are refused (429) but for the few that find
it free. Reports the
timed completions' milliseconds per token (streamed, first token to last) alone and under each rate
(``slowdown``: their ratio), the flood's answers, and the CPU the engine's event loop thread spent per flood
request beyond what it spends on the timed ones alone. Without the gateway in front, every
refusal is the engine's to answer; the gateway answers for an engine whose last 429 said it would queue nothing
sooner (``docs/operations.md``, Admission), which is what these figures motivate.

The last stdout line is one JSON object. The engine is stopped at the end, on SIGINT/SIGTERM too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.overload import PROMPT, start, stop, wait_serving
from hotweights.contract import Endpoint
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command


def loop_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) of the process's main thread, the one that runs its event loop."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def timed(client: httpx.AsyncClient, url: str, max_tokens: int) -> float:
    """Seconds per token of one streamed completion, from its first token to its last (its wait for the slot left
    out), sent again while it is answered 429."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    while True:
        async with client.stream("POST", url + Endpoint.COMPLETIONS, json=body) as response:
            if response.status_code == 429:
                await response.aread()
                continue
            response.raise_for_status()
            times = [time.perf_counter() async for line in response.aiter_lines() if line.startswith("data: {")]
        if len(times) > 1:
            return (times[-1] - times[0]) / (len(times) - 1)


async def flood(client: httpx.AsyncClient, url: str, rate: float, stop: asyncio.Event) -> list[int | str]:
    """Completions sent open-loop at ``rate`` a second until ``stop``; each one's status (or error name)."""

    async def one() -> int | str:
        try:
            response = await client.post(url + Endpoint.COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 32})
        except httpx.HTTPError as exc:
            return type(exc).__name__
        return response.status_code

    tasks = []
    started = time.perf_counter()
    while not stop.is_set():
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(max(started + len(tasks) / rate - time.perf_counter(), 0))
    return list(await asyncio.gather(*tasks))


async def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, object]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for _ in range(3):  # warm-up
            await timed(client, url, args.max_tokens)
        cpu_before, started = loop_cpu_s(pid), time.perf_counter()
        alone = [await timed(client, url, args.max_tokens) for _ in range(args.requests)]
        idle_cpu_share = (loop_cpu_s(pid) - cpu_before) / (time.perf_counter() - started)  # the timed ones' own
        result: dict[str, object] = {"ms_per_token_alone": round(sum(alone) / len(alone) * 1000, 3)}
        for rate in args.rates:
            stop = asyncio.Event()
            cpu_before, started = loop_cpu_s(pid), time.perf_counter()
            sender = asyncio.create_task(flood(client, url, rate, stop))
            loaded = [await timed(client, url, args.max_tokens) for _ in range(args.requests)]
            stop.set()
            answers = await sender
            cpu_ms = (loop_cpu_s(pid) - cpu_before - idle_cpu_share * (time.perf_counter() - started)) * 1000
            per_token = sum(loaded) / len(loaded) * 1000
            result[f"{rate:g}/s"] = {
                "ms_per_token": round(per_token, 3),
                "slowdown": round(per_token / result["ms_per_token_alone"], 3),  # type: ignore[operator]
                "flood_answers": {str(k): v for k, v in Counter(answers).items()},
                "loop_cpu_ms_per_flood_request": round(cpu_ms / len(answers), 3),  # beyond the timed ones' own
            }
            print(f"{rate:g}/s: {result[f'{rate:g}/s']}", file=sys.stderr)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument(
        "--rates", type=lambda text: [float(x) for x in text.split(",")], default=[100.0, 200.0], help="default 100,200"
    )
    parser.add_argument("--requests", type=int, default=10, help="timed completions per measurement (default 10)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per timed completion (default 64)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally block stops the engine
    port = free_port()
    command = hotweights_command("engine", "--port", str(port), "--device", args.device)
    command += ["--max-batch", "1", "--queue-budget", "0"] + (["--model", args.model] if args.model else [])
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="hw-refusal-") as tmp:
        log = Path(tmp) / "engine.log"
        engine = start(command, log)
        try:
            wait_serving(url + Endpoint.PRIMARY, engine, log)
            result = {"device": args.device, "model": args.model or "tiny", "max_tokens": args.max_tokens}
            result |= asyncio.run(measure(url, engine.pid, args))
        finally:
            stop([engine])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
