"""One primary and N standbys on one GPU, sharing one weight arena: memory and daemon-death checks.

    python bench/gpu_engines.py --model DIR [--device cuda:0] [--standbys 3]

1. Memory: device memory in use (nvidia-smi) after the daemon loads, after the primary attaches,
   and after each standby; bytes added per standby (target: weights counted once, each standby adds
   only its CUDA context and workspace).
2. Daemon SIGKILL while engines serve: the primary's greedy completion is byte-identical before
   and after; a spare daemon (imported before the kill, as the controller keeps one) is started and
   re-adopts the arena from an engine (its fill source and time are reported, and the time from its
   start until it serves); a new engine attaches to it, is promoted (after the old primary is demoted)
   and completes the same text.
3. Attach inside each freshly started engine, from the engine's own log line (total and its parts:
   checkpoint headers, waiting for the CUDA context, attach, bind; the attach's own: the daemon's reply, map,
   the content hash recomputed over the mapping, offer). The new engine of 2 is a spare
   (prepared, attached and warmed up before the kill, started by one byte once the daemon serves again, as the
   controller does; ``spare_engine_start_to_ready_s`` runs from that byte to its ready answer);
   after it, a new process and a spare prepared then, both attaching to the re-adopted arena.
The last stdout line is one JSON object. Every process is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hotweights.cache.connection import request
from hotweights.contract import Endpoint
from hotweights.spawn import SparePipes, hotweights_command, read_message, send_message
from hotweights.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The weight cache keeps"
ATTACHED = re.compile(
    r"attached \d+ tensors from \S+ in ([\d.]+) ms \(checkpoint headers ([\d.]+), waiting for the CUDA context "
    r"([\d.]+), attach ([\d.]+), bind ([\d.]+); attach: daemon's reply ([\d.]+), map ([\d.]+), content hash ([\d.]+), "
    r"offer ([\d.]+)\)"
    r"(; prepared before this spare was started)?"
)
PARTS = ("total", "checkpoint_headers", "cuda_context_wait", "attach", "bind", "reply", "map", "digest", "offer")


def attach_times(workdir: Path) -> list[dict[str, float]]:
    """Every engine's attach line in ``workdir``'s engine logs, in milliseconds, in port order; ``spare``: it
    was prepared before it was started."""
    found = []
    for log in sorted(workdir.glob("engine-*.log")):
        match = ATTACHED.search(log.read_text(errors="replace"))
        if match:
            *parts, spare = match.groups()
            found.append({**dict(zip(PARTS, map(float, parts), strict=True)), "spare": spare is not None})
    return found


def used_mib(device_index: int | None) -> int:
    """Device memory in use; 0 on CPU (lets the flow be checked on a machine without a GPU)."""
    if device_index is None:
        return 0
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", f"--id={device_index}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


Spare = tuple[subprocess.Popen, int]  # a spare's process and the fd that starts it


def start(spare: Spare) -> subprocess.Popen:
    """Start ``spare`` with its start message (``hotweights.spawn``)."""
    proc, fd = spare
    send_message(fd, {})
    os.close(fd)
    return proc


class Stack:
    """The processes this benchmark started, all killed in ``close``."""

    def __init__(self, model: Path, device: str, workdir: Path) -> None:
        self.model, self.device, self.workdir = model, device, workdir
        self.socket = workdir / "cache.sock"
        self.procs: list[subprocess.Popen] = []

    def spawn(self, args: list[str], log: str, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        out = open(self.workdir / log, "ab")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(hotweights_command(*args), stdout=out, stderr=out, pass_fds=pass_fds)
        self.procs.append(proc)
        return proc

    def daemon_args(self) -> list[str]:
        return ["cache", "serve", "--model", str(self.model), "--device", self.device, "--socket", str(self.socket)]

    def engine_args(self, port: int, role: str) -> list[str]:
        args = ["engine", "--model", str(self.model), "--device", self.device, "--weight-cache", "client"]
        return [*args, "--socket", str(self.socket), "--port", str(port), "--role", role, "--engine-id", f"e{port}"]

    def start_spare(self, args: list[str], log: str) -> Spare:
        """A process started as the controller starts a spare (``hotweights.spawn``), once it said it is
        prepared (imports done; an engine also has its CUDA context, checkpoint headers and skeleton)."""
        pipes = SparePipes.open()
        proc = self.spawn([*args, *pipes.flags], log, pipes.theirs)
        pipes.close_theirs()
        if read_message(pipes.ready_fd) is None:
            raise RuntimeError(f"spare exited: see {self.workdir / log}")
        os.close(pipes.ready_fd)
        return proc, pipes.start_fd

    def start_daemon(self, spare: Spare | None = None) -> subprocess.Popen:
        """The daemon, serving: a new process, or ``spare`` (``start_spare``'s) started by its byte."""
        ready = self.socket.with_suffix(".ready")
        ready.unlink(missing_ok=True)
        proc = self.spawn(self.daemon_args(), "daemon.log") if spare is None else start(spare)
        wait_until(lambda: ready.exists() or proc.poll() is not None, 600, "daemon ready")
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited: see {self.workdir / 'daemon.log'}")
        return proc

    def start_engine(self, port: int, role: str, spare: Spare | None = None) -> httpx.Client:
        """An engine, ready: a new process, or ``spare`` started by its byte."""
        proc = self.spawn(self.engine_args(port, role), f"engine-{port}.log") if spare is None else start(spare)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"engine on {port} exited: see {self.workdir / f'engine-{port}.log'}")
            try:
                return client.get(Endpoint.READY).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 300, f"engine on port {port}")
        return client

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def complete(client: httpx.Client) -> str:
    reply = client.post(Endpoint.COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--standbys", type=int, default=3)
    parser.add_argument("--base-port", type=int, default=18300)
    args = parser.parse_args()
    index = None if args.device == "cpu" else int(args.device.partition(":")[2] or 0)
    workdir = Path(tempfile.mkdtemp(prefix="hw-eng-", dir="/tmp"))
    stack = Stack(Path(args.model), args.device, workdir)
    result: dict[str, object] = {"model": args.model, "device": args.device}
    try:
        baseline = used_mib(index)
        daemon = stack.start_daemon()
        after_daemon = used_mib(index)
        primary = stack.start_engine(args.base_port, "primary")
        after_primary = used_mib(index)
        kv_bytes = primary.get(Endpoint.READY).json()["kv_cache_bytes"]
        per_standby = []
        previous = after_primary
        for i in range(args.standbys):
            stack.start_engine(args.base_port + 1 + i, "standby")
            now = used_mib(index)
            per_standby.append(now - previous)
            previous = now
        result.update(
            baseline_mib=baseline,
            daemon_mib=after_daemon - baseline,
            primary_added_mib=after_primary - after_daemon,
            primary_kv_cache_mib=round(kv_bytes / 2**20, 1),
            standby_added_mib=per_standby,
            total_mib_1_primary_plus_standbys=previous - baseline,
        )
        reference = complete(primary)
        port = args.base_port + 1 + args.standbys
        spare_daemon = stack.start_spare(stack.daemon_args(), "daemon-spare.log")
        spare_engine = stack.start_spare(stack.engine_args(port, "standby"), f"engine-{port}.log")
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(timeout=30)
        after_kill = complete(primary)  # served while no daemon runs
        respawned = time.monotonic()
        stack.start_daemon(spare_daemon)
        serving = time.monotonic() - respawned
        result["spare_daemon_start_to_serving_s"] = round(serving, 3)
        result["respawn_fill"] = request(stack.socket, {"op": "status"})["status"]["fill"]
        started = time.monotonic()
        fresh = stack.start_engine(port, "standby", spare_engine)
        result["spare_daemon_start_to_new_engine_ready_s"] = round(time.monotonic() - respawned, 3)
        result["spare_engine_start_to_ready_s"] = round(time.monotonic() - started, 3)
        source = fresh.get(Endpoint.READY).json()["weight_cache"]["source"]
        primary.post(Endpoint.DEMOTE)
        promote_ms = fresh.post(Endpoint.PROMOTE).json().get("duration_ms")
        result.update(
            output_unchanged_after_daemon_sigkill=after_kill == reference,
            new_engine_source=source,
            new_engine_output_equal=complete(fresh) == reference,
            new_engine_promote_ms=promote_ms,
        )
        # Two more engines on the re-adopted arena: a new process, then a spare prepared now: whether an attach to
        # a re-adopted arena, or the wait of the first spare (prepared before the kill), is what costs.
        stack.start_engine(port + 1, "standby")
        stack.start_engine(
            port + 2, "standby", stack.start_spare(stack.engine_args(port + 2, "standby"), f"engine-{port + 2}.log")
        )
        result["engine_attach_ms"] = attach_times(workdir)
    finally:
        stack.close()
    ok = bool(result.get("output_unchanged_after_daemon_sigkill") and result.get("new_engine_output_equal"))
    result["ok"] = ok and result.get("new_engine_source") == "cache"
    for key, value in result.items():
        print(f"{key:40s} {value}", file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
