"""``hotweights drill``: bring up (or attach to) a stack, load it, inject faults round by round, report.

Rounds cycle through the chosen scenarios (``--rounds`` in all; default one of each). Before every
round the cluster must be whole (one healthy primary, ready standbys, daemon and gateway serving);
after the fault the drill waits until it is whole again, then keeps the load running briefly so the
first successes after the fault are seen. Load and the split-brain detector run for the whole drill.
With ``--hosts N --dcs etcd`` the stack is N simulated hosts around an etcd (``hosts.HostsStack``, asked
through every host's controller) and the rounds default to the faults of several hosts (``hostscenarios``).

Exit code 1 when any round saw a split-brain sample, a wrong output, a leak, a broken scenario
promise, or (``--lb gateway``) a client-visible error; 0 otherwise; 130 when interrupted. SIGINT or
SIGTERM only sets a flag and cancels the round in progress: its cleanup (SIGCONT, delays cleared)
and the teardown of everything the drill started still run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hotweights.cache.makemodel import ensure_default_model
from hotweights.chaos import memory
from hotweights.chaos.clusterview import ControlApi, lb_retries
from hotweights.chaos.hosts import HostsStack
from hotweights.chaos.hostscenarios import HOST_DEFAULT, SCENARIOS
from hotweights.chaos.load import STREAM_EVERY, LoadGenerator, reference_completion
from hotweights.chaos.measure import RoundResult, apply_events, apply_requests
from hotweights.chaos.report import write_report
from hotweights.chaos.scenarios import SCENARIOS as ONE_HOST_SCENARIOS
from hotweights.chaos.scenarios import STORM_FAULTS, STORM_INTERVAL_S, ModelUpdate, Round, Scenario, Storm
from hotweights.chaos.splitbrain import SplitBrainDetector
from hotweights.chaos.stack import DrillStack
from hotweights.errors import ConfigError, HotweightsError
from hotweights.stats import whole_ms

log = logging.getLogger(__name__)

MAX_HOSTS = 9  # simulated host names must not prefix one another (host1, host10)
START_TIMEOUT_S = 180.0  # the first start may generate the tiny model and load it from disk
DISTURBED_WAIT_S = 1.0  # how long to wait for the controller to notice before judging "whole again"
PRE_FAULT_S = 0.3  # load before the fault, so there is a last success to measure from
POST_RECOVERY_S = 0.5  # load after recovery, so the first successes after the fault are in


@dataclass
class Drill:
    stack: DrillStack | HostsStack
    api: ControlApi
    detector: SplitBrainDetector
    load: LoadGenerator
    metrics_client: httpx.AsyncClient
    recovery_timeout_s: float  # how long the cluster may take to be whole again (a new standby included)
    results: list[RoundResult] = field(default_factory=list)

    async def run_round(self, scenario: Scenario, index: int) -> RoundResult:
        result = RoundResult(
            scenario.name,
            index,
            time.time(),
            client_errors_expected=scenario.client_errors_expected,
            suspects_expected=scenario.suspects_expected,
        )
        if reason := scenario.skip_reason(self.stack):
            result.skipped = reason
            return result
        if missing := await self.api.wait_complete(self.recovery_timeout_s):
            result.problem = f"the cluster was not whole before the round: {missing}"
            return result
        view = await self.api.cluster()
        assert view is not None
        await asyncio.sleep(PRE_FAULT_S)
        before = await asyncio.to_thread(memory.snapshot, self.stack.markers)
        retries = await lb_retries(self.metrics_client, self.stack.lb_url)
        samples = len(self.detector.samples)
        r = Round(self.stack, self.api, view)
        try:
            try:
                await scenario.inject(r)
                await scenario.settle(r)
            except RuntimeError as exc:  # the process to hurt was not there
                r.problem = str(exc)
            await self.wait_disturbed()
            missing = await self.api.wait_complete(self.recovery_timeout_s)
            result.recovered_at = time.time()
            await asyncio.sleep(POST_RECOVERY_S)
        finally:
            await scenario.cleanup(r)
        after_view = await self.api.cluster()
        after = await asyncio.to_thread(memory.snapshot, self.stack.markers)
        result.fault_at, result.later_faults = r.fault_at or None, r.later_faults
        result.problem = (
            r.problem
            or (missing and f"not whole {self.recovery_timeout_s:g} s after the fault: {missing}")
            or (after_view and scenario.verify(r, after_view))
            or None
        )
        result.memory_before, result.memory_after = before.to_json(), after.to_json()
        result.leak = memory.leak(before, after, scenario.respawns_daemon)
        if retries is not None and (now := await lb_retries(self.metrics_client, self.stack.lb_url)) is not None:
            result.retried = int(now - retries) if now >= retries else int(now)  # a restarted gateway starts at 0
        result.split_brain = len(self.detector.samples) - samples
        if result.fault_at:
            apply_events(result, await self.api.events(result.fault_at), {t.name for t in r.targets})
        return result

    async def wait_disturbed(self) -> None:
        """Until the controller shows the fault (or DISTURBED_WAIT_S), so "whole" is not judged too early."""
        deadline = time.monotonic() + DISTURBED_WAIT_S
        while time.monotonic() < deadline:
            view = await self.api.cluster()
            if view is None or view.incomplete():
                return
            await asyncio.sleep(0.02)


def plan(names: list[str], rounds: int | None, options: dict[str, dict[str, Any]] | None = None) -> list[Scenario]:
    """``rounds`` rounds cycling through ``names`` (default: one round of each); ``options``: keyword arguments of
    the scenarios that take some, by name."""
    scenarios = [SCENARIOS[name](**(options or {}).get(name, {})) for name in names]
    total = len(scenarios) if rounds is None else rounds
    return [scenarios[i % len(scenarios)] for i in range(total)]


def progress(result: RoundResult, total: int, judge: bool) -> None:
    if result.skipped:
        line = f"skipped: {result.skipped}"
    else:
        parts = [f"{name} {whole_ms(value)} ms" for name, value in (
            ("outage", result.outage_ms), ("detect", result.detection_ms), ("promote", result.promotion_ms),
        ) if value is not None]  # fmt: skip
        failures = result.failures(judge)
        parts.append("FAIL: " + "; ".join(failures) if failures else "ok")
        line = ", ".join(parts)
    print(f"[{result.index + 1}/{total}] {result.scenario}: {line}", file=sys.stderr, flush=True)


async def drill(args: argparse.Namespace, stack: DrillStack | HostsStack) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    default = HOST_DEFAULT if isinstance(stack, HostsStack) else list(ONE_HOST_SCENARIOS)
    storm = {"faults": args.storm_faults, "interval_s": args.storm_interval}
    rounds = plan(args.scenarios or default, args.rounds, {Storm.name: storm})
    judge = args.lb == "gateway"
    api = stack.control_api()
    async with httpx.AsyncClient() as client:
        try:
            stack.start()
            await until(stop, wait_up(stack, api))
            reference = await until(stop, reference_completion(client, stack.lb_url))
            updates = isinstance(stack, DrillStack) and stack.owned and any(isinstance(s, ModelUpdate) for s in rounds)
            also = (await asyncio.to_thread(stack.make_other_model),) if updates else ()
            load = LoadGenerator(stack.lb_url, args.rps, reference, also=also, stream_every=args.stream_every)
            detector = SplitBrainDetector(stack.direct_urls())
            d = Drill(stack, api, detector, load, client, args.recovery_timeout)
            began = time.time()
            async with detector.running(), load.running():
                for index, scenario in enumerate(rounds):
                    result = await until(stop, d.run_round(scenario, index))
                    if result is None:
                        break
                    result.ended_at = time.time()
                    d.results.append(result)
                    apply_requests(result, load.records, float("inf"))
                    progress(result, len(rounds), judge)
            for i, result in enumerate(d.results):  # now every request has answered: the final numbers
                until_next = d.results[i + 1].started_at if i + 1 < len(d.results) else float("inf")
                apply_requests(result, load.records, until_next)
            failures = [f"{r.scenario}#{r.index + 1}: {f}" for r in d.results for f in r.failures(judge)]
            summary = write_report(Path(args.report), args, d.results, load.records, detector.sweeps, began)
            print(f"report: {summary}", file=sys.stderr)
            for line in failures:
                print(f"FAIL {line}", file=sys.stderr)
            if stop.is_set():
                return 130
            return 1 if failures else 0
        finally:
            await api.aclose()
            for line in await asyncio.to_thread(stack.teardown):
                log.info("teardown: %s", line)


async def wait_up(stack: DrillStack | HostsStack, api: ControlApi) -> None:
    """Until the stack is whole; HotweightsError if our ``up`` exits or START_TIMEOUT_S passes first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while (missing := await api.wait_complete(0.5)) is not None:
        if failure := stack.start_failure():
            raise HotweightsError(failure)
        if time.monotonic() > deadline:
            raise HotweightsError(f"the stack did not come up within {START_TIMEOUT_S:g} s: {missing}")


