"""Concurrency: a client's burst of concurrent streams through ``hotweights up`` with its defaults, served or refused.

    python bench/concurrency.py [--model DIR] [--device cpu|cuda:N] [--streams 32] [--max-tokens 64] [--bursts 2]

Starts ``hotweights up`` with its defaults (the embedded tiny model unless --model, its group on --device: a
primary, two standbys, a spare, the gateway), on free ports, in a directory of its own, and waits until the stack is
whole. It times the primary with one completion of --max-tokens through the gateway (until an engine has timed a
sequence it queues every request, ``hotweights.admission``: this bench is about what it does once it knows), then
sends --bursts bursts, one after the other, each of --streams concurrent greedy streamed completions of --max-tokens
through the gateway. Per burst: how the streams were answered (``answers``: status -> count, a stream that broke
off, without ``[DONE]`` or with an error event, counted as its error), ``refused`` (429), ``errors`` (anything else
but a whole stream), the tokens streamed, the first and the last token's p50/p99 in ms from the burst's start, and
the tokens a second over the burst. Targets (CPU, tiny, 32 streams of 64 tokens): 0 refused, 0 errors.

The last stdout line is one JSON object. The stack is stopped at the end (``hotweights down``, then its process
group), on SIGINT/SIGTERM too.
"""

from __future__ import annotations

import argparse
import asyncio
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
        "tokens_per_s": round(tokens / seconds, 1),
    }


async def measure(url: str, args: argparse.Namespace) -> dict[str, object]:
    """The primary timed with one completion, then --bursts bursts of --streams streams, one after the other."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.streams)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        timed = await client.post(url + Endpoint.COMPLETIONS, json={"prompt": PROMPT, "max_tokens": args.max_tokens})
        if timed.status_code != 200:
            raise SystemExit(f"the first completion was answered {timed.status_code}: {timed.text[:300]}")
        bursts = []
        for _ in range(args.bursts):
            started = time.perf_counter()
            streams = await asyncio.gather(
                *(stream(client, url, args.max_tokens, started) for _ in range(args.streams))
            )
            bursts.append(summary := summarize(streams, time.perf_counter() - started))
            print(f"burst {len(bursts)}: {summary}", file=sys.stderr)
    return {
        "bursts": bursts,
        "refused": sum(b["refused"] for b in bursts),
        "errors": sum(b["errors"] for b in bursts),
        "targets": {"refused": 0, "errors": 0},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--device", default="cpu", help="the group's device (default cpu)")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams a burst (default 32)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens a stream (default 64)")
    parser.add_argument("--bursts", type=int, default=2, help="bursts, one after the other (default 2)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop the stack
    result: dict[str, object] = {"device": args.device, "model": args.model or "tiny", "streams": args.streams}
    result |= {"max_tokens": args.max_tokens, "max_batch": LIMITS.max_batch, "queue_budget_s": LIMITS.queue_budget_s}
    with up_stack(args.model, args.device) as stack:
        stack.wait_whole()
        result |= asyncio.run(measure(stack.gateway_url, args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
