"""Overload: what an engine behind the gateway answers when offered more than it can serve.

    python bench/overload.py [--device cpu|cuda:N] [--model DIR] [--max-batch 4] [--queue-budget 10]
                             [--gateway-max-in-flight 0] [--gateway-workers 2] [--max-tokens 32] [--seconds 5]
                             [--loads 1,2,5]

Starts one ``hotweights engine`` (primary; the embedded tiny model unless --model) and ``hotweights gateway``
workers in front of it (--gateway-workers of them, default ``gateway.workers``'s, on one listening socket as
``hotweights up`` runs them), all with the admission defaults of a cluster whose ``engine.max_batch`` and
``engine.queue_budget_s`` are --max-batch and --queue-budget (and ``gateway.max_in_flight``
--gateway-max-in-flight), on CPU with the threads ``hotweights up`` gives each engine of such a cluster's default
group (the host's cores shared among its engines and spare), then measures through the gateway:

Every request goes on a connection of its own through ``post``, a load generator of ~0.4 ms of CPU per request,
so that on a small machine the cores serve the stack measured rather than the client.

- quiet: one request at a time (--quiet-requests): p50/p99 latency;
- capacity: --max-batch clients in a closed loop for --seconds: completions per second;
- for each multiple of that capacity in --loads: requests sent open-loop (evenly spaced) for --seconds, each
  load once the one before has been answered: the admitted ones' (200) p50/p99, their p99 over the quiet p99 and
  over the queue budget plus the engine's mean service at that load (``admitted_p99_over_bound``, target <= 1: what
  is admitted starts within the budget), the refused ones' (429 or 503) count, of them the 503s (``refused_503``:
  the gateway knew no primary, its probe or a connection to the engine timed out), their answer time p50/p99/max
  (target <= 50 ms), and of them those the engine answered itself, relayed (``refused_by_engine``: the gateway
  answers the rest at once while an engine is full, ``gateway.discovery``) and their answer time p50/max,
  ``connect_*_ms``, how long every request's connection took to open (the gateway's listening queue, before any
  worker's event loop sees it), ``goodput`` (the admitted completed per second, from the first request sent to the
  last one admitted answered, over the capacity; target >= 0.9), and every other answer or transport error
  (``errors``, must be 0);
  ``engine_mean_ms``, from the engine's own metrics over that load, where an admitted request's time went:
  ``queue_wait`` (of the ``queued`` ones), ``first_token`` and ``service`` (from its start, once tokenized, to its
  last token); the rest of the client's time is HTTP, the gateway and tokenization;
  ``gateway_cpu``: the busiest gateway worker's CPU over the load's wall time (``busiest_share``: near 1.0 its event
  loop, refusals included, runs behind) and the workers' CPU ms per request sent (``ms_per_request``);
  ``gateway_refusal_mean_ms``: from the workers' own metrics, the mean time from a refused request reaching a
  worker's handler to its answer, by who refused it (``gateway``; ``unaccepted``: the gateway, once the engine did not
  accept a connection in time; ``unavailable``: no primary known within the hold; ``engine``): what of a refusal's
  time the gateway's handling, its wait for a connection and the engine's answer take, the rest being the client's
  connection and the load generator;
  ``gateway_wait_mean_ms``: from the same, the mean time every request of the load waited in a worker before its
  handler (from its connection's set-up, ``hotweights.httpguard.RECEIVED``): the worker's event loop;
  ``engine_live_ms``: how long the engine took to answer ``GET /health/live`` (on one kept connection, every
  PING_S, from a thread of this bench's) during the load, p50/max: how late its event loop runs;
  ``gateway_live_ms``: the same of every gateway worker's ``GET /gateway/health`` on its own Unix socket (its event
  loop's lateness, apart from its TCP listener's queue);
  ``load_lag_ms``: how late this bench's own event loop woke from a PING_S sleep, p50/max: what the load generator
  itself adds to every answer's time.

The last stdout line is one JSON object. Both processes are stopped at the end, on SIGINT/SIGTERM too.
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
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import h11
import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hotweights.admission import ServingLimits
from hotweights.contract import GATEWAY_BACKLOG, UPSTREAM_HEADER, Endpoint
from hotweights.controller.config import GatewaySection, load_config
from hotweights.controller.stack import cpu_threads
from hotweights.ports import free_port
from hotweights.proctree import cpu_seconds
from hotweights.spawn import hotweights_command
from hotweights.standby.serving import bind_port
from hotweights.stats import percentile

LIMITS = ServingLimits()  # the engine's defaults, those of --max-batch and --queue-budget

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox jumps over the lazy dog"
ADMITTED_P99_BOUND_TARGET = 1.0  # admitted p99 over the queue budget plus the engine's mean service
REFUSED_MS_TARGET = 50.0
GOODPUT_TARGET = 0.9
REFUSED = (429, 503)


@dataclass(frozen=True)
class Worker:
    """A gateway worker: its pid, and the Unix socket it also serves on (its own ``/metrics``)."""

    pid: int
    probe: str


@dataclass(frozen=True)
class Answer:
    """One request of a load: its status (or its error's name), its seconds, when it was answered (seconds after the
    load's first was sent), whether an engine answered it (``post``) and how long its connection took to open."""

    status: int | str
    seconds: float
    answered: float
    relayed: bool
    connect: float | None  # seconds until its connection was open (the listener's queue, the handshake); None: failed


TIMEOUT_S = 120.0  # a request's whole exchange
PING_S = 0.05  # how often ``pinged`` asks the engine
REFUSAL_HISTOGRAM = "hotweights_gateway_refusal_seconds"  # a gateway worker's own time to refuse (``refusal_times``)
WAIT_HISTOGRAM = "hotweights_gateway_wait_seconds"  # a request's wait in a worker before its handler (the same)
WAIT = "wait"  # ``refusal_times``'s key for WAIT_HISTOGRAM
ENGINE_TIMES = {  # engine_mean_ms's keys -> the engine's histograms
    "queue_wait": "hotweights_engine_queue_wait_seconds",
    "first_token": "hotweights_engine_time_to_first_token_seconds",
    "service": "hotweights_engine_request_duration_seconds",
}


def start(command: list[str], log: Path, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=out, pass_fds=pass_fds)


def wait_serving(
    url: str, process: subprocess.Popen, log: Path, timeout_s: float = 300.0, uds: str | None = None
) -> None:
    """Until ``url`` answers 200 (an engine's /primary, the gateway's health once it knows a primary); ``uds``:
    asked over that Unix socket (a gateway worker's own)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5, transport=httpx.HTTPTransport(uds=uds) if uds else None) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"{process.args[3:5]} exited with {process.returncode}:\n{log.read_text()}")
            try:
                response = client.get(url)
                if response.status_code == 200 and response.json().get("primaries", True):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise SystemExit(f"{url} not serving after {timeout_s} s:\n{log.read_text()}")


@contextmanager
def stack(args: argparse.Namespace, workdir: Path) -> Iterator[tuple[str, str, list[Worker]]]:
    """An engine and a gateway in front of it (--gateway-workers processes on one listening socket, as ``hotweights
    up`` starts them); yields the gateway's URL, the engine's and the workers, and stops them all however it ends."""
    engine_port, gateway_port = free_port(), free_port()
    config = workdir / "cluster.toml"
    config.write_text(
        f'[cluster]\nstate_dir = "{workdir / "state"}"\n\n'
        f"[engine]\nmax_batch = {args.max_batch}\nqueue_budget_s = {args.queue_budget}\n\n"
        f"[gateway]\nport = {gateway_port}\nmax_in_flight = {args.gateway_max_in_flight}\n"
    )
    engine = hotweights_command("engine", "--port", str(engine_port), "--device", args.device)
    engine += ["--max-batch", str(args.max_batch), "--queue-budget", str(args.queue_budget)]
    if args.device == "cpu":  # the threads ``hotweights up`` gives each CPU engine of a default group
        engine += ["--cpu-threads", str(cpu_threads(load_config(config), len(os.sched_getaffinity(0))))]
    engine += ["--model", args.model] if args.model else []
    engine_url = f"http://127.0.0.1:{engine_port}"
    listener = bind_port("127.0.0.1", gateway_port, reuse_port=True)
    listener.listen(GATEWAY_BACKLOG)
    processes = [start(engine, workdir / "engine.log")]
    try:
        wait_serving(engine_url + Endpoint.PRIMARY, processes[0], workdir / "engine.log")
        workers = []
        for worker in range(args.gateway_workers):
            probe, log = str(workdir / f"gateway-{worker}.sock"), workdir / f"gateway-{worker}.log"
            gateway = hotweights_command("gateway", "--config", str(config), "--upstream", engine_url)
            gateway += ["--fd", str(listener.fileno()), "--probe-socket", probe]
            processes.append(start(gateway, log, (listener.fileno(),)))
            wait_serving(f"http://gateway{Endpoint.GATEWAY_HEALTH}", processes[-1], log, 60, uds=probe)
            workers.append(Worker(processes[-1].pid, probe))
        yield f"http://127.0.0.1:{gateway_port}", engine_url, workers
    finally:
        stop(processes)
        listener.close()


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to each, then wait for each (30 s, then SIGKILL)."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def one(url: str, max_tokens: int) -> tuple[int | str, float, bool, float | None]:
    """(status, or the error's name; seconds; whether an engine answered it, not the gateway itself; seconds until its
    connection was open, None where the exchange failed) of one completion through ``url``."""
    started = time.perf_counter()
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens}).encode()
    try:
        async with asyncio.timeout(TIMEOUT_S):
            status, relayed, connect = await post(httpx.URL(url + Endpoint.COMPLETIONS), body)
    except (OSError, TimeoutError, h11.ProtocolError) as exc:
        status, relayed, connect = type(exc).__name__, False, None
    return status, time.perf_counter() - started, relayed, connect


async def post(url: httpx.URL, body: bytes) -> tuple[int, bool, float]:
    """POST ``body`` (JSON) to ``url`` on a connection of its own, read the answer to its end: its status, whether
    the gateway relayed it from an engine (``UPSTREAM_HEADER``) rather than answered it itself, and the seconds its
    connection took to open. The load
    generator's own cost per request, ~0.4 ms of CPU here against httpx's 4-15 ms (its pool's bookkeeping grows with
    the requests in flight), so that the cores serve the stack measured, not the client measuring it."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(url.host, url.port)
    connect_s = time.perf_counter() - started
    try:
        connection = h11.Connection(h11.CLIENT)
        headers = [("host", f"{url.host}:{url.port}"), ("content-type", "application/json")]
        headers += [("content-length", str(len(body))), ("connection", "close")]
        request = h11.Request(method="POST", target=url.raw_path, headers=headers)
        writer.write(
            connection.send(request) + connection.send(h11.Data(data=body)) + connection.send(h11.EndOfMessage())
        )
        status, relayed = 0, False
        while not isinstance(event := connection.next_event(), h11.EndOfMessage):
            if event is h11.NEED_DATA:
                connection.receive_data(await reader.read(1 << 16))
            elif isinstance(event, h11.Response):
                status = event.status_code
                relayed = any(name == UPSTREAM_HEADER.encode() for name, _ in event.headers)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionResetError("closed before the end of the answer")
        return status, relayed, connect_s
    finally:
        writer.close()


async def quiet(url: str, args: argparse.Namespace) -> list[float]:
    results = [await one(url, args.max_tokens) for _ in range(args.quiet_requests)]
    bad = [status for status, *_ in results if status != 200]
    if bad:
        raise SystemExit(f"quiet requests failed: {bad[:5]}")
    return [seconds for _, seconds, *_ in results]


def engine_max_batch(engine_url: str) -> int:
    """The sequences the engine at ``engine_url`` generates at once: its own, where its ``max_batch`` is automatic."""
    return httpx.get(engine_url + Endpoint.PRIMARY, timeout=10).json()["max_batch"]


async def capacity(url: str, args: argparse.Namespace, clients: int) -> float:
    """Completions per second with ``clients`` (the engine's ``max_batch``) in a closed loop."""
    done = 0
    deadline = time.perf_counter() + args.seconds

    async def client_loop() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            status, *_ = await one(url, args.max_tokens)
            done += status == 200

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return done / (time.perf_counter() - started)


async def offered(url: str, rate: float, args: argparse.Namespace) -> list[Answer]:
    """Requests sent open-loop, evenly spaced at ``rate`` per second for --seconds: each one's ``Answer``."""
    tasks = []
    started = time.perf_counter()

    async def timed() -> Answer:
        status, seconds, relayed, connect = await one(url, args.max_tokens)
        return Answer(status, seconds, time.perf_counter() - started, relayed, connect)

    for i in range(max(1, round(rate * args.seconds))):
        delay = started + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(timed()))
    return await asyncio.gather(*tasks)


