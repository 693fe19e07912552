"""An engine's start to ready: forked from the stack's launcher (``standby.launcher``) against a fresh process.

    python bench/launch.py [--model DIR] [--device cpu] [--trials 3] [--load 2] [--kv-cache-tokens N]

One cache daemon serves the model; each trial starts one standby engine attaching to it (a command like the
controller's, with the engine's own defaults, on a free port), from the request (launcher) or the ``Popen`` call
(fresh) to its ready line on stdout, then stops it. Both ways alternate within a row, so they share the host's
state. Rows: ``idle``, then ``load`` (``--load`` busy-looping processes beside it, the cores a primary serving
would take; 0: no such row), then ``serving`` (a primary engine of the same daemon, its own defaults, serving
``--rps`` greedy completions of SERVING_TOKENS tokens a second, open loop: ``chaos.load.while_loaded``; 0: no such
row), which adds the primary's latency: ``quiet_p50_ms`` over QUIET_S before the trials, ``during_p50_ms`` over the
trials, their ratio ``primary_slowdown``, and ``errors`` (answers but a 200 with the first answer's text). Each row
gives the median seconds of each way, their ratio, and the engine's own breakdown from its ready line (``start_s``,
``standby.startclock``: ``command``, its process's start to the command's entry: interpreter, imports, flags;
``weights``: CUDA context, attach, bind; ``warm_up``; ``total``, to the ready line).
``imports_s``: ``python -c "import hotweights.standby.engine"`` in the same run, what the launcher pays once.
The last stdout line is one JSON object. Every process is stopped at the end, on SIGINT/SIGTERM too.
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
import time
from collections.abc import Iterator
from pathlib import Path

from hotweights.cache.connection import hello
from hotweights.cache.protocol import recv_message, send_message
from hotweights.chaos.load import while_loaded
from hotweights.contract import Role
from hotweights.controller.launcherclient import LAUNCHER_MODULE
from hotweights.ports import free_ports
from hotweights.spawn import hotweights_command, module_command
from hotweights.standby.launchwire import TITLE_ROOM, LaunchRequest
from hotweights.waiting import wait_until

BUSY = "while True: pass"
SERVING_TOKENS = 16  # each completion the serving row's primary generates
QUIET_S = 5.0  # the primary's latency alone, before the serving row's trials


def engine_command(args: argparse.Namespace, socket_path: Path, role: Role = Role.STANDBY, port: int = 0) -> list[str]:
    command = hotweights_command("engine", "--role", role, "--port", str(port), "--device", args.device)
    command += ["--weight-cache", "client", "--socket", str(socket_path)]
    command += ["--kv-cache-tokens", str(args.kv_cache_tokens)] if args.kv_cache_tokens else []
    return command + (["--model", args.model] if args.model else [])


def wait_ready_line(out: int, log: Path, timeout_s: float) -> dict[str, float]:
    """Read ``out`` (the engine's stdout and stderr, also copied to ``log``) until its ready line; its ``start_s``."""
    deadline, seen = time.monotonic() + timeout_s, b""
    with open(log, "ab") as copy:
        while time.monotonic() < deadline:
            chunk = os.read(out, 65536)
            if not chunk:
                break
            copy.write(chunk)
            seen += chunk
            for line in seen.splitlines():
                if line.startswith(b'{"event": "ready"'):
                    return json.loads(line)["start_s"]
    raise SystemExit(f"no ready line within {timeout_s} s:\n{log.read_text(errors='replace')[-3000:]}")


def stop(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        pidfd = os.pidfd_open(pid)
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.close(pidfd)


def fresh(command: list[str], log: Path, timeout_s: float) -> tuple[float, dict[str, float]]:
    out_r, out_w = os.pipe()
    start = time.perf_counter()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, start_new_session=True)
    os.close(out_w)
    try:
        steps = wait_ready_line(out_r, log, timeout_s)
        return time.perf_counter() - start, steps
    finally:
        process.kill()
        process.wait()
        os.close(out_r)


def launched(launcher_socket: Path, command: list[str], log: Path, timeout_s: float) -> tuple[float, dict[str, float]]:
    out_r, out_w = os.pipe()
    start = time.perf_counter()
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(launcher_socket))
        send_message(conn, LaunchRequest(tuple(command), dict(os.environ)).message(), [out_w])
        os.close(out_w)
        reply, fds = recv_message(conn, max_fds=1)
        for fd in fds:
            os.close(fd)
        if reply.get("ok") is not True:
            raise SystemExit(f"the launcher refused: {reply}")
        try:
            steps = wait_ready_line(out_r, log, timeout_s)
            return time.perf_counter() - start, steps
        finally:
            stop(reply["pid"])
            recv_message(conn)  # its exit, reaped
            os.close(out_r)


