"""Stalls: how soon the reference engine's progress check reports a frozen inference thread, and what does not.

    python bench/stall.py [--model DIR] [--device cpu|cuda:N] [--seconds 5] [--multiple 5] [--long-prompts 3]

Starts one ``hotweights engine`` (a primary with the shipped defaults; the embedded tiny model unless --model) and
asks its ``GET /health/ready`` every ``CHECK_S`` throughout, from a thread of its own, as the controller does: a
503 there is a failover. Then, one phase after the other:

- ``capacity``: ``max_batch`` clients in a closed loop for --seconds: completions per second (the overload bench's
  closed loop and open-loop sender, ``bench.overload``);
- ``overload``: completions sent open-loop at --multiple times that capacity for --seconds (429s are expected);
- ``long_prompts``: --long-prompts completions whose prompts fill the KV slot (token ids), one at a time, then as
  many at once beside ordinary clients;
- ``stall``: ``standby.progress.FREEZE_SIGNAL`` with a completion in flight: ``detect_ms``, from the signal to the
  first 503, and its reason (the target: within the floor, ``STALL_FLOOR_S``, plus one check).

Per phase: the checks asked (``checks``), their p99 and longest answer times, those not answered 200 within
``CHECK_TIMEOUT_S`` (``unready``: the target is 0 before the stall) and the first one's reason. The last stdout
line is one JSON object. The engine is stopped at the end, on SIGINT/SIGTERM too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.overload import PROMPT, capacity, engine_max_batch, offered
from hotweights.admission import ServingLimits
from hotweights.contract import Endpoint
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command
from hotweights.standby.progress import FREEZE_SIGNAL, STALL_FLOOR_S
from hotweights.stats import percentile

LIMITS = ServingLimits()  # the engine's defaults
CHECK_S = 0.05  # the controller's health check interval (health.interval_ms)
CHECK_TIMEOUT_S = 1.0  # a check unanswered this long is counted unready (the controller's own is 200 ms)
MAX_TOKENS = 32
LONG_MAX_TOKENS = 8  # a long prompt's completion: the prompt fills the rest of the KV slot


@dataclass
class Checks:
    """What the readiness checks of one phase saw."""

    latencies: list[float] = field(default_factory=list)  # seconds, of every check
    unready: int = 0
    reasons: list[str] = field(default_factory=list)
    first_503_at: float | None = None  # time.monotonic()

    def summary(self) -> dict[str, object]:
        return {
            "checks": len(self.latencies),
            "check_p99_ms": round(percentile(self.latencies, 99) * 1000, 1) if self.latencies else None,
            "check_max_ms": round(max(self.latencies, default=0.0) * 1000, 1),
            "unready": self.unready,
            "first_reason": self.reasons[0] if self.reasons else None,
        }


def watch(url: str, phase: dict[str, Checks], stop: threading.Event) -> None:
    """Ask ``url``'s readiness every CHECK_S into the current phase's ``Checks`` (``phase["now"]``), on a thread of
    its own (as the controller asks from a process of its own), until ``stop``."""
    with httpx.Client(timeout=CHECK_TIMEOUT_S) as client:
        while not stop.wait(CHECK_S):
            checks, started = phase["now"], time.monotonic()
            try:
                response = client.get(url + Endpoint.READY)
                status, reason = response.status_code, response.json().get("reason")
            except httpx.HTTPError as exc:
                status, reason = None, f"{type(exc).__name__}: {exc}"
            checks.latencies.append(time.monotonic() - started)
            if status != 200:
                checks.unready += 1
                checks.reasons.append(str(reason))
                checks.first_503_at = checks.first_503_at or time.monotonic()


async def complete(client: httpx.AsyncClient, url: str, prompt: object, max_tokens: int) -> int | str:
    try:
        response = await client.post(url + Endpoint.COMPLETIONS, json={"prompt": prompt, "max_tokens": max_tokens})
        return response.status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def loads(seconds: float) -> argparse.Namespace:
    """The overload bench's settings of a load of ``seconds`` (``bench.overload``: its prompt, MAX_TOKENS each)."""
    return argparse.Namespace(seconds=seconds, max_tokens=MAX_TOKENS)


async def overload(url: str, rate: float, seconds: float) -> dict[str, int]:
    """Completions sent open-loop at ``rate`` per second for ``seconds``: how many were answered with each status."""
    statuses = [answer.status for answer in await offered(url, rate, loads(seconds))]
    return {str(status): statuses.count(status) for status in set(statuses)}