def ms(seconds: list[float], q: float) -> float:
    return round(percentile(seconds, q) * 1000, 1)


def latencies(kind: str, seconds: list[float], **quantiles: float) -> dict[str, float]:
    """``{kind}_{name}_ms`` for each of ``quantiles`` (name -> percent); none when no request was of that kind: a
    figure nothing measured is left out, never null."""
    return {f"{kind}_{name}_ms": ms(seconds, q) for name, q in quantiles.items()} if seconds else {}


def summarize(results: list[Answer], quiet_p99_s: float, capacity_per_s: float) -> dict[str, object]:
    """One load's figures (``offered``'s ``results``). The admitted and refused latencies only where some request was
    admitted or refused; of the refusals, those an engine answered (relayed by the gateway) on their own."""
    admitted = [a.seconds for a in results if a.status == 200]
    refused = [a.seconds for a in results if a.status in REFUSED]
    by_engine = [a.seconds for a in results if a.status in REFUSED and a.relayed]
    errors = [a.status for a in results if a.status != 200 and a.status not in REFUSED]
    span_s = max((a.answered for a in results if a.status == 200), default=0.0)
    ratio = {"admitted_p99_over_quiet": round(percentile(admitted, 99) / quiet_p99_s, 2)} if admitted else {}
    return {
        "sent": len(results),
        "admitted": len(admitted),
        **latencies("admitted", admitted, p50=50, p99=99),
        **ratio,
        "goodput": round(len(admitted) / span_s / capacity_per_s, 2) if admitted else 0.0,
        "refused": len(refused),
        "refused_503": sum(a.status == 503 for a in results),  # of them, no primary known to the gateway
        **latencies("refused", refused, p50=50, p99=99, max=100),
        "refused_by_engine": len(by_engine),  # of them, an engine's own 429s, relayed
        **latencies("refused_by_engine", by_engine, p50=50, max=100),
        **latencies("connect", [a.connect for a in results if a.connect is not None], p50=50, p99=99, max=100),
        "errors": len(errors),
        "error_kinds": sorted({str(e) for e in errors}),
    }


