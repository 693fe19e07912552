"""How fast a group is safe again after each of repeated faults under load, and what restoring it costs the primary.

    python bench/redundancy.py                                       # CPU, tiny: 6 faults 8 s apart, alternating
    python bench/redundancy.py --model /tmp/xl --device cuda:0 --faults 10 --interval 10 --signals kill
    python bench/redundancy.py --model /tmp/xl --device cuda:0 --faults 10 --interval 3 --signals kill,stop
    python bench/redundancy.py --engine vllm --interval 40 --faults 4     # CPU: a vLLM group, 4 SIGKILLs
    python bench/redundancy.py --engine sglang --interval 40 --faults 4   # CPU: an SGLang group

Starts its own stack (``hotweights up`` of the drill's: controller, daemon, 3 engines, the gateway,
``--spare-engines`` warmed spares at ``--spare-duty``), drives ``--rps`` greedy completions a second through the
gateway and, once the group and its spares are ready, first measures a quiet window (``--quiet`` s, nothing
warming), then one engine's cold start beside it (a plain ``hotweights engine`` against the stack's daemon, to
ready), then sends ``--faults`` faults to whichever engine serves as primary, ``--interval`` s apart on a fixed
schedule (it never waits for recovery), the signals cycling through ``--signals`` (a stopped primary is fenced by
the controller; it gets SIGCONT at the end). Everything it started is stopped at the end, on SIGINT and SIGTERM too.
``--batch-invariant`` and ``--queue-budget`` set the engines' ``engine.batch_invariant`` and ``engine.queue_budget_s``
(default: the shipped engine limits, as every drill stack runs them). ``--engine vllm|sglang`` makes the group one of
vLLM or SGLang servers on CPU behind ``hotweights agent`` (the tiny model; ``--engine-python``, default the
repository's ``.venv-vllm`` or ``.venv-sglang``; the servers' flags and environment those of ``bench/failover.py``),
its spares agents whose server is started and ready (``standby.agentspare``), and SIGKILL the default fault.

Measured, per fault and over all of them:

- ``time_to_redundancy_s``: from the fault to the controller's next ``redundancy_restored`` event: a serving
  primary and every other slot a ready standby (``each``: the faults after which it came, in order;
  ``never_restored`` counts the others, and ``p50`` and ``p99`` are left out when it never came);
- ``extra_latency_ms``: the longest request in flight at the fault or started within 1 s after it, minus the quiet
  p50: what the fault cost a client;
- ``client_errors``: requests that did not get the right 200, over the whole run, of which ``wrong_texts`` got a
  200 with a text other than the reference (a greedy answer of other rounding, or of other weights);
  ``errors_after_fault_s``: when each failed, in seconds after the fault before it (``errors_before_the_faults``
  counts those that failed before the first); ``split_brain_samples``;
- ``warming_slowdown``: the p50 latency of requests started while an engine or a spare was starting or warming
  up (sampled from ``GET /cluster`` every 100 ms), leaving out the 2 s after each fault (the failover's own cost),
  over the quiet p50 (left out, as ``warming_p50_ms`` is, when no request fell in such a window:
  ``warming_requests`` is then 0);
- ``engine_start_s``: the cold engine's start to ready, the scale the CPU bound is relative to (a vLLM or SGLang
  group's: its spare's, the server's start to ready);
- ``spares``: each spare's ready message at the end (the memory it holds) and how long it took to be ready;
  ``spare_ready_at_fault``: per fault, whether a spare was ready when it came (sampled every 100 ms);
- ``load_average``: the host's 1-minute load average at the start and at the end (other work on its cores).

The last stdout line is one JSON object with these.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.failover import ENGINE_ARGS, VLLM_ENV
from hotweights.cache.makemodel import PRESETS, write_checkpoint
from hotweights.chaos.clusterview import ControlApi, event_time
from hotweights.chaos.faults import Target, send
from hotweights.chaos.load import LoadGenerator, RequestRecord, reference_completion
from hotweights.chaos.scenarios import fault_storm, wait_dead
from hotweights.chaos.splitbrain import SplitBrainDetector
from hotweights.chaos.stack import DRILL_LIMITS, DrillStack, copy_logs, run_interruptible
from hotweights.controller.config import EngineSpec
from hotweights.controller.stack import Layout
from hotweights.engines import Engine
from hotweights.eventkinds import EventKind
from hotweights.ports import free_port
from hotweights.standby import sglang_nodriver
from hotweights.stats import percentile

START_TIMEOUT_S = 600.0
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
DEFAULT_SIGNALS = {Engine.REFERENCE: "kill,stop", Engine.VLLM: "kill", Engine.SGLANG: "kill"}
REPO = Path(__file__).resolve().parent.parent
PYTHONS = {Engine.VLLM: REPO / ".venv-vllm" / "bin" / "python", Engine.SGLANG: REPO / ".venv-sglang" / "bin" / "python"}
AFTER_FAULT_S = 2.0  # left out of the warming windows: the failover's own cost
IN_FAULT_S = 1.0  # requests started this soon after a fault count as hit by it


@dataclass
class Timeline:
    """When an engine or a spare was starting or warming up, and when a spare was ready, from ``GET /cluster`` every
    100 ms."""

    samples: list[tuple[float, bool, bool]] = field(default_factory=list)  # (time.time(), warming, a spare ready)

    async def run(self, api: ControlApi) -> None:
        while True:
            view = await api.cluster()
            if view is not None:
                starting = any(m["status"] == "starting" for m in view.members)
                spares = any(s["pid"] is not None and not s["ready"] for s in view.spares)
                self.samples.append((time.time(), starting or spares, any(s["ready"] for s in view.spares)))
            await asyncio.sleep(0.1)

    def last_at(self, at: float) -> tuple[float, bool, bool]:
        """The last sample at or before ``at`` (none yet: neither warming nor a spare ready)."""
        index = bisect.bisect_right(self.samples, at, key=lambda sample: sample[0])
        return self.samples[index - 1] if index else (at, False, False)

    def warming_at(self, at: float) -> bool:
        return self.last_at(at)[1]

    def spare_ready_at(self, at: float) -> bool:
        """Whether the last sample before ``at`` saw a ready spare."""
        return self.last_at(at)[2]


async def wait_full(api: ControlApi, timeout_s: float) -> None:
    """Until the stack is whole, its spares ready too."""
    if missing := await api.wait_complete(timeout_s):
        raise RuntimeError(f"the stack was not whole within {timeout_s:g} s: {missing}")


async def wait_redundant(api: ControlApi, after: float, timeout_s: float) -> str | None:
    """Until the controller records full redundancy at or after ``after`` (time.time(), the last fault); None, or
    what is still missing (its spares may still be refilling)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e["kind"] == EventKind.REDUNDANCY_RESTORED for e in await api.events(after)):
            return None
        await asyncio.sleep(0.1)
    view = await api.cluster()
    return (view and view.incomplete()) or "the controller does not answer"