async def until(stop: asyncio.Event, work: Awaitable[Any]) -> Any:
    """``work``'s result, or None once ``stop`` is set (``work`` is then cancelled, running its cleanups)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def cmd_drill(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the progress
    unknown = [name for name in args.scenarios if name not in SCENARIOS]
    if unknown:
        raise ConfigError(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
    if args.attach_running and not args.config:
        raise ConfigError("--attach-running needs --config: the cluster.toml of the running stack")
    if args.rps <= 0:
        raise ConfigError(f"--rps must be > 0, found {args.rps}")
    if args.stream_every < 0:
        raise ConfigError(f"--stream-every must be >= 0 (0: no streams), found {args.stream_every}")
    if args.storm_faults < 1 or args.storm_interval <= 0:
        found = f"{args.storm_faults} and {args.storm_interval}"
        raise ConfigError(f"--storm-faults must be >= 1 and --storm-interval > 0, found {found}")
    if args.spare_engines is not None and args.spare_engines < 0:
        raise ConfigError(f"--spare-engines must be >= 0, found {args.spare_engines}")
    with contextlib.ExitStack() as cleanup:
        if args.workdir:
            workdir = Path(args.workdir).resolve()
        else:
            workdir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="hwdrill-")))
        stack: DrillStack | HostsStack
        if args.dcs:
            stack = hosts_stack(args, workdir)
        elif args.attach_running:
            stack = DrillStack.attach(Path(args.config), workdir, args.lb)
        elif args.config:
            raise ConfigError("--config names a running stack: add --attach-running (the drill starts its own without)")
        else:
            needs_proxy = any(SCENARIOS[name].needs_proxy for name in args.scenarios or SCENARIOS)
            batch = args.tp_size == 1 and any(SCENARIOS[name].needs_batch for name in args.scenarios or SCENARIOS)
            stack = DrillStack.create(
                workdir, args.lb, proxied=needs_proxy, model=args.model or "", device=args.device,
                tp_size=args.tp_size, batch=batch, spare_engines=args.spare_engines,
            )  # fmt: skip
        return asyncio.run(drill(args, stack))


def hosts_stack(args: argparse.Namespace, workdir: Path) -> HostsStack:
    """``--hosts N --dcs etcd``: simulated hosts around an etcd of the drill's own (ConfigError: not possible)."""
    if args.attach_running or args.lb != "gateway":
        raise ConfigError("--dcs etcd drills its own simulated hosts through the gateway: drop --attach-running/--lb")
    if not 2 <= args.hosts <= MAX_HOSTS:
        raise ConfigError(f"--hosts must be 2..{MAX_HOSTS} with --dcs etcd (127.0.0.2 and on), found {args.hosts}")
    if shutil.which("etcd") is None:
        raise ConfigError("--dcs etcd needs the etcd binary (apt-get install -y etcd-server)")
    model = Path(args.model) if args.model else ensure_default_model()
    return HostsStack(workdir, args.hosts, model, args.device, args.ttl)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "drill",
        help="chaos drill: inject faults under load, measure failover, write a report",
        description="Start a stack (the embedded tiny model on CPU) or attach to a running one, drive steady "
        "load through the load balancer, inject each scenario's fault, wait for recovery and measure detection, "
        "fence, promotion, LB convergence, client-visible outage, errors, split brain, output and memory. "
        f"Scenarios: {', '.join(SCENARIOS)}.",
    )
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO", help="scenarios to run (default: all)")
    p.add_argument("--config", help="cluster.toml of a running stack (with --attach-running)")
    p.add_argument("--attach-running", action="store_true", help="drill the running stack of --config")
    p.add_argument("--model", help="own stack: checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--device", default="cpu", help="own stack: cpu or cuda:N (default cpu)")
    p.add_argument("--tp-size", type=int, default=1, help="own stack: ranks per engine, a daemon per rank (default 1)")
    p.add_argument("--lb", choices=["gateway", "haproxy"], default="gateway", help="load balancer (default gateway)")
    p.add_argument("--rounds", type=int, help="rounds in all, cycling through the scenarios (default: one each)")
    p.add_argument("--rps", type=float, default=10.0, help="client requests per second (default 10)")
    p.add_argument(
        "--stream-every",
        type=int,
        default=STREAM_EVERY,
        metavar="N",
        help=f"stream every Nth request; a stream cut mid-way fails the round (0: none; default {STREAM_EVERY})",
    )
    p.add_argument(
        "--recovery-timeout",
        type=float,
        default=60.0,
        help="seconds the cluster may take to be whole again after a fault, its new standby ready (default 60; "
        "vLLM standbys start in minutes on CPU)",
    )
    p.add_argument(
        "--spare-engines",
        type=int,
        help="own stack: the group's warmed spare engines (default: cluster.toml's default, 1)",
    )
    p.add_argument(
        "--storm-faults", type=int, default=STORM_FAULTS, help=f"storm: faults per round (default {STORM_FAULTS})"
    )
    p.add_argument(
        "--storm-interval",
        type=float,
        default=STORM_INTERVAL_S,
        help=f"storm: seconds between its faults (default {STORM_INTERVAL_S:g})",
    )
    p.add_argument("--hosts", type=int, default=1, help="with --dcs etcd: simulated hosts, one engine each (2..9)")
    p.add_argument("--dcs", choices=["etcd"], help="simulate --hosts hosts coordinating through an etcd of its own")
    p.add_argument("--ttl", type=int, default=2, help="with --dcs: the leader lease in seconds (default 2)")
    p.add_argument("--report", required=True, metavar="DIR", help="where report.json, summary.md, timeline.png go")
    p.add_argument("--workdir", help="keep the drill's stack (config, state, logs) here (default: a temp dir, removed)")
    p.set_defaults(func=cmd_drill)
