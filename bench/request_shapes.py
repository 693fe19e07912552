"""Request shapes: what one client's large or many-prompt requests cost everyone else, through the gateway.

    python bench/request_shapes.py [--model DIR] [--scale 1] [--requests 3] [--clients 2] [--max-tokens 16]
                                   [--quiet-seconds 5] [--shapes chat,completion,token_ids,prompts,batch]

Starts ``hotweights up`` with its defaults (the embedded tiny model unless --model, on CPU: a primary, two
standbys, a spare, the gateway), on free ports, in a directory of its own, and waits until the stack is whole.
Meanwhile throughout, --clients clients send ordinary completions (--max-tokens) through the gateway in a closed
loop, and the primary's ``GET /primary`` is timed every ``PROBE_S`` (what the controller's health checks ask).
First quiet, for --quiet-seconds; then, for each shape, --requests of its requests through the gateway one
after the other (their bodies encoded beforehand, so the bench's own loop stays free):

- ``chat``: a chat completion whose system message is 2 MB of text (--scale times that);
- ``completion``: a completion whose prompt is 2 MB of text;
- ``token_ids``: a completion whose prompt is 1M token ids;
- ``prompts``: a completion of 2,000 prompts;
- ``batch``: a completion of as many prompts as the primary generates at once (its ``max_batch``), served.

Per shape: how its requests were answered (status -> count, and the first refusal's message), their mean time,
the health checks' p99 and max, the other clients' p99 and its ratio to the quiet p99, how many of theirs were
refused (429: a request of several prompts takes a slot for each, so while ``batch`` waits for its slots the
others wait behind it, refused once their expected start passes the queue budget) and any other error. Over the
run: the controller's ``failover`` and ``fence`` events (none is planned here, so each is one the requests caused),
and the sentence of each, and of each ``detect`` (``incidents``). Targets: health p99 <= 50 ms, the clients' p99 <= 2x
quiet, no failover, no client error.

The last stdout line is one JSON object. The stack is stopped at the end (``hotweights down``, then its process
group), on SIGINT/SIGTERM too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.overload import engine_max_batch
from hotweights.chaos.clusterview import ClusterView
from hotweights.chaos.stack import copy_logs
from hotweights.contract import Endpoint
from hotweights.eventkinds import EventKind
from hotweights.ports import free_ports
from hotweights.spawn import hotweights_command
from hotweights.stats import percentile

PROMPT = "The quick brown fox jumps over the lazy dog"
PROBE_S = 0.02  # between two health checks of the primary
MB = 1 << 20
HEALTH_P99_MS_TARGET = 50.0
CLIENTS_P99_RATIO_TARGET = 2.0
SHAPES = ("chat", "completion", "token_ids", "prompts", "batch")
# The controller's events that none of these requests may cause.
INCIDENTS = (EventKind.DETECT, EventKind.FENCE, EventKind.FAILOVER)


def shape_body(shape: str, scale: float, max_tokens: int, max_batch: int) -> tuple[str, dict]:
    """(path, body) of one request of ``shape`` (module docstring) at ``scale``; ``max_batch``: the primary's."""
    text = "word " * round(2 * MB * scale / 5)
    if shape == "chat":
        return Endpoint.CHAT_COMPLETIONS, {"messages": [{"role": "system", "content": text}], "max_tokens": max_tokens}
    prompts = {
        "completion": text,
        "token_ids": [1 + i % 9 for i in range(round(1_000_000 * scale))],  # one digit each: 2 bytes an id
        "prompts": [PROMPT] * round(2000 * scale),
        "batch": [PROMPT] * max_batch,
    }
    return Endpoint.COMPLETIONS, {"prompt": prompts[shape], "max_tokens": max_tokens}