def histogram_totals(text: str, keyed: Callable[[str, dict[str, str]], str | None]) -> dict[str, tuple[float, float]]:
    """The (sum, count) of the histograms of a Prometheus text exposition, under the key ``keyed(name, labels)`` gives
    each (None: not wanted), summed over the label sets of one key."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, _, part = sample.name.rpartition("_")
            if part in ("sum", "count") and (key := keyed(name, sample.labels)) is not None:
                totals = sums if part == "sum" else counts
                totals[key] = totals.get(key, 0.0) + sample.value
    return {key: (sums.get(key, 0.0), count) for key, count in counts.items()}


async def histograms(engine_url: str) -> dict[str, tuple[float, float]]:
    """ENGINE_TIMES's histograms now: key -> (sum, count)."""
    keys = {name: key for key, name in ENGINE_TIMES.items()}
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(engine_url + Endpoint.METRICS)).text
    return histogram_totals(text, lambda name, _: keys.get(name))


async def refusal_times(workers: list[Worker]) -> dict[str, tuple[float, float]]:
    """The gateway workers' REFUSAL_HISTOGRAM now, summed over the workers: who refused (``gateway.policy.refused_by``)
    -> (sum, count); and WAIT_HISTOGRAM's under WAIT."""

    def keyed(name: str, labels: dict[str, str]) -> str | None:
        return labels.get("by") if name == REFUSAL_HISTOGRAM else WAIT if name == WAIT_HISTOGRAM else None

    totals: dict[str, tuple[float, float]] = {}
    for worker in workers:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=worker.probe), timeout=30) as client:
            text = (await client.get(f"http://gateway{Endpoint.METRICS}")).text
        for key, (total, count) in histogram_totals(text, keyed).items():
            total0, count0 = totals.get(key, (0.0, 0.0))
            totals[key] = (total0 + total, count0 + count)
    return totals