async def engine_start_s(stack: DrillStack, api: ControlApi) -> float | None:
    """A plain engine of the stack's group 0, started against its daemon beside the running stack: start to ready. A
    vLLM or SGLang group's: its ready spare's, whose server started as a fresh one does (a fifth server starting
    beside the group's four would slow the primary as no fault of the run does). None, said on stderr, where it did not
    start (a fifth engine's KV pool need not fit beside the stack's on a smaller device)."""
    if stack.config.groups[0].engine != Engine.REFERENCE:
        view = await api.cluster()
        ready = [spare["prepare_s"] for spare in (view.spares if view is not None else []) if spare["ready"]]
        return max(ready, default=None)
    layout = Layout.create(stack.config, stack.config_path)
    spec = EngineSpec("bench-cold", 0, stack.config.groups[0].device, free_port())
    command = layout.engine_command(spec)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            line = await asyncio.to_thread(process.stdout.readline)  # type: ignore[union-attr]
            if '"ready"' in line:
                return time.perf_counter() - start
            errors.seek(0)
            last = (errors.read().strip().splitlines() or [""])[-1]
            print(f"the cold engine exited before it was ready (exit {process.wait()}): {last}", file=sys.stderr)
            return None  # a fifth engine's pool may not fit beside the stack's on a smaller device
        finally:
            process.kill()
            process.wait()


