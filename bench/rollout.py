"""A rolling restart, then a model update, of a 3-engine group under steady load through the gateway.

    python bench/rollout.py [--rps 10] [--model DIR] [--new-model DIR] [--device cpu|cuda:N]

Runs the drill's own stack (``hotweights.chaos.stack``: controller, daemon, one primary and two standbys, a
co-located batch engine, the gateway; torn down at the end) on ``--model`` (default: the embedded tiny model), sends
``--rps`` greedy completions a second through the gateway, and runs, one after the other, ``hotweights rollout``
(every engine restarted on the same weights) and ``hotweights rollout --model NEW`` (NEW: ``--new-model``, default
the same preset with another seed, written here). Every answer must be the old weights' greedy text or, once the
update's switchover made a new-generation engine the primary, the new weights'; ``answer_switches`` counts how often
consecutive answers (by the time they ended) changed text: 1 is right, more means old answers came back (0 is
right only where the two models' greedy texts are equal: ``texts_differ`` says whether they are; both texts go to
stderr).

The last stdout line is one JSON object: ``client_errors`` (failed or wrong answers over both), ``rollout_s`` and
``update_s`` (each command's wall time), ``engines_restarted`` (engines whose pid changed, over both),
``answer_switches``, ``requests``, ``batch_back_ms`` (the batch engine yields its KV cache before each engine
start: the slowest of its returns after the rolling restart, from the group settling to serving again) and
``batch_update_back_ms`` (the same after the model update, where it restarts to map the new weights).
Targets: 0 client errors, one answer switch (where the texts differ); on the H200, ``batch_back_ms``
<= 1000.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hotweights.chaos.clusterview import ControlApi
from hotweights.chaos.drill import wait_up
from hotweights.chaos.load import MAX_TOKENS, PROMPT, LoadGenerator, reference_completion
from hotweights.chaos.stack import DrillStack
from hotweights.eventkinds import EventField, EventKind
from hotweights.spawn import hotweights_command


async def pids(api: ControlApi) -> dict[str, int]:
    view = await api.cluster()
    assert view is not None, "the controller did not answer"
    return {m["id"]: m["pid"] for m in view.members}


async def batch_back(api: ControlApi, since: float) -> float:
    """The slowest return of the batch engine since ``since`` (time.time()), once it serves again; SystemExit if it
    never yielded (it yields before every engine start)."""
    if missing := await api.wait_complete(60.0):  # whole includes the batch engine serving again
        raise SystemExit(f"the cluster was not whole 60 s after the rollout: {missing}")
    returns = [e for e in await api.events(since) if e["kind"] == EventKind.BATCH_RETURN]
    backs = [e[EventField.BACK_MS] for e in returns if e.get(EventField.BACK_MS)]
    if not backs:
        raise SystemExit("the batch engine recorded no return (batch_return with back_ms) during the rollout")
    return max(backs)


def roll(stack: DrillStack, *extra: str) -> float:
    """``hotweights rollout`` through the stack's controller; its wall time in seconds."""
    started = time.monotonic()
    done = subprocess.run(stack.cli("rollout", *extra), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"hotweights rollout {' '.join(extra)} exited with {done.returncode}: {done.stderr.strip()}")
    return time.monotonic() - started


def new_weights(args: argparse.Namespace, workdir: Path) -> Path:
    if args.new_model:
        return Path(args.new_model).resolve()
    out = workdir / "new-model"
    command = hotweights_command("make-model", str(out), "--preset", args.preset, "--seed", "1", "--quiet")
    subprocess.run([*command, "--device", "cuda"] if args.device.startswith("cuda") else command, check=True)
    return out


async def new_text(stack: DrillStack, client: httpx.AsyncClient) -> str:
    """The greedy answer once the update is done: every engine maps the new weights."""
    response = await client.post(
        stack.lb_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    )
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


async def bench(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    stack = DrillStack.create(workdir, "gateway", proxied=False, model=args.model or "", device=args.device, batch=True)
    new_model = new_weights(args, workdir)
    api = stack.control_api()
    try:
        stack.start()
        await wait_up(stack, api)
        async with httpx.AsyncClient(timeout=60) as client:
            reference = await reference_completion(client, stack.lb_url)
            load = LoadGenerator(stack.lb_url, args.rps, reference)
            before = await pids(api)
            async with load.running():
                began = time.time()
                rollout_s = await asyncio.to_thread(roll, stack)
                rolled = await pids(api)
                batch_back_ms = await batch_back(api, began)
                began = time.time()
                update_s = await asyncio.to_thread(roll, stack, "--model", str(new_model))
                after = await pids(api)
                batch_update_back_ms = await batch_back(api, began)
                await asyncio.sleep(1.0)  # answers from the new weights, to see that they stay
            accepted = (reference, await new_text(stack, client))
            print(f"old weights' text {accepted[0]!r}\nnew weights' text {accepted[1]!r}", file=sys.stderr)
    finally:
        await api.aclose()
        await asyncio.to_thread(stack.teardown)
    ok = sorted((r for r in load.records if r.status == 200), key=lambda r: r.end)
    failed = [r for r in load.records if r.status != 200 or r.text not in accepted]
    restarted = sum(rolled[m] != before[m] for m in before) + sum(after[m] != rolled[m] for m in rolled)
    return {
        "client_errors": len(failed),
        "rollout_s": round(rollout_s, 2),
        "update_s": round(update_s, 2),
        "engines_restarted": restarted,
        "answer_switches": sum(a.text != b.text for a, b in itertools.pairwise(ok)),
        "texts_differ": accepted[0] != accepted[1],
        "requests": len(load.records),
        "batch_back_ms": batch_back_ms,
        "batch_update_back_ms": batch_update_back_ms,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rps", type=float, default=10.0, help="completions a second through the gateway (default 10)")
    p.add_argument("--model", help="the group's checkpoint (default: the embedded tiny model)")
    p.add_argument("--new-model", help="the update's checkpoint (default: --preset with seed 1, written here)")
    p.add_argument("--preset", default="tiny", help="without --new-model: the new model's preset (default tiny)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hwroll-", dir="/tmp") as workdir:
        result = asyncio.run(bench(args, Path(workdir)))
    print(json.dumps(result))
    return 0 if result["client_errors"] == 0 and result["answer_switches"] == int(result["texts_differ"]) else 1


if __name__ == "__main__":
    sys.exit(main())