def means_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean ms of each key's observations between two (sum, count) readings, for the keys that counted some."""
    means = {}
    for key, (total, count) in after.items():
        total0, count0 = before.get(key, (0.0, 0.0))
        if count > count0:
            means[key] = round((total - total0) / (count - count0) * 1000, 1)
    return means


def engine_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """Mean ms of each of ENGINE_TIMES between two ``histograms`` (those that counted some request), and how many
    were queued."""
    queued = after.get("queue_wait", (0.0, 0.0))[1] - before.get("queue_wait", (0.0, 0.0))[1]
    return {**means_ms(before, after), "queued": int(queued)}


@contextmanager
def pinged(url: str, uds: str | None = None) -> Iterator[list[float]]:
    """Seconds each ``GET url`` took (over the Unix socket ``uds`` if given), asked every PING_S from a thread of its
    own on one kept connection while the block runs (a request that fails counts as its time until it failed)."""
    times: list[float] = []
    done = threading.Event()

    def ping() -> None:
        with httpx.Client(timeout=TIMEOUT_S, transport=httpx.HTTPTransport(uds=uds) if uds else None) as client:
            while not done.wait(PING_S):
                started = time.perf_counter()
                with suppress(httpx.HTTPError):
                    client.get(url)
                times.append(time.perf_counter() - started)

    thread = threading.Thread(target=ping, daemon=True)
    thread.start()
    try:
        yield times
    finally:
        done.set()
        thread.join()


