"""How long a SIGKILLed engine's CUDA context holds up the engines that live on (kill-primary on xl).

    python bench/teardown.py --device cuda:0 [--arena-gib 32] [--victim-gib 4] [--no-import]

This process plays the daemon and the surviving engine: it allocates a cuda-vmm arena and runs a steady step
on it, a matrix-vector product over --step-gib of the arena (about what a decode step reads), timed on the host
per step as an engine's step loop sees it. A victim subprocess plays the killed primary: it imports the arena
(unless --no-import), allocates --victim-gib of its own (its KV cache), runs a step of its own and idles; it is
SIGKILLed while this process steps. Reported: the median step before the kill, the longest step after it
and the time lost to steps slower than 2 x the median; when /proc saw the victim reaped; when its memory was
free again (cudaMemGetInfo, polled between steps). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hotweights.cache.backends import get_backend

STEP_COLUMNS = 8192
RUN_S = 1.0  # stepping before and after the kill


def victim(handle: dict, fd: int, device: torch.device, victim_gib: float) -> None:
    """The killed engine: import, allocate, step once, say ready, idle until killed."""
    arena = get_backend("cuda-vmm").import_arena(handle, [fd], device) if fd >= 0 else None
    own = torch.empty(int(victim_gib * (1 << 30)), dtype=torch.uint8, device=device)
    own.fill_(1)
    weights = (arena.tensor if arena is not None else own)[: 1 << 30].view(torch.bfloat16).view(-1, STEP_COLUMNS)
    x = torch.ones(STEP_COLUMNS, 1, dtype=torch.bfloat16, device=device)
    weights @ x
    torch.cuda.synchronize(device)
    print("ready", flush=True)
    signal.pause()  # idle, as a primary between steps: what the kill costs is the teardown alone


def step_times(weights: torch.Tensor, device: torch.device, seconds: float, free: list[tuple[float, int]]) -> list:
    """(end time, step seconds) for every step during ``seconds``; the device's free bytes after each."""
    x = torch.ones(STEP_COLUMNS, 1, dtype=torch.bfloat16, device=device)
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        weights @ x
        torch.cuda.synchronize(device)
        out.append((time.monotonic(), time.perf_counter() - start))
        free.append((time.monotonic(), torch.cuda.mem_get_info(device)[0]))
    return out


def reaped_at(pid: int) -> float:
    """Wait for the killed child; the monotonic time it was reaped."""
    os.waitpid(pid, 0)
    return time.monotonic()


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    arena = get_backend("cuda-vmm").allocate(int(args.arena_gib * (1 << 30)), device)
    arena.tensor[: int(args.step_gib * (1 << 30))].fill_(1)
    weights = arena.tensor[: int(args.step_gib * (1 << 30))].view(torch.bfloat16).view(-1, STEP_COLUMNS)
    handle, fds = arena.export()
    fd = -1 if args.no_import else fds[0]
    command = [sys.executable, __file__, "--victim", json.dumps(handle), str(fd), "--device", args.device]
    command += ["--victim-gib", str(args.victim_gib)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, pass_fds=[] if fd < 0 else [fd], text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            raise SystemExit("the victim did not start")
        free_with_victim = torch.cuda.mem_get_info(device)[0]
        free: list[tuple[float, int]] = []
        before = step_times(weights, device, RUN_S, free)
        killed = time.monotonic()
        child.send_signal(signal.SIGKILL)
        after = step_times(weights, device, RUN_S * 2, free)
        reaped = reaped_at(child.pid)
    finally:
        if child.poll() is None:
            child.kill()
    median = statistics.median(s for _, s in before)
    returned = [t for t, f in free if t > killed and f >= free_with_victim + args.victim_gib * (1 << 30) * 0.9]
    slow = [s for _, s in after if s > 2 * median]
    return {
        "arena_gib": args.arena_gib,
        "victim_gib": args.victim_gib,
        "victim_imports_arena": not args.no_import,
        "step_ms_median": round(median * 1e3, 3),
        "step_ms_max_after_kill": round(max(s for _, s in after) * 1e3, 3),
        "lost_ms_after_kill": round(sum(s - median for s in slow) * 1e3, 2),
        "slow_steps_after_kill": len(slow),
        "reaped_ms": round((reaped - killed) * 1e3, 2),
        "memory_freed": bool(returned),
        **({"memory_free_ms": round((returned[0] - killed) * 1e3, 2)} if returned else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--arena-gib", type=float, default=32.0)
    parser.add_argument("--step-gib", type=float, default=1.0, help="bytes of the arena one step reads")
    parser.add_argument("--victim-gib", type=float, default=4.0, help="the victim's own memory (its KV cache)")
    parser.add_argument("--no-import", action="store_true", help="the victim does not map the arena")
    parser.add_argument("--victim", nargs=2, metavar=("HANDLE", "FD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.victim:
        victim(json.loads(args.victim[0]), int(args.victim[1]), torch.device(args.device), args.victim_gib)
        return
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
