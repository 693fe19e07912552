"""Slow clients against the gateway: do the steady clients still get served, and does the group stay put?

    python bench/slowloris.py                       # 20000 slow connections to the gateway, tiny model on CPU
    python bench/slowloris.py --target primary      # to the primary engine's own port instead

Starts its own stack (``hotweights up``: controller, daemon, three engines, the gateway; torn down at the
end, on SIGINT/SIGTERM too). Steady clients send ``--rps`` short greedy completions a second through the
gateway, each on a new connection (as a client that just arrived would). First ``--quiet-s`` seconds with
nothing else, then ``--attack-s`` seconds while attacker processes hold ``--connections`` connections to the
gateway (``--target primary``: to the primary engine's port, where the controller's health checks go too)
that send the start of a request and never finish its headers (each one the server closes is opened
again). Reports the steady clients' latency (p50, p99) and errors in both phases, how many slow connections
were open at most, and what the controller did meanwhile (failovers, respawns). The attackers run on the
same machine, so on a small one their own CPU shows in the latency too. The last stdout line is one JSON
object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hotweights.chaos.clusterview import ControlApi
from hotweights.chaos.stack import DrillStack, run_interruptible
from hotweights.contract import Endpoint
from hotweights.eventkinds import EventKind
from hotweights.stats import ms, percentile

PER_ATTACKER = 8000  # connections one attacker process holds (its open-files limit must allow them)
START_TIMEOUT_S = 300.0
PARTIAL = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
# Controller events that would mean the attack hurt.
WATCHED = (EventKind.FAILOVER, EventKind.PROMOTE, EventKind.RESPAWN, EventKind.FENCE)


async def hold(host: str, port: int, count: int, seconds: float) -> None:
    """Attacker: keep ``count`` connections open for ``seconds``, each with an unfinished request; print how
    many were open at most as the last line."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    deadline = time.monotonic() + seconds
    open_now, most = 0, 0
    opening = asyncio.Semaphore(256)

    async def one() -> None:
        nonlocal open_now, most
        while time.monotonic() < deadline:
            try:
                async with opening:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
                writer.write(PARTIAL)
            except (OSError, TimeoutError):
                await asyncio.sleep(0.2)
                continue
            open_now += 1
            most = max(most, open_now)
            try:
                await asyncio.wait_for(reader.read(1), max(deadline - time.monotonic(), 0.01))  # b"": closed
            except (OSError, TimeoutError):
                pass
            finally:
                open_now -= 1
                writer.close()

    await asyncio.gather(*(one() for _ in range(count)))
    print(most, flush=True)


async def steady(url: str, rps: float, seconds: float) -> tuple[list[float], list[str]]:
    """``rps`` completions a second for ``seconds``, each on a new connection: latencies (s) and errors."""
    latencies: list[float] = []
    errors: list[str] = []
    limits = httpx.Limits(max_keepalive_connections=0)

    async def one(client: httpx.AsyncClient) -> None:
        start = time.monotonic()
        try:
            body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
            response = await client.post(url + Endpoint.COMPLETIONS, json=body)
            if response.status_code == 200:
                latencies.append(time.monotonic() - start)
            else:
                errors.append(f"{response.status_code} {response.text[:120]}")
        except httpx.HTTPError as exc:
            errors.append(f"{type(exc).__name__} {exc}"[:160])

    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        tasks, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(one(client)))
            await asyncio.sleep(1 / rps)
        await asyncio.gather(*tasks)
    return latencies, errors


async def primary_url(api: ControlApi) -> str:
    view = await api.cluster()
    if view is None or not view.primaries():
        raise RuntimeError("the controller names no primary")
    return view.primaries()[0]["url"]


def figures(latencies: list[float], errors: list[str]) -> dict[str, Any]:
    """One phase's requests, errors, p50 and p99 latency (ms; left out when none succeeded) and first errors."""
    quantiles = {"p50_ms": ms(percentile(latencies, 50)), "p99_ms": ms(percentile(latencies, 99))} if latencies else {}
    return {"requests": len(latencies) + len(errors), "errors": len(errors), **quantiles, "first_errors": errors[:3]}


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    stack = DrillStack.create(workdir / "stack", "gateway", proxied=False)
    api = stack.control_api()
    attackers: list[subprocess.Popen] = []
    try:
        stack.start()
        if missing := await api.wait_complete(START_TIMEOUT_S):
            raise RuntimeError(f"the stack did not start within {START_TIMEOUT_S:g} s: {missing}")
        url = stack.lb_url
        quiet = await steady(url, args.rps, args.quiet_s)
        since = time.time()
        target = httpx.URL(url if args.target == "gateway" else await primary_url(api))
        host, port = target.host, target.port
        left = args.connections
        while left > 0:
            count, left = min(left, PER_ATTACKER), left - PER_ATTACKER
            command = [sys.executable, __file__, "--attack", f"{host}:{port}", "--connections", str(count)]
            command += ["--attack-s", str(args.attack_s + 5)]
            attackers.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True))
        await asyncio.sleep(args.ramp_s)  # the slow connections open
        attacked = await steady(url, args.rps, args.attack_s)
        most = sum(int((a.communicate(timeout=60)[0].split() or ["0"])[-1]) for a in attackers)
        events = [e for e in await api.events(since) if e.get("kind") in WATCHED]
    finally:
        for attacker in attackers:
            attacker.kill()
            attacker.wait()
        await api.aclose()
        await asyncio.to_thread(stack.teardown)
    before, during = figures(*quiet), figures(*attacked)
    ratio = (
        {"p99_ratio": round(during["p99_ms"] / before["p99_ms"], 2)}
        if "p99_ms" in during and "p99_ms" in before
        else {}
    )
    return {
        "target": args.target,
        "connections": args.connections,
        "slow_connections_open_max": most,
        "quiet": before,
        "attack": during,
        **ratio,
        "controller_events": [f"{e['kind']}: {e.get('message', '')[:120]}" for e in events],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=20000, help="slow connections held (default 20000)")
    parser.add_argument(
        "--target", choices=("gateway", "primary"), default="gateway", help="where the slow connections go"
    )
    parser.add_argument("--rps", type=float, default=10.0, help="steady completions a second (default 10)")
    parser.add_argument("--quiet-s", type=float, default=10.0, help="seconds measured with no attack (default 10)")
    parser.add_argument("--attack-s", type=float, default=20.0, help="seconds measured under attack (default 20)")
    parser.add_argument("--ramp-s", type=float, default=5.0, help="seconds the slow connections get to open")
    parser.add_argument("--attack", metavar="HOST:PORT", help=argparse.SUPPRESS)  # an attacker process
    args = parser.parse_args()
    if args.connections < 1 or args.rps <= 0:
        parser.error("--connections and --rps must be positive")
    if args.attack:
        host, port = args.attack.rsplit(":", 1)
        asyncio.run(hold(host, int(port), args.connections, args.attack_s))
        return 0
    with tempfile.TemporaryDirectory(prefix="hw-slowloris-") as workdir:
        result = run_interruptible(run(args, Path(workdir)))
    if result is None:
        print("interrupted; the stack was torn down", file=sys.stderr)
        return 130
    print(json.dumps(result))
    return 0 if result["attack"]["errors"] == 0 and not result["controller_events"] else 1


if __name__ == "__main__":
    sys.exit(main())