@asynccontextmanager
async def lagged() -> AsyncIterator[list[float]]:
    """Seconds this process's event loop ran late, sampled every PING_S while the block runs: what of a request's
    time the load generator itself adds."""
    lags: list[float] = []

    async def sample() -> None:
        while True:
            due = time.perf_counter() + PING_S
            await asyncio.sleep(PING_S)
            lags.append(time.perf_counter() - due)

    task = asyncio.create_task(sample())
    try:
        yield lags
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task


def quantiles_ms(seconds: list[float]) -> dict[str, float]:
    """p50 and max in ms; empty when nothing was measured."""
    return {"p50": ms(seconds, 50), "max": ms(seconds, 100)} if seconds else {}


def gateway_cpu(before: list[float | None], after: list[float | None], wall_s: float, sent: int) -> dict[str, float]:
    """The gateway workers' CPU over a load: the busiest one's share of the wall time (1.0: a core's worth, the most
    one event loop has) and the CPU ms all of them spent per request sent; empty when no worker could be read."""
    used = [b - a for a, b in zip(before, after, strict=True) if a is not None and b is not None]
    if not used:  # every worker gone meanwhile: nothing measured, nothing said
        return {}
    return {"busiest_share": round(max(used) / wall_s, 2), "ms_per_request": round(sum(used) / sent * 1000, 3)}