class UpStack:
    """``hotweights up`` with its defaults (its group on ``device``), on free ports in a temp dir; ``close`` stops it
    all."""

    def __init__(self, model: str | None, device: str = "cpu") -> None:
        self.root = Path(tempfile.mkdtemp(prefix="hwrs-", dir="/tmp"))
        base_port = free_ports(5, consecutive=True)[0]  # three engines, the controller, the gateway
        controller_port, self.gateway_port = base_port + 3, base_port + 4
        model_section = f'[model]\npath = "{Path(model).resolve()}"\n\n' if model else ""
        self.config = self.root / "cluster.toml"
        self.config.write_text(
            f'[cluster]\nport = {controller_port}\nstate_dir = "{self.root / "state"}"\n\n{model_section}'
            f'[[groups]]\ndevice = "{device}"\nbase_port = {base_port}\n\n[gateway]\nport = {self.gateway_port}\n'
        )
        self.env = {**os.environ, "HOTWEIGHTS_RUNTIME_DIR": str(self.root / "run")}
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{controller_port}", timeout=5.0)
        with open(self.root / "up.log", "ab") as log:
            command = hotweights_command("up", "--config", str(self.config))
            self.up = subprocess.Popen(command, stdout=log, stderr=log, env=self.env, start_new_session=True)

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def wait_whole(self, timeout: float = 600.0) -> str:
        """The primary's URL once every engine, spare and service is ready."""
        deadline = time.monotonic() + timeout
        missing: str | None = "no answer"
        while time.monotonic() < deadline:
            if self.up.poll() is not None:
                raise SystemExit(f"hotweights up exited with {self.up.returncode}: see {self.root / 'up.log'}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                body = self.api.get("/cluster").json()
                view = ClusterView(*(body[k] for k in ("members", "services", "spares", "batch", "daemon_spares")))
                if (missing := view.incomplete()) is None:
                    return self.primary_url()
            time.sleep(0.2)
        raise SystemExit(f"the stack was not whole within {timeout:g} s ({missing}): see {self.root}")

    def primary_url(self) -> str:
        """The URL of group 0's primary, as the controller knows it now."""
        return self.api.get("/primary").json()["groups"]["0"]["url"]

    def events(self, kind: str, since: float) -> list[dict]:
        """The controller's events of ``kind`` at or after ``since`` (time.time())."""
        events = self.api.get(Endpoint.EVENTS, params={"kind": kind, "limit": 1000}).json()["events"]
        return [e for e in events if datetime.fromisoformat(e["time"]).timestamp() >= since]

    def close(self, keep_logs: Path | None = None) -> None:
        """Stop it all; its logs (``up``'s, the controller's, every engine's, daemon's and gateway's) are first
        copied into ``keep_logs`` where given."""
        down = hotweights_command("down", "--config", str(self.config), "--timeout", "10")
        subprocess.run(down, capture_output=True, env=self.env, check=False, timeout=120)
        if self.up.poll() is None:
            os.killpg(self.up.pid, signal.SIGKILL)
            self.up.wait(timeout=10)
        self.api.close()
        if keep_logs is not None:
            copy_logs(keep_logs, self.root, self.root / "state")
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def up_stack(model: str | None, device: str = "cpu", keep_logs: Path | None = None) -> Iterator[UpStack]:
    stack = UpStack(model, device)
    try:
        yield stack
    finally:
        stack.close(keep_logs)


@dataclass
class Samples:
    """What the probe and the clients measured: (start, seconds, outcome) each."""

    health: list[tuple[float, float, str]] = field(default_factory=list)
    clients: list[tuple[float, float, str]] = field(default_factory=list)

    def window(self, start: float, end: float) -> dict[str, object]:
        """The figures of what started within [start, end)."""
        health = [s for t, s, _ in self.health if start <= t < end]
        failed = [o for t, _, o in self.health if start <= t < end and o != "200"]
        served = [s for t, s, o in self.clients if start <= t < end and o == "200"]
        refused = [o for t, _, o in self.clients if start <= t < end and o == "429"]
        errors = [o for t, _, o in self.clients if start <= t < end and o not in ("200", "429")]
        figures: dict[str, object] = {"health_checks": len(health), "health_failed": len(failed)}
        if health:
            figures |= {"health_p99_ms": ms(health, 99), "health_max_ms": ms(health, 100)}
        if served:
            figures |= {
                "clients_served": len(served),
                "clients_p50_ms": ms(served, 50),
                "clients_p99_ms": ms(served, 99),
            }
        return (
            figures
            | {"clients_refused": len(refused), "client_errors": len(errors)}
            | ({"client_error_kinds": sorted(set(errors))} if errors else {})
        )


def ms(seconds: list[float], q: float) -> float:
    return round(percentile(seconds, q) * 1000, 1)


async def timed(client: httpx.AsyncClient, method: str, url: str, **kwargs: object) -> tuple[float, str, str]:
    """(seconds, status or the transport error's name, body's first characters)."""
    started = time.perf_counter()
    try:
        response = await client.request(method, url, **kwargs)
        outcome, text = str(response.status_code), response.text[:300]
    except httpx.HTTPError as exc:
        outcome, text = type(exc).__name__, str(exc)[:300]
    return time.perf_counter() - started, outcome, text


async def probe(url: str, samples: Samples, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        while not stop.is_set():
            started = time.monotonic()
            seconds, outcome, _ = await timed(client, "GET", url + Endpoint.PRIMARY)
            samples.health.append((started, seconds, outcome))
            await asyncio.sleep(max(0.0, PROBE_S - (time.monotonic() - started)))


async def client_loop(url: str, max_tokens: int, samples: Samples, stop: asyncio.Event) -> None:
    body = {"prompt": PROMPT, "max_tokens": max_tokens}
    async with httpx.AsyncClient(timeout=120.0) as client:
        while not stop.is_set():
            started = time.monotonic()
            seconds, outcome, _ = await timed(client, "POST", url + Endpoint.COMPLETIONS, json=body)
            samples.clients.append((started, seconds, outcome))
            if outcome != "200":
                await asyncio.sleep(0.05)  # a refusal's Retry-After is the client's to honour; no tight loop


async def send_shape(url: str, path: str, body: bytes, requests: int) -> dict[str, object]:
    """--requests requests of one shape, one after the other: their answers and mean time."""
    answers: dict[str, int] = {}
    refusal, total = "", 0.0
    async with httpx.AsyncClient(timeout=600.0) as client:
        for _ in range(requests):
            seconds, outcome, text = await timed(
                client, "POST", url + path, content=body, headers={"content-type": "application/json"}
            )
            answers[outcome] = answers.get(outcome, 0) + 1
            total += seconds
            if outcome != "200" and not refusal:
                refusal = text
    return {"answers": answers, "mean_s": round(total / requests, 2)} | ({"refusal": refusal} if refusal else {})


async def measure(stack: UpStack, primary: str, args: argparse.Namespace) -> dict[str, object]:
    samples, stop = Samples(), asyncio.Event()
    bodies = {s: shape_body(s, args.scale, 1, engine_max_batch(primary)) for s in args.shapes}
    encoded = {s: (path, json.dumps(body).encode()) for s, (path, body) in bodies.items()}
    workers = [asyncio.create_task(probe(primary, samples, stop))]
    workers += [
        asyncio.create_task(client_loop(stack.gateway_url, args.max_tokens, samples, stop)) for _ in range(args.clients)
    ]
    try:
        await asyncio.sleep(1.0)  # warm-up: connections opened, the first requests served
        start = time.monotonic()
        await asyncio.sleep(args.quiet_seconds)
        quiet = samples.window(start, time.monotonic())
        print(f"quiet: {quiet}", file=sys.stderr)
        shapes: dict[str, dict[str, object]] = {}
        for shape, (path, body) in encoded.items():
            start = time.monotonic()
            sent = await send_shape(stack.gateway_url, path, body, args.requests)
            await asyncio.sleep(0.5)  # what the clients started while the last one was answered
            shapes[shape] = {"body_bytes": len(body)} | sent | samples.window(start, time.monotonic())
            if "clients_p99_ms" in shapes[shape] and "clients_p99_ms" in quiet:
                ratio = float(shapes[shape]["clients_p99_ms"]) / float(quiet["clients_p99_ms"])  # type: ignore[arg-type]
                shapes[shape]["clients_p99_over_quiet"] = round(ratio, 2)
            print(f"{shape}: {shapes[shape]}", file=sys.stderr)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    return {"quiet": quiet, "shapes": shapes}


def summary(result: dict, incidents: list[dict]) -> dict[str, object]:
    """The run's figures against the targets; ``incidents``: the controller's detect, fence and failover events."""
    shapes = result["shapes"].values()
    return {
        "health_p99_ms_max": max((s.get("health_p99_ms", 0.0) for s in shapes), default=0.0),
        "health_max_ms": max((s.get("health_max_ms", 0.0) for s in shapes), default=0.0),
        "clients_p99_over_quiet_max": max((s.get("clients_p99_over_quiet", 0.0) for s in shapes), default=0.0),
        "client_errors": sum(s["client_errors"] for s in shapes) + result["quiet"]["client_errors"],
        "failovers": sum(e["kind"] == EventKind.FAILOVER for e in incidents),
        "fences": sum(e["kind"] == EventKind.FENCE for e in incidents),
        "incidents": [f"{e['time']} {e['kind']}: {e['message'][:300]}" for e in incidents],
        "targets": {
            "health_p99_ms": HEALTH_P99_MS_TARGET,
            "clients_p99_over_quiet": CLIENTS_P99_RATIO_TARGET,
            "failovers": 0,
            "client_errors": 0,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--scale", type=float, default=1.0, help="times each shape's size (default 1)")
    parser.add_argument("--requests", type=int, default=3, help="requests of each shape (default 3)")
    parser.add_argument("--clients", type=int, default=2, help="ordinary clients meanwhile (default 2)")
    parser.add_argument("--max-tokens", type=int, default=16, help="the ordinary clients' (default 16)")
    parser.add_argument("--quiet-seconds", type=float, default=5.0, help="the quiet measurement's (default 5)")
    parser.add_argument(
        "--shapes", type=lambda text: text.split(","), default=list(SHAPES), help=f"default {','.join(SHAPES)}"
    )
    args = parser.parse_args()
    if unknown := set(args.shapes) - set(SHAPES):
        parser.error(f"--shapes: unknown {sorted(unknown)}; expected some of {', '.join(SHAPES)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop what was started
    with up_stack(args.model) as stack:
        primary = stack.wait_whole()
        began = time.time()
        result = asyncio.run(measure(stack, primary, args))
        incidents = sorted((e for k in INCIDENTS for e in stack.events(k, began)), key=lambda e: e["seq"])
    settings = {"cpu_cores": os.cpu_count(), "scale": args.scale, "requests": args.requests, "clients": args.clients}
    print(json.dumps(settings | {"max_tokens": args.max_tokens} | result | summary(result, incidents)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
