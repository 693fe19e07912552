"""Gray failures through ``hotweights up`` with its shipped defaults: a stalled, a slowed and a wrong primary under
load, and the loads that must not look like any of them.

    python bench/gray.py [--model DIR] [--device cpu|cuda:N] [--rps 10] [--max-tokens 16] [--keep-logs DIR]

Starts ``hotweights up`` with its defaults (no extra keys; the embedded tiny model unless --model) on free ports and
waits until the stack is whole. First the loads that must not look like a fault (``false_positives``, below: before
any switchover, since a group switches over from a slow primary once every ``health.degraded_every_s`` at most);
then, phase after phase, each with --rps greedy completions a second through the
gateway (open loop, never retried) from LOAD_BEFORE_S before its fault to LOAD_AFTER_S after the controller acted,
and the stack whole again before the next:

- ``stall``: ``standby.progress.FREEZE_SIGNAL`` to the primary: ``first_ok_ms``, from the signal to the first
  completion answered 200 of those sent after it (target <= 1500), and ``errors`` (target 0);
- ``slow``: ``standby.drillfaults.SLOW_SIGNAL`` (steps 20x slower) to the primary: ``replaced_ms``, from the
  signal to the controller's ``switchover`` event (target <= 5000; ``replaced_by`` says which), or its ``failover``
  where a slowed step outlasted the progress check's bound first (a step of 50 ms on a loaded CPU takes 1 s slowed),
  and ``errors`` (target 0); the old primary, a standby then, is given its speed back;
- ``wrong``: ``standby.drillfaults.WRONG_SIGNAL`` (wrong tokens) to the primary: ``detected_ms`` (event
  ``wrong_output``) and ``fenced_ms`` (its ``fence``; target <= 10000), the wrong answers clients got meanwhile;
- ``false_positives``: the overload bench's 5x (``bench/overload.py``: its capacity measured, then 5x that offered
  for OVERLOAD_S), a prompt of PROMPT_TOKENS tokens and one of 2 MB: the controller's ``detect``, ``fence``,
  ``failover``, ``switchover``, ``degraded`` and ``wrong_output`` events meanwhile (``incidents``; target 0).

Per phase ``errors`` counts every answer but a 200 (a 429 included) and every transport error. The last stdout line
is one JSON object. The stack is stopped at the end (``hotweights down``, then its process group), on SIGTERM too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.overload import capacity, engine_max_batch, offered
from bench.request_shapes import MB, UpStack, up_stack
from hotweights.contract import Endpoint, Role
from hotweights.eventkinds import EventField, EventKind
from hotweights.standby.drillfaults import SLOW_SIGNAL, WRONG_SIGNAL
from hotweights.standby.progress import FREEZE_SIGNAL

PROMPT = "The quick brown fox"
LOAD_BEFORE_S = 2.0  # load before a fault
LOAD_AFTER_S = 3.0  # and after the controller acted
ACT_TIMEOUT_S = 30.0  # a fault the controller has not acted on by then fails its phase
STALL_SHOWN = 12  # the first answers after a stall printed with their times
OVERLOAD = 5.0  # the overload bench's multiple
OVERLOAD_S = 5.0
PROMPT_TOKENS = 16_000
PHASES = ("false_positives", "stall", "slow", "wrong")  # first the loads that must not switch: a group switches
# over from a slow primary once every health.degraded_every_s at most, so after the slow phase a false one would hide
INCIDENTS = (
    EventKind.DETECT,
    EventKind.FENCE,
    EventKind.FAILOVER,
    EventKind.SWITCHOVER,
    EventKind.DEGRADED,
    EventKind.WRONG_OUTPUT,
)
TARGETS = {"stall_first_ok_ms": 1500, "slow_replaced_ms": 5000, "wrong_fenced_ms": 10000, "errors": 0, "incidents": 0}


@dataclass(frozen=True)
class Answer:
    start: float  # time.time()
    end: float
    outcome: str  # the status, or the transport error's name
    text: str


async def complete(client: httpx.AsyncClient, url: str, max_tokens: int) -> Answer:
    start = time.time()
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    try:
        response = await client.post(url + Endpoint.COMPLETIONS, json=body)
        outcome = str(response.status_code)
        text = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text[:200]
    except httpx.HTTPError as exc:
        outcome, text = type(exc).__name__, str(exc)[:200]
    return Answer(start, time.time(), outcome, text)


async def load(client: httpx.AsyncClient, url: str, args: argparse.Namespace, stop: asyncio.Event) -> list[Answer]:
    """--rps completions a second, open loop, until ``stop``; every answer."""
    tasks = []
    started = time.monotonic()
    while not stop.is_set():
        tasks.append(asyncio.create_task(complete(client, url, args.max_tokens)))
        delay = started + len(tasks) / args.rps - time.monotonic()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
    return list(await asyncio.gather(*tasks))


def primary_pid(stack: UpStack) -> tuple[str, int]:
    member = next(m for m in stack.api.get("/cluster").json()["members"] if m["role"] == Role.PRIMARY and m["pid"])
    return member["id"], member["pid"]


async def first_event(stack: UpStack, kinds: tuple[str, ...], since: float, **fields: object) -> dict | None:
    """The first of the controller's events of ``kinds`` at or after ``since`` whose ``fields`` match; None after
    ACT_TIMEOUT_S."""
    deadline = time.monotonic() + ACT_TIMEOUT_S
    while time.monotonic() < deadline:
        events = [e for kind in kinds for e in stack.events(kind, since)]
        if found := [e for e in events if all(e.get(k) == v for k, v in fields.items())]:
            return min(found, key=lambda e: e["seq"])
        await asyncio.sleep(0.1)
    return None


def after_ms(event: dict | None, fault_at: float) -> float | None:
    return None if event is None else round((datetime.fromisoformat(event["time"]).timestamp() - fault_at) * 1000)


def answers_summary(answers: list[Answer], reference: str) -> dict[str, object]:
    ok = [a for a in answers if a.outcome == "200"]
    return {
        "requests": len(answers),
        "errors": len(answers) - len(ok),
        "outcomes": dict(Counter(a.outcome for a in answers)),
        "wrong_answers": sum(a.text != reference for a in ok),
    }


async def fault(stack: UpStack, args: argparse.Namespace, reference: str, sig: signal.Signals, kind: str) -> dict:
    """One fault phase (module docstring) under load: the answers, and the controller's events after it."""
    member, pid = primary_pid(stack)
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        running = asyncio.create_task(load(client, stack.gateway_url, args, stop))
        await asyncio.sleep(LOAD_BEFORE_S)
        fault_at = time.time()
        os.kill(pid, sig)
        phase: dict[str, object] = {"primary": member}
        if kind == "stall":
            phase["detected_ms"] = after_ms(
                await first_event(stack, (EventKind.DETECT,), fault_at, member=member), fault_at
            )
        elif kind == "slow":
            event = await first_event(stack, (EventKind.SWITCHOVER, EventKind.FAILOVER), fault_at, old=member)
            phase |= {"replaced_by": event and event["kind"], "replaced_ms": after_ms(event, fault_at)}
            phase["reason"] = next((e.get(EventField.REASON) for e in stack.events(EventKind.DEGRADED, fault_at)), None)
        else:
            detected = await first_event(stack, (EventKind.WRONG_OUTPUT,), fault_at, member=member)
            fenced = await first_event(stack, (EventKind.FENCE,), fault_at, member=member)
            phase |= {"detected_ms": after_ms(detected, fault_at), "fenced_ms": after_ms(fenced, fault_at)}
        await asyncio.sleep(LOAD_AFTER_S)
        stop.set()
        answers = await running
    for event in stack.api.get(Endpoint.EVENTS, params={"limit": 1000}).json()["events"]:
        if datetime.fromisoformat(event["time"]).timestamp() >= fault_at:
            print(f"  {event['time']} {event['kind']}: {event['message']}", file=sys.stderr)
    if kind == "slow":
        with contextlib.suppress(ProcessLookupError):  # the old primary, a standby now, gets its speed back
            os.kill(pid, SLOW_SIGNAL)
    if kind == "stall":
        after = sorted((a for a in answers if a.start >= fault_at and a.outcome == "200"), key=lambda a: a.end)
        phase["first_ok_ms"] = round((after[0].end - fault_at) * 1000) if after else None
        ms = [(round((a.start - fault_at) * 1000), round((a.end - fault_at) * 1000)) for a in after[:STALL_SHOWN]]
        print(f"  the first answers sent after the stall (sent, answered; ms after it): {ms}", file=sys.stderr)
    return phase | answers_summary(answers, reference)