async def measure(url: str, engine_url: str, workers: list[Worker], args: argparse.Namespace) -> dict[str, object]:
    await quiet(url, args)  # warm-up
    quiet_s = await quiet(url, args)
    max_batch = engine_max_batch(engine_url)
    rate = await capacity(url, args, max_batch)
    print(f"quiet p50 {ms(quiet_s, 50)} ms p99 {ms(quiet_s, 99)} ms; capacity {rate:.1f}/s", file=sys.stderr)
    result: dict[str, object] = {
        "max_batch": max_batch,
        "quiet_p50_ms": ms(quiet_s, 50),
        "quiet_p99_ms": ms(quiet_s, 99),
    }
    result["capacity_per_s"] = round(rate, 2)
    loads = {}
    for multiple in args.loads:
        before, refusals = await histograms(engine_url), await refusal_times(workers)
        cpu, began = [cpu_seconds(w.pid) for w in workers], time.monotonic()
        with ExitStack() as pings:
            live = pings.enter_context(pinged(engine_url + Endpoint.LIVE))
            health = f"http://gateway{Endpoint.GATEWAY_HEALTH}"
            worker_live = [pings.enter_context(pinged(health, w.probe)) for w in workers]
            async with lagged() as lags:
                results = await offered(url, rate * multiple, args)
        loads[f"{multiple:g}x"] = summary = summarize(results, percentile(quiet_s, 99), rate)
        wall_s = time.monotonic() - began
        summary["gateway_cpu"] = gateway_cpu(cpu, [cpu_seconds(w.pid) for w in workers], wall_s, len(results))
        summary["gateway_refusal_mean_ms"] = by_whom = means_ms(refusals, await refusal_times(workers))
        if WAIT in by_whom:
            summary["gateway_wait_mean_ms"] = by_whom.pop(WAIT)
        summary["engine_live_ms"] = quantiles_ms(live)
        summary["gateway_live_ms"] = quantiles_ms([t for times in worker_live for t in times])
        summary["load_lag_ms"] = quantiles_ms(lags)
        summary["engine_mean_ms"] = means = engine_means(before, await histograms(engine_url))
        if "admitted_p99_ms" in summary and "service" in means:
            bound_ms = args.queue_budget * 1000 + means["service"]
            summary["admitted_p99_over_bound"] = round(summary["admitted_p99_ms"] / bound_ms, 2)
        print(f"{multiple:g}x: {summary}", file=sys.stderr)
    result["loads"] = loads
    ratios = [s["admitted_p99_over_bound"] for s in loads.values() if "admitted_p99_over_bound" in s]
    if not ratios:
        raise RuntimeError(f"no load admitted a request: {loads}")
    result["admitted_p99_over_bound_max"] = max(ratios)
    result["admitted_p99_over_quiet_max"] = max(s.get("admitted_p99_over_quiet", 0.0) for s in loads.values())
    result["goodput_min"] = min(s["goodput"] for s in loads.values())
    result["refused_max_ms"] = max((s.get("refused_max_ms", 0.0) for s in loads.values()), default=0.0)
    result["errors"] = sum(s["errors"] for s in loads.values())
    result["targets"] = {
        "admitted_p99_over_bound": ADMITTED_P99_BOUND_TARGET,
        "goodput": GOODPUT_TARGET,
        "refused_max_ms": REFUSED_MS_TARGET,
        "errors": 0,
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--max-batch", type=int, default=LIMITS.max_batch, help="default %(default)s")
    parser.add_argument(
        "--queue-budget", type=float, default=LIMITS.queue_budget_s, help="engine.queue_budget_s (default %(default)s)"
    )
    parser.add_argument(
        "--gateway-max-in-flight", type=int, default=0,
        help="gateway.max_in_flight: proxied at once per gateway worker (default %(default)s: the configuration's)",
    )  # fmt: skip
    parser.add_argument(
        "--gateway-workers", type=int, default=GatewaySection.workers,
        help="gateway.workers: gateway processes on the one listening socket (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (default 32)")
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement (default 5)")
    parser.add_argument(
        "--quiet-requests", type=int, default=100,
        help="one at a time, for the quiet p50/p99 every ratio divides by (default 100: a p99 of fewer is their max)",
    )  # fmt: skip
    parser.add_argument(
        "--loads", type=lambda text: [float(x) for x in text.split(",")], default=[1.0, 2.0, 5.0], help="default 1,2,5"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop what was started
    with tempfile.TemporaryDirectory(prefix="hw-overload-") as tmp, stack(args, Path(tmp)) as (url, engine, workers):
        result = {"device": args.device, "model": args.model or "tiny"}
        result["queue_budget_s"] = args.queue_budget
        result["gateway_max_in_flight"] = args.gateway_max_in_flight
        result["gateway_workers"] = args.gateway_workers
        result |= {"max_tokens": args.max_tokens, "seconds": args.seconds}
        result |= asyncio.run(measure(url, engine, workers, args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