async def long_prompts(url: str, count: int) -> dict[str, object]:
    """``count`` completions whose prompts fill the KV slot, one at a time, then at once beside ordinary clients."""
    prompt = [3 + i % 1000 for i in range(LIMITS.kv_cache_tokens - LONG_MAX_TOKENS)]
    async with httpx.AsyncClient(timeout=300) as client:
        started = time.monotonic()
        alone = [await complete(client, url, prompt, LONG_MAX_TOKENS) for _ in range(count)]
        alone_s = (time.monotonic() - started) / count
        ordinary = [complete(client, url, PROMPT, MAX_TOKENS) for _ in range(count)]
        together = await asyncio.gather(
            *(complete(client, url, prompt, LONG_MAX_TOKENS) for _ in range(count)), *ordinary
        )
    return {"prompt_tokens": len(prompt), "alone": alone, "mean_alone_s": round(alone_s, 3), "together": together}


async def stall(url: str, pid: int, phase: dict[str, Checks]) -> dict[str, object]:
    """Freeze the engine's inference thread with a completion in flight; the time until its first 503."""
    async with httpx.AsyncClient(timeout=300) as client:
        body = {"prompt": PROMPT, "max_tokens": LIMITS.kv_cache_tokens // 2, "stream": True}
        async with client.stream("POST", url + Endpoint.COMPLETIONS, json=body) as stream:
            await anext(stream.aiter_lines())
            os.kill(pid, FREEZE_SIGNAL)
            frozen = time.monotonic()
            deadline = frozen + 30
            while phase["now"].first_503_at is None and time.monotonic() < deadline:
                await asyncio.sleep(CHECK_S / 5)
    first = phase["now"].first_503_at
    return {"detect_ms": None if first is None else round((first - frozen) * 1000, 1), "floor_ms": STALL_FLOOR_S * 1000}


async def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, object]:
    phase, stop = {"now": Checks()}, threading.Event()
    watcher = threading.Thread(target=watch, args=(url, phase, stop), daemon=True)
    watcher.start()
    result: dict[str, object] = {}

    async def run(name: str, work: Awaitable[object]) -> None:
        phase["now"] = Checks()
        outcome = await work
        result[name] = ({"result": outcome} if not isinstance(outcome, dict) else outcome) | phase["now"].summary()
        print(f"{name}: {result[name]}", file=sys.stderr)

    async with httpx.AsyncClient(timeout=120) as client:
        await complete(client, url, PROMPT, MAX_TOKENS)  # warm: the first connection
    await run("capacity", capacity(url, loads(args.seconds), engine_max_batch(url)))
    rate = result["capacity"]["result"] * args.multiple  # type: ignore[index]
    await run("overload", overload(url, rate, args.seconds))
    await run("long_prompts", long_prompts(url, args.long_prompts))
    await run("stall", stall(url, pid, phase))
    stop.set()
    watcher.join()
    result["unready_before_stall"] = sum(result[p]["unready"] for p in ("capacity", "overload", "long_prompts"))  # type: ignore[index]
    result["targets"] = {"unready_before_stall": 0, "detect_ms": round((STALL_FLOOR_S + CHECK_S) * 1000)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=float, default=5.0, help="capacity and overload (default 5)")
    parser.add_argument("--multiple", type=float, default=5.0, help="overload, times the capacity (default 5)")
    parser.add_argument("--long-prompts", type=int, default=3, help="default 3")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally block stops the engine
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = hotweights_command("engine", "--port", str(port), "--device", args.device, "--role", "primary")
    command += ["--model", args.model] if args.model else []
    with tempfile.TemporaryDirectory(prefix="hw-stall-") as tmp:
        log = Path(tmp) / "engine.log"
        with log.open("w") as out:
            engine = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=out)
        try:
            wait_ready(url, engine, log)
            result = {"device": args.device, "model": args.model or "tiny"} | asyncio.run(
                measure(url, engine.pid, args)
            )
        finally:
            engine.kill()
            engine.wait()
    print(json.dumps(result))
    return 0


def wait_ready(url: str, engine: subprocess.Popen, log: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.poll() is not None:
            raise SystemExit(f"the engine exited with {engine.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + Endpoint.PRIMARY, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} not serving after {timeout_s} s:\n{log.read_text()}")


if __name__ == "__main__":
    sys.exit(main())
