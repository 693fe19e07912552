"""Concurrency: a client's burst of concurrent streams through ``hotweights up`` with its defaults, served or refused.

    python bench/concurrency.py [--model DIR] [--device cpu|cuda:N] [--streams 32] [--max-tokens 64] [--bursts 2]
                                [--min-speedup 0] [--exit-unmet]

Starts ``hotweights up`` with its defaults (the embedded tiny model unless --model, its group on --device: a
primary, two standbys, a spare, the gateway), on free ports, in a directory of its own, and waits until the stack is
whole. It times the primary with one greedy streamed completion of --max-tokens through the gateway, alone (until
an engine has timed a sequence it queues every request, ``hotweights.admission``: this bench is about what it does
once it knows; its tokens a second are ``batch1_tokens_per_s``), then once more alone, whose tokens after its first
over the time from its first token to its last are ``batch1_decode_tokens_per_s`` (one sequence's decode speed, what
the HBM bound is about: weights bytes over the card's bandwidth), then sends --bursts bursts, one after the other,
each of --streams concurrent greedy streamed completions of --max-tokens through the gateway. Per burst: how the
streams were answered (``answers``: status -> count, a stream that broke off, without ``[DONE]`` or with an error
event, counted as its error), ``refused`` (429), ``errors`` (anything else but a whole stream), the tokens streamed,
the first and the last token's p50/p99 in ms from the burst's start, the tokens a second over the burst, and that
over ``batch1_tokens_per_s`` (``speedup``: both from the request's start to its last token, prefills and admission
included). The primary's KV pool (``kv_pool``: blocks, and the most in use seen during the bursts) and ``max_batch``
are its own, as its health reports them. Targets: 0 refused, 0 errors (CPU, tiny, 32 streams of 64 tokens: in CI);
on an H100 or H200 with ``xl``, 64 streams of 256 tokens, the best burst's speedup at least --min-speedup 40
(``met``: every target met).

The last stdout line is one JSON object. The stack is stopped at the end (``hotweights down``, then its process
group), on SIGINT/SIGTERM too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.request_shapes import PROMPT, up_stack
from hotweights.admission import ServingLimits
from hotweights.contract import Endpoint
from hotweights.stats import percentile

LIMITS = ServingLimits()  # what the stack's engines run with: its defaults
POOL_PROBE_S = 0.05  # how often the primary's KV pool is read during a burst


@dataclass
class Stream:
    """One streamed completion as its client saw it; times in seconds from its burst's start."""

    outcome: str  # "200" for a whole stream, else the status, the transport error's name, or "broken"
    tokens: int = 0  # generated, as its usage says
    first_s: float | None = None  # its first chunk
    last_s: float | None = None  # its last chunk of text