def engine_group(engine: Engine, python: Path, workdir: Path) -> tuple[str, str]:
    """A vLLM or SGLang group's model and ``[[groups]]`` keys: the tiny model (float32 for SGLang, whose bf16 CPU
    kernels round a prefill and decode steps differently, so that a continued completion could differ), the
    servers' flags and environment of ``bench/failover.py``."""
    dtype = torch.float32 if engine == Engine.SGLANG else torch.bfloat16
    model = write_checkpoint(workdir / "model", PRESETS["tiny"], dtype=dtype, seed=0, progress=False)
    if engine == Engine.VLLM:
        env = VLLM_ENV
    else:
        env = sglang_nodriver.environment(workdir / "nodriver", {"HF_HUB_OFFLINE": "1"})
    table = ", ".join(f"{key} = {json.dumps(value)}" for key, value in env.items())
    group = f'engine = "{engine}"\nengine_python = "{python}"\nengine_args = {json.dumps(ENGINE_ARGS[engine])}\n'
    return str(model), group + f"engine_env = {{ {table} }}\n"


def latency(record: RequestRecord) -> float:
    return (record.end - record.start) * 1000


def since_fault(at: float, faults: list[float]) -> float | None:
    """Seconds from the last fault before ``at`` (None: before the first)."""
    last = max((f for f in faults if f <= at), default=None)
    return None if last is None else round(at - last, 2)