async def false_positives(stack: UpStack, args: argparse.Namespace) -> dict[str, object]:
    """The overload bench's 5x, a PROMPT_TOKENS-token prompt and a 2 MB one; the incidents meanwhile."""
    since = time.time()
    url = stack.gateway_url
    overload = argparse.Namespace(seconds=OVERLOAD_S, max_tokens=args.max_tokens)
    rate = await capacity(url, overload, engine_max_batch(stack.primary_url()))
    results = await offered(url, OVERLOAD * rate, overload)
    async with httpx.AsyncClient(timeout=120) as client:
        long_ids = [1 + i % 9 for i in range(PROMPT_TOKENS)]
        long = await client.post(url + Endpoint.COMPLETIONS, json={"prompt": long_ids, "max_tokens": 4})
        large = await client.post(url + Endpoint.COMPLETIONS, json={"prompt": "word " * (2 * MB // 5), "max_tokens": 4})
    incidents = [e for kind in INCIDENTS for e in stack.events(kind, since)]
    for event in incidents:
        print(f"  {event['time']} {event['kind']}: {event['message']}", file=sys.stderr)
    return {
        "capacity_rps": round(rate, 1),
        "overload_outcomes": dict(Counter(str(answer.status) for answer in results)),
        "long_prompt_status": long.status_code,
        "large_prompt_status": large.status_code,
        "incidents": len(incidents),
        "incident_kinds": sorted({e["kind"] for e in incidents}),
    }


async def measure(stack: UpStack, args: argparse.Namespace) -> dict[str, object]:
    async with httpx.AsyncClient(timeout=60) as client:
        reference = (await complete(client, stack.gateway_url, args.max_tokens)).text
    result: dict[str, object] = {}
    if "false_positives" in args.phases:
        result["false_positives"] = await false_positives(stack, args)
        print(f"false positives: {result['false_positives']}", file=sys.stderr)
    for kind, sig in (("stall", FREEZE_SIGNAL), ("slow", SLOW_SIGNAL), ("wrong", WRONG_SIGNAL)):
        if kind in args.phases:
            await asyncio.to_thread(stack.wait_whole)
            result[kind] = await fault(stack, args, reference, sig, kind)
            print(f"{kind}: {result[kind]}", file=sys.stderr)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--device", default="cpu", help="the group's device (default cpu)")
    parser.add_argument("--rps", type=float, default=10.0, help="completions a second during the faults (default 10)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens a completion (default 16)")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"which phases (default {','.join(PHASES)})")
    parser.add_argument("--keep-logs", metavar="DIR", help="copy the stack's logs here at the end")
    args = parser.parse_args()
    args.phases = args.phases.split(",")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop the stack
    result: dict[str, object] = {"device": args.device, "model": args.model or "tiny", "rps": args.rps}
    with up_stack(args.model, args.device, Path(args.keep_logs) if args.keep_logs else None) as stack:
        stack.wait_whole()
        result |= asyncio.run(measure(stack, args))
    result["targets"] = TARGETS
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
