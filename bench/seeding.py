"""Seeding a daemon's arena from a peer daemon, against a raw TCP copy between the same endpoints in the same run.

    python bench/seeding.py [--preset medium] [--streams 4]               # CPU, a generated model in a temp dir
    python bench/seeding.py --device cuda:0 --model DIR [--backend cuda-vmm]
    python bench/seeding.py --simulate-fanout 1000                        # the placement's tree, simulated

Real processes on loopback: a source daemon (``hotweights cache serve --seed-listen``) fills from the checkpoint.
Then ``--repeats`` rounds, alternated so that a change of the host's load falls on all alike: a raw TCP copy of
the arena's bytes from the memory of one process to the memory of another over as many streams (``--raw-send``,
the sender; ``raw_gbps``), on CPU the same into a cpu-shm arena allocated on the clock as every fill allocates
one (``raw_into_new_arena_gbps``: a shared-memory page's first write costs more than its loopback copy on some
hosts), and a seeding from the source by this process (``cache.seeding.seed_arena``, what a daemon's ``peer``
fill runs: connect, copy, content hash checked; ``seed_gbps``); medians, ``ratio`` = seed / raw. Last, a second
daemon fills from the source (``--fill-from peer``) with its pages of the checkpoint dropped from the page cache,
so a read of it would count in ``disk_bytes_read`` (``read_bytes`` of the seeding daemon's /proc/self/io around
its fill, its own report; ``daemon_read_bytes_whole_life``: its /proc/PID/io once it serves, imports included);
``digest_verified``: it filled from the peer and serves the source's content hash. On a GPU the seeded arena is
device memory (written through pinned buffers), the raw copy host memory to host memory.

``serving``: a primary engine of the source daemon (``--kv-pool-share`` SERVING_KV_SHARE on a GPU, so that the seeded
arena fits beside it) serves ``--rps`` greedy completions of SERVING_TOKENS a second (``chaos.load.while_loaded``)
throughout the rounds: its p50 over QUIET_S before them (``quiet_p50_ms``) and over the requests started while a
seeding ran (``during_seed_p50_ms``), their ratio (``slowdown``, target <= 1.25), and the requests that got no 200
(``errors``; ``other_texts``: a 200 with a greedy text other than the first one's). ``--rps 0``: no engine.
On a GPU, ``device_link``: the card's copies between pinned host
memory and the device (LINK_BYTES, each way alone, then both at once, GB/s each way): on one host, a seeding moves
every byte device to host at the source and host to device at the joiner through the same card at once, so
``both_ways_gbps`` bounds ``seed_gbps`` there (between hosts each card carries one way).

``--simulate-fanout N``: ``controller.seedplacement.simulate_fanout`` for N hosts (one serving, the rest joining
at once, one copy per source at a time): copy times until all serve, the bound ceil(log2 N) + 2, link load.
The last stdout line is one JSON object. Every process it starts is stopped at its end, on SIGINT and SIGTERM too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.overload import wait_serving
from hotweights.cache.backends import get_backend
from hotweights.cache.connection import request
from hotweights.cache.diskio import disk_read_bytes, evict
from hotweights.cache.fingerprint import Fingerprint
from hotweights.cache.makemodel import PRESETS, write_checkpoint
from hotweights.cache.paths import DaemonPaths
from hotweights.cache.seeding import SeedOptions, seed_arena
from hotweights.cache.seedtransport import STREAMS, read_piece, tune
from hotweights.chaos.load import Loaded, while_loaded
from hotweights.contract import Endpoint, Role
from hotweights.controller.seedplacement import copy_times_bound, simulate_fanout
from hotweights.ports import free_ports
from hotweights.spawn import hotweights_command
from hotweights.waiting import wait_until

START_TIMEOUT_S = 900.0
RAW_CHUNK = 8 << 20
LINK_BYTES = 2 << 30  # what ``device_link`` copies each way
SERVING_TOKENS = 16  # each completion the serving engine generates
SERVING_RPS, SERVING_RPS_CPU = 10.0, 1.0  # the serving engine's completions a second by default
SERVING_KV_SHARE = 0.1  # of the device's memory beyond the weights, the serving engine's KV pool on a GPU
QUIET_S = 5.0  # the serving engine's latency alone, before the rounds
SLOWDOWN_TARGET = 1.25


def raw_send(port: int, nbytes: int, streams: int) -> None:
    """The raw copy's sender: listen on ``port``, send ``nbytes`` of memory split over ``streams`` connections
    (stream i sends the i-th share), then exit."""
    data = memoryview(bytearray(os.urandom(1 << 20)) * -(-nbytes // (1 << 20)))[:nbytes]
    with socket.create_server(("127.0.0.1", port)) as listener:
        print("ready", flush=True)
        conns = [listener.accept()[0] for _ in range(streams)]
        threads = [threading.Thread(target=_send_share, args=(c, data, i, streams)) for i, c in enumerate(conns)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _send_share(conn: socket.socket, data: memoryview, index: int, streams: int) -> None:
    with conn:
        tune(conn)
        start, end = _share(len(data), index, streams)
        for position in range(start, end, RAW_CHUNK):
            conn.sendall(data[position : min(position + RAW_CHUNK, end)])


def _share(nbytes: int, index: int, streams: int) -> tuple[int, int]:
    per = -(-nbytes // streams)
    return min(index * per, nbytes), min((index + 1) * per, nbytes)


def raw_copy(nbytes: int, streams: int, into_new_arena: bool = False) -> float:
    """GB/s of ``nbytes`` from another process's memory into this one's over ``streams`` loopback connections: into
    memory allocated before the clock starts, or (``into_new_arena``) into a cpu-shm arena allocated on the clock,
    as a daemon's fill allocates its arena."""
    port = free_ports(1)[0]
    sender = subprocess.Popen([sys.executable, __file__, "--raw-send", str(port), str(nbytes), str(streams)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert sender.stdout is not None and sender.stdout.readline().strip() == "ready"
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
        start = time.perf_counter()
        arena = get_backend("cpu-shm").allocate(nbytes, torch.device("cpu")) if into_new_arena else None
        target = memoryview(arena.tensor.numpy())[:nbytes] if arena is not None else memoryview(bytearray(nbytes))
        if arena is None:
            start = time.perf_counter()
        threads = [threading.Thread(target=_receive_share, args=(c, target, i, streams)) for i, c in enumerate(conns)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
        target.release()
        if arena is not None:
            arena.close()
        return nbytes / 1e9 / seconds
    finally:
        sender.wait(timeout=60)


def _receive_share(conn: socket.socket, target: memoryview, index: int, streams: int) -> None:
    with conn:
        tune(conn)
        position, end = _share(len(target), index, streams)
        while position < end:  # as a seeding stream reads: a piece per call (``seedtransport.read_piece``)
            got = read_piece(conn, target[position : min(position + RAW_CHUNK, end)])
            if not got:
                raise ConnectionError("the raw sender closed early")
            position += got


def start_daemon(model: Path, sock: Path, device: str, backend: str | None, *flags: str) -> subprocess.Popen:
    command = hotweights_command("cache", "serve", "--model", str(model), "--device", device, "--socket", str(sock))
    command += ["--backend", backend] if backend else []
    sock.parent.mkdir(mode=0o700, exist_ok=True)
    log = open(sock.with_suffix(".out"), "wb")  # noqa: SIM115 (the child's, for its life)
    process = subprocess.Popen([*command, *flags], stdout=log, stderr=log)
    paths = DaemonPaths(sock)
    wait_until(lambda: paths.ready.exists() or process.poll() is not None, START_TIMEOUT_S, f"daemon on {sock}")
    if process.poll() is not None:
        tail = sock.with_suffix(".out").read_text()[-2000:]
        raise SystemExit(f"daemon on {sock} exited {process.returncode}: {tail}")
    return process


def alternated(
    served: dict[str, Any], address: str, token: str, args: argparse.Namespace, seeding: list[tuple[float, float]]
) -> dict[str, list[float]]:
    """``--repeats`` rounds of: the raw copy, the raw copy into a new arena (CPU), and a seeding from the source
    daemon by this process (``cache.seeding.seed_arena``, what the daemon's ``peer`` fill runs, content hash
    checked), GB/s each: alternated, so that a change of the host's load falls on all three alike. Each seeding's
    (start, end), wall-clock, is appended to ``seeding``."""
    fingerprint = Fingerprint.from_json(served["fingerprint"])
    options = SeedOptions(sources=address, token=token, streams=args.streams)
    backend, device, nbytes = get_backend(served["backend"]), torch.device(served["device"]), served["bytes"]
    rounds: dict[str, list[float]] = {"raw": [], "raw_into_new_arena": [], "seed": []}
    for _ in range(args.repeats):
        rounds["raw"].append(raw_copy(nbytes, args.streams))
        if device.type == "cpu":
            rounds["raw_into_new_arena"].append(raw_copy(nbytes, args.streams, into_new_arena=True))
        start, began = time.perf_counter(), time.time()
        seed_arena(options, fingerprint, backend, device).arena.close()
        rounds["seed"].append(nbytes / 1e9 / (time.perf_counter() - start))
        seeding.append((began, time.time()))
    return rounds


@contextlib.contextmanager
def serving_engine(model: Path, sock: Path, args: argparse.Namespace) -> Iterator[str | None]:
    """A primary engine of the daemon at ``sock``, serving once this yields its URL (None with ``--rps 0``); killed
    on the way out."""
    if not args.rps:
        yield None
        return
    port = free_ports(1)[0]
    command = hotweights_command("engine", "--role", Role.PRIMARY, "--port", str(port), "--device", args.device)
    command += ["--weight-cache", "client", "--socket", str(sock), "--model", str(model)]
    command += ["--kv-pool-share", str(SERVING_KV_SHARE)] if args.device.startswith("cuda") else []
    url, log = f"http://127.0.0.1:{port}", sock.with_name("engine.out")
    with open(log, "wb") as out:
        engine = subprocess.Popen(command, stdout=out, stderr=out, start_new_session=True)
    try:
        wait_serving(url + Endpoint.PRIMARY, engine, log, START_TIMEOUT_S)
        yield url
    finally:
        engine.kill()
        engine.wait()


def serving(loaded: Loaded, seeding: list[tuple[float, float]], rps: float) -> dict[str, Any]:
    """The ``serving`` figures (module docstring) of a load beside the rounds."""
    load = loaded.load
    records = load.records
    quiet = loaded.p50_ms(loaded.quiet)
    during = load.p50_ms(lambda start: any(a <= start < b for a, b in seeding))
    return {
        "rps": rps,
        "quiet_p50_ms": quiet,
        "during_seed_p50_ms": during,
        "slowdown": round(during / quiet, 2) if quiet and during else None,
        "slowdown_target": SLOWDOWN_TARGET,
        "requests": len(records),
        "errors": sum(r.status != 200 for r in records),
        "other_texts": sum(r.status == 200 and r.correct is False for r in records),
    }


def device_link(device: torch.device) -> dict[str, float]:
    """GB/s each way of LINK_BYTES between pinned host memory and ``device``: device to host alone, host to device
    alone, both at once (each on a stream of its own)."""
    host = [torch.empty(LINK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(LINK_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
    streams = [torch.cuda.Stream(device) for _ in range(2)]

    def timed(*ways: int) -> float:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for way in ways:  # 0: device to host, 1: host to device
            target, source = (host[0], dev[0]) if way == 0 else (dev[1], host[1])
            with torch.cuda.stream(streams[way]):
                target.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)
        return round(LINK_BYTES / 1e9 / (time.perf_counter() - start), 2)

    timed(0, 1)  # first copies: the driver's mappings
    return {"d2h_gbps": timed(0), "h2d_gbps": timed(1), "both_ways_gbps": timed(0, 1)}


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def measure(model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    token = work / "seed.token"
    token.write_text(os.urandom(16).hex() + "\n")
    token.chmod(0o600)
    address = f"127.0.0.1:{free_ports(1)[0]}"
    common = ["--seed-token-file", str(token), "--seed-streams", str(args.streams)]
    source = start_daemon(model, work / "a" / "a.sock", args.device, args.backend, "--seed-listen", address, *common)
    joiner = None
    try:
        served = request(work / "a" / "a.sock", {"op": "status"}, timeout=30)["status"]
        seeding: list[tuple[float, float]] = []

        rounds_ = functools.partial(alternated, served, address, token.read_text().strip(), args, seeding)
        beside = None
        with serving_engine(model, work / "a" / "a.sock", args) as url:
            if url is None:
                rounds = rounds_()
            else:
                loaded = asyncio.run(while_loaded(url, args.rps, SERVING_TOKENS, rounds_, QUIET_S))
                rounds, beside = loaded.result, serving(loaded, seeding, args.rps)
        evict(model.glob("*.safetensors"))
        joiner = start_daemon(model, work / "b" / "b.sock", args.device, args.backend,
                              "--seed-from", address, "--fill-from", "peer", *common)  # fmt: skip
        seeded = request(work / "b" / "b.sock", {"op": "status"}, timeout=30)["status"]
        progress = json.loads(DaemonPaths(work / "b" / "b.sock").seeding.read_text())
        whole_life = disk_read_bytes(joiner.pid)
    finally:
        for process in (joiner, source):
            if process is not None:
                process.terminate()
                process.wait(timeout=60)
    fill = seeded["fill"]
    seed, raw, raw_arena = (median(rounds[key]) for key in ("seed", "raw", "raw_into_new_arena"))
    return {
        "device": args.device,
        "bytes": served["bytes"],
        "streams": args.streams,
        "seed_gbps": seed,
        "raw_gbps": raw,
        "ratio": round(seed / raw, 3),
        "raw_into_new_arena_gbps": raw_arena,
        "ratio_to_raw_into_new_arena": round(seed / raw_arena, 3) if raw_arena else None,
        "rounds": {key: [round(value, 3) for value in values] for key, values in rounds.items()},
        "daemon_seed_gbps": round(served["bytes"] / 1e9 / fill["seconds"], 3),
        "daemon_copy_gbps": progress["rate_gbps"],
        "daemon_fill": fill["detail"],
        "digest_verified": fill["source"] == "peer" and seeded["content_hash"] == served["content_hash"],
        "disk_bytes_read": fill["disk_read_bytes"],
        "daemon_read_bytes_whole_life": whole_life,
        "resumes": progress["resumes"],
        "serving": beside,
    }


def fanout(hosts: int) -> dict[str, Any]:
    result = simulate_fanout(hosts)
    bound = copy_times_bound(hosts)
    return {"hosts": hosts, "copy_times": result.copy_times, "bound": bound, "within_bound": result.copy_times <= bound,
            "seeded_per_copy_time": result.seeded_at, "max_copies_per_source": result.max_copies_per_source,
            "mean_uplink_load": result.mean_uplink_load}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", type=Path, help="a checkpoint (default: the --preset, written to a temp dir)")
    parser.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--backend", help="default: the device's (cpu-shm, cuda-vmm)")
    parser.add_argument(
        "--streams",
        type=int,
        default=STREAMS,
        help="of the seeding and the raw copy (default: a daemon's, %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds of raw copies and seedings; medians count")
    parser.add_argument(
        "--rps",
        type=float,
        help=f"the source's serving engine's completions a second (0: no engine; default {SERVING_RPS} on a GPU, "
        f"{SERVING_RPS_CPU} on CPU, where a medium model serves fewer than {SERVING_RPS:g})",
    )
    parser.add_argument("--simulate-fanout", type=int, metavar="HOSTS")
    parser.add_argument("--raw-send", nargs=3, type=int, metavar=("PORT", "BYTES", "STREAMS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_send:
        raw_send(*args.raw_send)
        return 0
    if args.simulate_fanout:
        print(json.dumps(fanout(args.simulate_fanout)))
        return 0
    if args.rps is None:
        args.rps = SERVING_RPS if torch.device(args.device).type == "cuda" else SERVING_RPS_CPU
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # measure's and serving_engine's exits stop every process
    with tempfile.TemporaryDirectory(prefix="hw-seed-", dir="/tmp") as tmp:
        work = Path(tmp)
        os.environ["HOTWEIGHTS_RUNTIME_DIR"] = str(work / "run")
        model = args.model
        if model is None:
            model = write_checkpoint(work / args.preset, PRESETS[args.preset], progress=False)
        result = measure(model, work, args)
    if torch.device(args.device).type == "cuda":
        result["device_link"] = device_link(torch.device(args.device))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
