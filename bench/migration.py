"""Streams in flight across a failover: broken streams, wrong texts and the longest stall at the cut.

    python bench/migration.py                                   # tiny model on CPU, 16 streams
    python bench/migration.py --preset xl --device cuda:0 --streams 64 --max-tokens 256 [--batch-invariant]
    python bench/migration.py --batch-invariant --streams 4 --signals switchover,kill

Starts its own stack (``hotweights up``: controller, daemon, a primary and two standbys, the gateway; torn down at
the end, on SIGINT/SIGTERM too), takes each prompt's greedy text through the gateway while nothing fails, then, once
with no fault (the uncut round: its mismatches are the engine's own floor, greedy text that changes with how
requests were batched) and once for each of ``--signals`` (kill: SIGKILL, stop: SIGSTOP of the primary, which the
controller detects as hung and fences; switchover: not a signal but the planned change, ``POST /switchover``), opens
``--streams`` greedy streams through the gateway, sends the signal to the primary (or asks for the switchover) once
every stream has ``--cut-after`` chunks, and reads every stream to its end. Per fault: the streams in flight at the
fault, the migrated ones (continued on the new primary, from the gateway's event log: a stream in flight at the
client but not migrated had been generated to its end before the fault, as happens when the engine outruns the
client reading), the broken ones (an error event, no ``[DONE]``, a failed connection), the mismatched ones (text
other than the reference), the largest gap between two chunks of a stream from its last chunk before the fault on,
beyond the uncut round's wait for the same text (the stall at the cut, in ms: ``Stream.stall``; the uncut round's
own figure is its longest wait), and how many of the migrated ones started from the old primary's KV cache
(``adopted``: the new primary's count, ``standby.kvshare``); a switchover's round adds the controller's answer
(``switchover``: its drain, promote and demote times and the slots the old primary handed over). Between faults it
waits for the stack to be whole again. The last stdout line is one JSON object. Targets on the H200 (``xl``, 64
streams of 256 tokens): 0 broken, 0 mismatched, largest gap <= 500 ms (kill) and <= 900 ms (stop).
``--batch-invariant`` runs the engines with ``engine.batch_invariant`` (``standby.decoder``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hotweights.cache.makemodel import PRESETS, write_checkpoint
from hotweights.chaos.clusterview import ControlApi
from hotweights.chaos.faults import Target, send
from hotweights.chaos.scenarios import serving_primary, wait_dead
from hotweights.chaos.stack import DRILL_LIMITS, DrillStack, run_interruptible
from hotweights.contract import Endpoint
from hotweights.eventkinds import EventField, EventKind
from hotweights.gateway.server import GATEWAY_EVENTS_FILE

START_TIMEOUT_S = 900.0
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
SWITCHOVER = "switchover"  # not a signal: the planned change, ``POST /switchover``
FAULTS = (*SIGNALS, SWITCHOVER)
SWITCHOVER_TIMEOUT_S = 120.0
ADOPTED_METRIC = "hotweights_engine_kv_adopted_sequences"
UNCUT = "uncut"  # the first round: the same streams with no fault, its mismatches the engine's own floor
PROMPT_WIDTH = 8  # prompts are padded so every one is about as long
BEGAN = time.monotonic()


def progress(what: str) -> None:
    """One line on stderr with the seconds since the bench began, so a run cut short shows where it was."""
    print(f"[{time.monotonic() - BEGAN:7.1f} s] {what}", file=sys.stderr, flush=True)


@dataclass
class Stream:
    """One greedy stream through the gateway: its text and when each chunk came."""

    prompt: str
    text: str = ""
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # each chunk with text: time, text length
    outcome: str = ""  # "done", or what broke it

    async def run(self, client: httpx.AsyncClient, max_tokens: int) -> None:
        request = {"prompt": self.prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
        try:
            async with client.stream("POST", Endpoint.COMPLETIONS, json=request) as response:
                if response.status_code != 200:
                    self.outcome = f"{response.status_code}: {(await response.aread())[:200]!r}"
                    return
                await self.read(response)
        except httpx.HTTPError as exc:
            self.outcome = f"{type(exc).__name__}: {exc}"

    async def read(self, response: httpx.Response) -> None:
        async for line in response.aiter_lines():
            payload = line.removeprefix("data: ")
            if not payload:
                continue
            if payload == "[DONE]":
                self.outcome = "done"
                return
            event = json.loads(payload)
            if "error" in event:
                self.outcome = f"error event: {event['error']['message'][:200]}"
                return
            if text := "".join(choice["text"] for choice in event["choices"]):
                self.text += text
                self.arrivals.append((time.monotonic(), len(self.text)))
        self.outcome = "ended without [DONE]"

    def paced(self) -> dict[int, float]:
        """When each length of text arrived."""
        return {length: t for t, length in self.arrivals}

    def stall(self, at: float, uncut: dict[int, float] | None) -> float | None:
        """The longest wait for a chunk from the last one before ``at`` on, beyond the wait for the same text in the
        ``uncut`` round (``paced``; seconds). From the last chunk before the fault: chunks the failed engine sent
        before it may arrive after it, and the stall comes once they are read. Beyond the uncut wait: a model may
        generate tokens whose text is held back (an incomplete character, a stop string's start), and a stream
        then waits without any failover."""
        before = [a for a in self.arrivals if a[0] <= at][-1:]
        later = [a for a in self.arrivals if a[0] > at]
        if not (before and later):
            return None
        uncut = uncut or {}
        waits = []
        for (t0, n0), (t1, n1) in itertools.pairwise(before + later):
            waits.append(t1 - t0 - (uncut[n1] - uncut[n0] if n0 in uncut and n1 in uncut else 0.0))
        return max(waits)


def prompts(n: int) -> list[str]:
    return [f"Stream {i:0{PROMPT_WIDTH}d} of the migration bench" for i in range(n)]


async def references(client: httpx.AsyncClient, texts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy text through the gateway, before any fault."""

    async def one(prompt: str) -> str:
        request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        response = await client.post(Endpoint.COMPLETIONS, json=request)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    return list(await asyncio.gather(*(one(p) for p in texts)))


async def primary_target(api: ControlApi) -> Target:
    view = await api.cluster()
    assert view is not None, "the controller does not answer"
    (primary,) = view.primaries()
    target = view.target(primary["id"])
    assert target is not None, f"the primary {primary['id']} has no live process"
    return target


def migrations_after(events: Path, offset: int) -> list[dict[str, Any]]:
    """The completions the gateway workers continued on another engine (``migration`` events) in ``events``
    (their shared log) past byte ``offset``."""
    if not events.exists():
        return []
    with events.open("rb") as log:
        log.seek(offset)
        logged = [json.loads(line) for line in log if line.strip()]
    return [event for event in logged if event.get("kind") == EventKind.MIGRATION]


async def adopted(client: httpx.AsyncClient, engines: set[str]) -> int:
    """Continuations the ``engines`` (URLs) started from a failed primary's KV cache (``standby.kvshare``)."""
    total = 0
    for url in engines:
        text = (await client.get(f"{url}{Endpoint.METRICS}")).text
        total += sum(
            int(float(line.split()[-1])) for line in text.splitlines() if line.startswith(ADOPTED_METRIC + " ")
        )
    return total


async def switch_over(api: ControlApi) -> dict[str, Any]:
    """``POST /switchover``: its steps' durations (ms) and the slots the old primary handed over; RuntimeError unless
    it answers 200."""
    response = await api.post("/switchover", SWITCHOVER_TIMEOUT_S)
    if response.status_code != 200:
        raise RuntimeError(f"POST /switchover answered {response.status_code}: {response.text[:300]}")
    return {k: v for k, v in response.json().items() if k.endswith("_ms") or k == "kv_slots_handed_over"}


async def fault(
    api: ControlApi,
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    name: str,
    expected: list[str],
    events: Path,
    paces: dict[str, dict[int, float]],
) -> dict[str, Any]:
    """One round: streams opened, the primary signalled once each has ``--cut-after`` chunks (``UNCUT``: no
    signal at all), every stream read to its end; the round's figures. ``paces``: each prompt's ``Stream.paced``
    in the uncut round, which that round fills in and the others' stalls are measured against."""
    if missing := await api.wait_complete(START_TIMEOUT_S):
        raise RuntimeError(f"the stack was not whole before the {name} round: {missing}")
    target = await primary_target(api)
    logged = events.stat().st_size if events.exists() else 0
    streams = [Stream(p) for p in prompts(args.streams)]
    tasks = [asyncio.create_task(s.run(client, args.max_tokens)) for s in streams]
    while not all(len(s.arrivals) >= args.cut_after or s.outcome for s in streams):
        await asyncio.sleep(0.005)
    at = time.monotonic()
    switched = asyncio.create_task(switch_over(api)) if name == SWITCHOVER else None
    if name in SIGNALS and not send(target, SIGNALS[name]):
        raise RuntimeError(f"the primary {target} was gone before the {name} signal")
    in_flight = sum(not s.outcome for s in streams)
    await asyncio.gather(*tasks)
    steps = {"switchover": await switched} if switched is not None else {}
    if name in SIGNALS:
        await wait_dead(target)
        if await serving_primary(api, {f"{target.name}:{target.pid}"}) is None:  # the next round needs it
            raise RuntimeError(f"no new primary served after the {name} of {target.name}")
    gaps = [g for s in streams if (g := s.stall(at, paces.get(s.prompt))) is not None]
    if not gaps:
        raise RuntimeError(
            f"{name}: no stream had text on both sides of the cut; lower --cut-after or raise --max-tokens"
        )
    if name == UNCUT:
        paces.update((s.prompt, s.paced()) for s in streams)
    migrations = migrations_after(events, logged)
    return {
        "signal": name,
        "in_flight": in_flight,
        "migrated": len(migrations),
        "adopted": await adopted(client, {m[EventField.TO] for m in migrations}),
        "broken": sum(s.outcome != "done" for s in streams),
        "mismatched": sum(s.outcome == "done" and s.text != want for s, want in zip(streams, expected, strict=True)),
        "max_gap_ms": round(max(gaps) * 1000, 1),
        "errors": sorted({s.outcome for s in streams if s.outcome != "done"})[:3],
        **steps,
    }


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = args.model
    if model is None and args.preset != "tiny":
        device = "cuda" if args.device.startswith("cuda") else "cpu"
        model = str(write_checkpoint(workdir / args.preset, PRESETS[args.preset], device=device, progress=False))
        progress(f"wrote the {args.preset} checkpoint")
    kv_tokens = args.max_tokens + 64  # the prompt and the budget, with room
    stack = DrillStack.create(
        workdir / "stack", "gateway", proxied=False, model=model or "", device=args.device,
        limits=replace(
            DRILL_LIMITS, kv_cache_tokens=kv_tokens, max_batch=args.streams, batch_invariant=args.batch_invariant
        ),
    )  # fmt: skip
    api = stack.control_api()
    rounds = []
    try:
        stack.start()
        if missing := await api.wait_complete(START_TIMEOUT_S):
            raise RuntimeError(f"the stack did not start within {START_TIMEOUT_S:g} s: {missing}")
        progress("the stack is whole")
        async with httpx.AsyncClient(base_url=stack.lb_url, timeout=httpx.Timeout(120.0)) as client:
            expected = await references(client, prompts(args.streams), args.max_tokens)
            progress(f"{args.streams} reference texts")
            paces: dict[str, dict[int, float]] = {}
            for name in [UNCUT, *args.signals.split(",")]:
                events = stack.config.state_dir / GATEWAY_EVENTS_FILE
                rounds.append(await fault(api, client, args, name, expected, events, paces))
                progress(f"{name}: {json.dumps(rounds[-1])}")
    finally:
        await api.aclose()
        await asyncio.to_thread(stack.teardown)
    cut = rounds[1:]
    return {
        "preset": args.preset if args.model is None else args.model,
        "device": args.device,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "batch_invariant": args.batch_invariant,
        "broken": sum(r["broken"] for r in cut),
        "mismatched": sum(r["mismatched"] for r in cut),
        "mismatched_uncut": rounds[0]["mismatched"],
        "max_gap_ms": {r["signal"]: r["max_gap_ms"] for r in cut},
        "in_flight": {r["signal"]: r["in_flight"] for r in rounds},
        "migrated": {r["signal"]: r["migrated"] for r in cut},
        "adopted": {r["signal"]: r["adopted"] for r in cut},
        "rounds": rounds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint to serve (default: --preset, written to a temp dir)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams at each fault (default 16)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per stream (default 256)")
    parser.add_argument("--cut-after", type=int, default=16, help="chunks every stream has at the fault (default 16)")
    parser.add_argument(
        "--signals", default="kill,stop", help="comma-separated kill/stop/switchover, in order (default kill,stop)"
    )
    parser.add_argument("--batch-invariant", action="store_true", help="the engines' engine.batch_invariant")
    args = parser.parse_args()
    if unknown := [s for s in args.signals.split(",") if s not in FAULTS]:
        parser.error(f"--signals: unknown {unknown}; choose from {sorted(FAULTS)}")
    if not 0 < args.cut_after < args.max_tokens:
        parser.error(f"--cut-after must be in [1, --max-tokens), found {args.cut_after}")
    with tempfile.TemporaryDirectory(prefix="hw-migration-") as workdir:
        result = run_interruptible(run(args, Path(workdir)))
    if result is None:
        print("interrupted; the stack was torn down", file=sys.stderr)
        return 130
    print(json.dumps(result))
    return 0 if result["broken"] == 0 and result["mismatched"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