def summarize(
    faults: list[float],
    events: list[dict[str, Any]],
    records: list[RequestRecord],
    quiet_p50: float,
    timeline: Timeline,
) -> dict[str, Any]:
    restored = sorted(event_time(e) for e in events if e["kind"] == EventKind.REDUNDANCY_RESTORED)
    to_redundancy = [next((t - at for t in restored if t >= at), None) for at in faults]
    extra = []
    for at in faults:
        hit = [latency(r) for r in records if r.start <= at + IN_FAULT_S and r.end >= at]
        if not hit:
            raise RuntimeError(
                f"no request was in flight at the fault at {at:.3f} or started {IN_FAULT_S:g} s after it"
            )
        extra.append(round(max(hit) - quiet_p50, 1))
    calm = [r for r in records if not any(at - 0.5 <= r.start <= at + AFTER_FAULT_S for at in faults)]
    warming = [latency(r) for r in calm if r.ok and faults[0] <= r.start and timeline.warming_at(r.start)]
    restored_s = [t for t in to_redundancy if t is not None]
    quantiles = {"p50": percentile(restored_s, 50), "p99": percentile(restored_s, 99)} if restored_s else {}
    slowdown = {
        "warming_p50_ms": round(percentile(warming, 50), 1),
        "warming_slowdown": round(percentile(warming, 50) / quiet_p50, 3),
    } if warming else {}  # fmt: skip
    return {
        "spare_ready_at_fault": [timeline.spare_ready_at(at) for at in faults],
        "time_to_redundancy_s": quantiles | {"each": [round(t, 3) for t in restored_s]},
        "never_restored": len(faults) - len(restored_s),
        "extra_latency_ms": {"max": max(extra), "each": extra},
        "warming_requests": len(warming),
        **slowdown,
    }


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model, group = args.model or "", ""
    if args.engine != Engine.REFERENCE:
        model, group = engine_group(args.engine, args.engine_python or PYTHONS[args.engine], workdir)
    stack = DrillStack.create(
        workdir, "gateway", proxied=False, model=model, device=args.device,
        spare_engines=args.spare_engines, spare_duty=args.spare_duty,
        limits=replace(
            DRILL_LIMITS, batch_invariant=args.batch_invariant, queue_budget_s=args.queue_budget
        ), group=group,
    )  # fmt: skip
    load_average = [os.getloadavg()[0]]
    api = stack.control_api()
    detector = SplitBrainDetector(stack.direct_urls())
    timeline = Timeline()
    faults: list[float] = []  # time.time() of each
    targets: list[Target] = []

    def hit(target: Target, sig: signal.Signals) -> None:
        faults.append(time.time())
        targets.append(target)
        send(target, sig)

    try:
        stack.start()
        await wait_full(api, START_TIMEOUT_S)
        async with httpx.AsyncClient() as client:
            reference = await reference_completion(client, stack.lb_url)
            load = LoadGenerator(stack.lb_url, args.rps, reference)
            async with detector.running(), load.running():
                await wait_full(api, START_TIMEOUT_S)
                quiet_from = time.time()
                await asyncio.sleep(args.quiet)
                quiet_until = time.time()
                cold_s = await engine_start_s(stack, api)
                polling = asyncio.create_task(timeline.run(api))  # sampling before the first fault
                await wait_full(api, START_TIMEOUT_S)
                signals = tuple(SIGNALS[name] for name in args.signals.split(","))
                problem = await fault_storm(api, args.faults, args.interval, signals, hit)
                for target in targets:
                    await wait_dead(target)
                recovered = await wait_redundant(api, max(faults, default=0.0), args.recovery_timeout)
                await asyncio.sleep(1.0)
                polling.cancel()
            events = await api.events(faults[0] if faults else quiet_from)
            view = await api.cluster()
            spares = view.spares if view is not None else []
            load_average.append(os.getloadavg()[0])
            records = [r for r in load.records if r.start >= quiet_from]
    finally:
        for target in targets:
            send(target, signal.SIGCONT)
        await api.aclose()
        if args.keep_logs:
            copy_logs(Path(args.keep_logs), stack.workdir, stack.config.state_dir)
        await asyncio.to_thread(stack.teardown)
    # the quiet window's requests, each answered by now (a slow engine's may end after the window)
    quiet = [latency(r) for r in records if r.start < quiet_until and r.ok]
    quiet_p50 = percentile(quiet, 50) if quiet else float("nan")  # nan: none answered (the load beyond the engines)
    failed_at = [since_fault(r.start, faults) for r in records if not r.ok]  # None: before the first fault
    result = {
        "engine": args.engine,
        "faults": len(faults),
        "interval_s": args.interval,
        "signals": args.signals,
        "spare_engines": args.spare_engines,
        "spare_duty": args.spare_duty,
        "batch_invariant": args.batch_invariant,
        "queue_budget_s": args.queue_budget,
        "engine_start_s": None if cold_s is None else round(cold_s, 3),
        "quiet_requests": len(quiet),
        "quiet_p50_ms": round(quiet_p50, 1),
        "requests": len(records),
        "client_errors": sum(not r.ok for r in records),
        "wrong_texts": sum(r.status == 200 and r.correct is False for r in records),
        "errors": sorted({f"{r.status}: {r.error[:120]}" for r in records if not r.ok})[:5],
        "errors_after_fault_s": [t for t in failed_at if t is not None][:20],
        "errors_before_the_faults": failed_at.count(None),
        "split_brain_samples": len(detector.samples),
        "spares": spares,
        "load_average": load_average,
        "problem": problem
        or (recovered and f"no full redundancy {args.recovery_timeout:g} s after the faults: {recovered}")
        or (None if quiet else "no request of the quiet window was answered"),
    }
    return result | summarize(faults, events, records, quiet_p50, timeline)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Engine, choices=list(Engine), default=Engine.REFERENCE)
    parser.add_argument("--engine-python", help="with --engine vllm|sglang: a Python with it and hotweights")
    parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rps", type=float, default=10.0)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--interval", type=float, default=8.0, help="seconds between faults (default 8)")
    parser.add_argument(
        "--signals", help="comma-separated kill/stop, cycled (default kill,stop; kill with --engine vllm|sglang)"
    )
    parser.add_argument("--spare-engines", type=int, default=1, help="the group's warmed spares (default 1)")
    parser.add_argument("--spare-duty", type=float, help="the group's spare_duty (default: cluster.toml's default)")
    parser.add_argument("--batch-invariant", action="store_true", help="the engines' engine.batch_invariant")
    parser.add_argument(
        "--queue-budget",
        type=float,
        default=DRILL_LIMITS.queue_budget_s,
        help="the engines' engine.queue_budget_s (default %(default)s)",
    )
    parser.add_argument("--keep-logs", metavar="DIR", help="copy the stack's logs here at the end")
    parser.add_argument("--quiet", type=float, default=5.0, help="seconds of the quiet window (default 5)")
    parser.add_argument("--recovery-timeout", type=float, default=120.0)
    args = parser.parse_args()
    args.signals = args.signals or DEFAULT_SIGNALS[args.engine]
    if args.engine != Engine.REFERENCE and (args.model or args.device != "cpu"):
        parser.error(f"--engine {args.engine} runs the tiny model on cpu: leave out --model and --device")
    if unknown := [s for s in args.signals.split(",") if s not in SIGNALS]:
        parser.error(f"--signals: unknown {unknown}; choose from {sorted(SIGNALS)}")
    with tempfile.TemporaryDirectory(prefix="hwredundancy-") as workdir:
        result = run_interruptible(run(args, Path(workdir)))
    if result is None:
        print("interrupted: everything started was stopped", file=sys.stderr)
        return 130
    print(json.dumps(result))
    return 0 if not result["problem"] else 1


if __name__ == "__main__":
    sys.exit(main())