async def stream(client: httpx.AsyncClient, url: str, max_tokens: int, started: float) -> Stream:
    """One greedy streamed completion through the gateway, read to its end."""
    body: dict[str, object] = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}  # its last chunk counts the tokens
    seen = Stream("broken")
    try:
        async with client.stream("POST", url + Endpoint.COMPLETIONS, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Stream(str(response.status_code))
            async for line in response.aiter_lines():
                data = line.removeprefix("data: ").strip()
                if data == "[DONE]":
                    seen.outcome = "200"
                elif data and "error" in (event := json.loads(data)):
                    return seen
                elif data and "usage" in event:
                    seen.tokens = event["usage"]["completion_tokens"]
                elif data:
                    seen.last_s = time.perf_counter() - started
                    seen.first_s = seen.last_s if seen.first_s is None else seen.first_s
    except httpx.HTTPError as exc:
        seen.outcome = type(exc).__name__
    return seen


def ms(seconds: list[float], q: float) -> float:
    return round(percentile(seconds, q) * 1000, 1)


def tokens_per_s(streams: list[Stream], seconds: float) -> float:
    return round(sum(s.tokens for s in streams) / seconds, 1)


def summarize(streams: list[Stream], seconds: float) -> dict[str, object]:
    """One burst's figures (module docstring); the token times only where some stream had a token."""
    firsts = [s.first_s for s in streams if s.first_s is not None]
    lasts = [s.last_s for s in streams if s.last_s is not None]
    tokens = sum(s.tokens for s in streams)
    times = {"first_token_p50_ms": ms(firsts, 50), "first_token_p99_ms": ms(firsts, 99)} if firsts else {}
    times |= {"last_token_p50_ms": ms(lasts, 50), "last_token_p99_ms": ms(lasts, 99)} if lasts else {}
    return {
        "answers": dict(Counter(s.outcome for s in streams)),
        "refused": sum(s.outcome == "429" for s in streams),
        "errors": sum(s.outcome not in ("200", "429") for s in streams),
        "tokens": tokens,
        **times,
        "seconds": round(seconds, 2),
        "tokens_per_s": tokens_per_s(streams, seconds),
    }


async def most_blocks_used(client: httpx.AsyncClient, primary: str, done: asyncio.Event) -> int:
    """The most KV blocks the primary's pool had in use, read every POOL_PROBE_S until ``done``."""
    most = 0
    while not done.is_set():
        pool = (await client.get(primary + Endpoint.PRIMARY)).json().get("kv_pool") or {}
        most = max(most, pool.get("used", 0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), POOL_PROBE_S)
    return most


async def measure(url: str, primary: str, args: argparse.Namespace) -> dict[str, object]:
    """The primary timed with one streamed completion alone, then --bursts bursts of --streams streams, one after the
    other, its KV pool read meanwhile."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.streams + 1)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        started = time.perf_counter()
        alone = await stream(client, url, args.max_tokens, started)
        if alone.outcome != "200":
            raise SystemExit(f"the first completion, alone, was answered {alone.outcome}")
        batch1 = tokens_per_s([alone], time.perf_counter() - started)
        again = await stream(client, url, args.max_tokens, time.perf_counter())
        decoding = (again.last_s or 0.0) - (again.first_s or 0.0)
        decode_rate = round((again.tokens - 1) / decoding, 1) if again.outcome == "200" and decoding > 0 else None
        health = (await client.get(primary + Endpoint.PRIMARY)).json()
        bursts, most_used = [], 0
        for _ in range(args.bursts):
            done = asyncio.Event()
            probe = asyncio.create_task(most_blocks_used(client, primary, done))
            started = time.perf_counter()
            streams = await asyncio.gather(
                *(stream(client, url, args.max_tokens, started) for _ in range(args.streams))
            )
            summary = summarize(streams, time.perf_counter() - started)
            done.set()
            most_used = max(most_used, await probe)
            bursts.append(summary | {"speedup": round(summary["tokens_per_s"] / batch1, 1)})
            print(f"burst {len(bursts)}: {bursts[-1]}", file=sys.stderr)
    result = {"max_batch": health.get("max_batch"), "kv_pool": (health.get("kv_pool") or {}) | {"most_used": most_used}}
    result |= {"batch1_tokens_per_s": batch1, "batch1_decode_tokens_per_s": decode_rate}
    result |= {"bursts": bursts, "speedup": max(b["speedup"] for b in bursts)}
    result |= {"refused": sum(b["refused"] for b in bursts), "errors": sum(b["errors"] for b in bursts)}
    targets = {"refused": 0, "errors": 0, "speedup": args.min_speedup}
    met = result["refused"] == 0 and result["errors"] == 0 and result["speedup"] >= args.min_speedup
    return result | {"targets": targets, "met": met}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--device", default="cpu", help="the group's device (default cpu)")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams a burst (default 32)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens a stream (default 64)")
    parser.add_argument("--bursts", type=int, default=2, help="bursts, one after the other (default 2)")
    parser.add_argument(
        "--min-speedup", type=float, default=0.0, help="the best burst's tokens/s over batch 1's target (default 0)"
    )
    parser.add_argument("--exit-unmet", action="store_true", help="exit 1 when a target is not met")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop the stack
    result: dict[str, object] = {"device": args.device, "model": args.model or "tiny", "streams": args.streams}
    result |= {"max_tokens": args.max_tokens, "queue_budget_s": LIMITS.queue_budget_s}
    with up_stack(args.model, args.device) as stack:
        primary = stack.wait_whole()
        result |= asyncio.run(measure(stack.gateway_url, primary, args))
    print(json.dumps(result))
    return 1 if args.exit_unmet and not result["met"] else 0


if __name__ == "__main__":
    sys.exit(main())