def row(args: argparse.Namespace, command: list[str], launcher_socket: Path, workdir: Path, name: str) -> dict:
    times: dict[str, list[float]] = {"fresh": [], "launcher": []}
    parts: dict[str, list[dict[str, float]]] = {"fresh": [], "launcher": []}
    for trial in range(args.trials):
        for way in ("launcher", "fresh") if trial % 2 else ("fresh", "launcher"):
            log = workdir / f"{name}-{way}-{trial}.log"
            if way == "fresh":
                seconds, steps = fresh(command, log, args.timeout)
            else:
                seconds, steps = launched(launcher_socket, command, log, args.timeout)
            times[way].append(seconds)
            parts[way].append(steps)
    result: dict[str, object] = {}
    for way in times:
        result[f"{way}_s"] = round(statistics.median(times[way]), 3)
        result[f"{way}_breakdown"] = {step: statistics.median(p[step] for p in parts[way]) for step in parts[way][0]}
    result["ratio"] = round(result["fresh_s"] / result["launcher_s"], 2)  # type: ignore[operator]
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def import_seconds() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)  # the interpreter's own start
    baseline = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import hotweights.standby.engine"], check=True)
    return round(time.perf_counter() - start - baseline, 3)


@contextlib.contextmanager
def running(command: list[str], log: Path, stdin: int | None = subprocess.DEVNULL) -> Iterator[subprocess.Popen]:
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdin=stdin, stdout=out, stderr=out, start_new_session=True)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy processes for the load row")
    parser.add_argument("--kv-cache-tokens", type=int, default=0, help="the engine's (0: its default)")
    parser.add_argument("--rps", type=float, default=10.0, help="the serving row's completions a second (0: no row)")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the context managers stop every process
    workdir = Path(tempfile.mkdtemp(prefix="hw-launch-", dir="/tmp"))
    daemon_socket, launcher_socket = workdir / "g0.sock", workdir / "launcher.sock"
    daemon = hotweights_command("cache", "serve", "--device", args.device, "--socket", str(daemon_socket))
    daemon += ["--model", args.model] if args.model else []
    launcher = module_command(LAUNCHER_MODULE, "--socket", str(launcher_socket), f"--title-room={' ' * TITLE_ROOM}")
    with (
        running(daemon, workdir / "daemon.log"),
        running(launcher, workdir / "launcher.log", subprocess.PIPE) as launcher_process,
    ):
        wait_until(lambda: _serves(daemon_socket), args.timeout, "the daemon to serve", interval=0.1)
        wait_until(launcher_socket.exists, args.timeout, "the launcher to listen", interval=0.05)
        assert launcher_process.poll() is None
        command = engine_command(args, daemon_socket)
        results: dict[str, object] = {"device": args.device, "trials": args.trials, "imports_s": import_seconds()}
        results["idle"] = row(args, command, launcher_socket, workdir, "idle")
        if args.load:
            burners = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.load)]
            try:
                results["load"] = row(args, command, launcher_socket, workdir, "load") | {"busy": args.load}
            finally:
                for burner in burners:
                    burner.kill()
                    burner.wait()
        if args.rps:
            results["serving"] = serving_row(args, command, launcher_socket, workdir, daemon_socket)
    print(json.dumps(results))
    return 0


def serving_row(
    args: argparse.Namespace, command: list[str], launcher_socket: Path, workdir: Path, daemon_socket: Path
) -> dict:
    """The ``serving`` row (module docstring): the trials beside a primary under ``--rps`` completions a second."""
    port = free_ports(1)[0]
    with running(engine_command(args, daemon_socket, Role.PRIMARY, port), workdir / "primary.log"):
        return asyncio.run(beside_load(args, command, launcher_socket, workdir, f"http://127.0.0.1:{port}"))


async def beside_load(
    args: argparse.Namespace, command: list[str], launcher_socket: Path, workdir: Path, url: str
) -> dict:
    """The trials (``row``) while ``chaos.load.while_loaded`` drives the primary at ``url``, and that primary's p50
    before and during them."""
    trials = functools.partial(row, args, command, launcher_socket, workdir, "serving")
    loaded = await while_loaded(url, args.rps, SERVING_TOKENS, trials, QUIET_S, args.timeout)
    records = loaded.load.records
    quiet, during = loaded.p50_ms(loaded.quiet), loaded.p50_ms(loaded.during)
    slowdown = round(during / quiet, 2) if quiet and during else None
    errors = sum(bool(r.error) for r in records)
    return loaded.result | {"rps": args.rps, "quiet_p50_ms": quiet, "during_p50_ms": during,
                            "primary_slowdown": slowdown, "requests": len(records), "errors": errors}  # fmt: skip


def _serves(path: Path) -> bool:
    try:
        hello(path, timeout=1.0)
    except Exception:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
