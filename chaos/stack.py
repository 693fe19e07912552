"""The stack a drill runs against: one it starts (and always tears down) or one already running.

An own stack lives in a fresh directory: its cluster.toml (free ports, health timings near the defaults, small KV
cache), its state dir, and every log. It runs ``hotweights up`` in its own session; a killed
controller is replaced by ``hotweights controller``, which re-adopts the running processes. With
fault proxies, its cluster.toml sets ``listen_base_port``: engines listen on private ports and a proxy
process listens on each engine's public port (``base_port + i``, where every client connects), so
controller checks and load-balancer traffic all pass through it. Teardown: ``hotweights down``, then
SIGKILL to anything still naming its config or state dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hotweights.admission import ServingLimits
from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.makemodel import ensure_default_model, write_checkpoint
from hotweights.chaos.clusterview import ControlApi
from hotweights.chaos.faults import Target
from hotweights.chaos.load import MAX_TOKENS, PROMPT
from hotweights.chaos.memory import stack_pids
from hotweights.controller.config import ClusterConfig, load_config
from hotweights.errors import ConfigError, HotweightsError
from hotweights.ports import free_ports
from hotweights.spawn import hotweights_command
from hotweights.state import read_state

ENGINES = 3  # one primary and two standbys
# On CPU the health timeout gets room over the shipped 200 ms: a 2-core CI machine runs the whole stack and
# the load on its cores; on a GPU host the drill runs the shipped defaults.
CPU_HEALTH = "[health]\ntimeout_ms = 250\n"
DOWN_TIMEOUT_S = 30.0
# Each engine's limits: the shipped ones (``[engine]``'s defaults), so that a drill measures what users run.
DRILL_LIMITS = ServingLimits()

CONFIG_TEMPLATE = """\
# Written by `hotweights drill` for its own stack.
[cluster]
name = "drill"
port = {controller_port}
state_dir = "{state_dir}"

[model]
path = "{model}"

[[groups]]
device = "{device}"
engines = {engines}
tp_size = {tp_size}
base_port = {base_port}
{listen_base_port}{batch_port}{spares}{group}
[engine]
{engine}
{health}
[gateway]
port = {gateway_port}
hold_timeout_s = 15.0
"""


T = TypeVar("T")


def engine_section(limits: ServingLimits) -> str:
    """``limits`` as the body of cluster.toml's ``[engine]`` section, every field."""
    return "".join(f"{name} = {json.dumps(value)}\n" for name, value in asdict(limits).items())


def copy_logs(into: Path, workdir: Path, state_dir: Path) -> None:
    """A stack's logs copied into ``into``: those in ``workdir`` (``up``'s, the controller's) and in its state dir's
    ``logs`` (every engine's, spare's, daemon's and gateway worker's)."""
    into.mkdir(parents=True, exist_ok=True)
    for log in [*workdir.glob("*.log"), *(state_dir / "logs").glob("*.log")]:
        shutil.copy(log, into / log.name)


def run_interruptible(work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s result, run on an event loop of its own; SIGINT or SIGTERM cancels it, so that its ``finally``
    blocks stop what it started (a bench killed by ``timeout`` leaves nothing running): None then."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(work)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return loop.run_until_complete(task)
    except asyncio.CancelledError:
        return None
    finally:
        loop.close()


@dataclass
class DrillStack:
    config_path: Path
    config: ClusterConfig
    workdir: Path
    owned: bool  # started by us: we stop it
    lb: str  # gateway | haproxy
    proxy_map: dict[int, int] = field(default_factory=dict)  # our fault proxies: engine public port -> private
    lb_port: int = 0
    started: list[subprocess.Popen] = field(default_factory=list)
    up: subprocess.Popen | None = None
    proxy: subprocess.Popen | None = None
    haproxy: subprocess.Popen | None = None
    models: tuple[Path, Path] | None = None  # the stack's model and the other one the model-update scenario uses

    @classmethod
    def create(
        cls,
        workdir: Path,
        lb: str,
        proxied: bool,
        model: str = "",
        device: str = "cpu",
        tp_size: int = 1,
        batch: bool = False,
        spare_engines: int | None = None,
        spare_duty: float | None = None,
        limits: ServingLimits = DRILL_LIMITS,
        group: str = "",
    ) -> DrillStack:
        """Write the config of a fresh stack in ``workdir`` (default: the embedded tiny model on CPU; engines of
        ``tp_size`` ranks, a daemon per rank; ``batch``: with a co-located batch engine; ``spare_engines``,
        ``spare_duty``: the group's, instead of the defaults; ``limits``: each engine's ``[engine]`` section;
        ``group``: more keys of the ``[[groups]]`` table, one a line, e.g. a vLLM group's)."""
        workdir.mkdir(parents=True, exist_ok=True)
        controller_port, gateway_port, lb_port, batch_port = free_ports(4)
        ports = free_ports(2 * ENGINES if proxied else ENGINES, consecutive=True)  # public, then private
        engine_ports, private_ports = ports[:ENGINES], ports[ENGINES:]
        path = workdir / "cluster.toml"
        path.write_text(
            CONFIG_TEMPLATE.format(
                controller_port=controller_port,
                gateway_port=gateway_port,
                state_dir=workdir / "state",
                model=str(Path(model).resolve()) if model else "",
                device=device,
                health=CPU_HEALTH if device == "cpu" else "",
                engines=ENGINES,
                tp_size=tp_size,
                base_port=engine_ports[0],
                listen_base_port=(
                    f"listen_base_port = {private_ports[0]}  # engines listen here; our fault proxies on base_port\n"
                    if proxied
                    else ""
                ),
                engine=engine_section(limits),
                batch_port=f"batch_port = {batch_port}  # a co-located batch engine\n" if batch else "",
                spares=(f"spare_engines = {spare_engines}\n" if spare_engines is not None else "")
                + (f"spare_duty = {spare_duty}\n" if spare_duty is not None else ""),
                group=group,
            )
        )
        config = load_config(path)
        proxy_map = {spec.port: spec.listen_port for spec in config.engines() if spec.listen_port != spec.port}
        stack = cls(path, config, workdir, owned=True, lb=lb, proxy_map=proxy_map)
        stack.lb_port = lb_port if lb == "haproxy" else gateway_port
        return stack

    @classmethod
    def attach(cls, config_path: Path, workdir: Path, lb: str) -> DrillStack:
        config = load_config(config_path)
        stack = cls(config_path, config, workdir, owned=False, lb=lb)
        stack.lb_port = free_ports(1)[0] if lb == "haproxy" else config.gateway.port
        return stack

    # --- addresses -------------------------------------------------------------------------------

    @property
    def controller_url(self) -> str:
        return f"http://{self.config.cluster.host}:{self.config.cluster.port}"

    def control_api(self) -> ControlApi:
        """The controller's REST API, as the drill asks it."""
        return ControlApi(self.controller_url, self.config.token())

    @property
    def lb_url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    @property
    def batch_url(self) -> str | None:
        """The group's batch engine, where its clients connect (None: the stack has none)."""
        port = self.config.groups[0].batch_port
        return f"http://127.0.0.1:{port}" if port else None

    def direct_urls(self) -> list[str]:
        """The engines themselves, behind any proxy: where the split-brain detector asks."""
        return [f"http://127.0.0.1:{spec.listen_port}" for spec in self.config.engines()]

    @property
    def markers(self) -> tuple[str, ...]:
        """Every process of the stack names one of these: the config (controller, gateway; only ours is
        surely an absolute path) or the state dir (daemons and engines, through their socket path)."""
        return (str(self.config_path), str(self.config.state_dir)) if self.owned else (str(self.config.state_dir),)

    # --- processes -------------------------------------------------------------------------------

    def spawn(self, name: str, command: list[str], **kwargs: object) -> subprocess.Popen:
        """A process of ours in its own session, output to ``workdir/name.log``; killed at teardown."""
        with open(self.workdir / f"{name}.log", "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True, **kwargs)
        self.started.append(process)
        return process

    def start(self) -> None:
        """Start whatever the drill itself provides: proxies and the stack (own stack), HAProxy (--lb haproxy)."""
        if self.proxy_map:
            pairs = [f"{public}={private}" for public, private in self.proxy_map.items()]
            self.proxy = self.spawn("proxy", hotweights_command("drill-proxy", *pairs), stdin=subprocess.PIPE)
        if self.owned:
            self.up = self.spawn("up", self.cli("up"))
        if self.lb == "haproxy":
            self.start_haproxy()

    def make_other_model(self) -> str:
        """Write a second checkpoint of the stack's model's shape (another seed) into the workdir, for model
        updates, and return its greedy answer to the drill's prompt (``hotweights generate``, on the stack's
        device)."""
        model = Path(self.config.model.path).resolve() if self.config.model.path else ensure_default_model()
        known = read_checkpoint(model)
        device = self.config.groups[0].device
        other = write_checkpoint(
            self.workdir / "other-model", known.config, dtype=known.dtype, quant=known.config.quant, seed=1,
            device="cuda" if device.startswith("cuda") else "cpu", progress=False, overwrite=True,
        )  # fmt: skip
        self.models = (model, other)
        command = hotweights_command("generate", "--model", str(other), "--device", device, "--prompt", PROMPT)
        command += ["--max-tokens", str(MAX_TOKENS)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise HotweightsError(f"hotweights generate on {other} exited with {done.returncode}: {done.stderr[-300:]}")
        return done.stdout.removesuffix("\n")

    def cli(self, command: str, *extra: str) -> list[str]:
        return hotweights_command(command, "--config", str(self.config_path), *extra)

    def restart_controller(self) -> None:
        """A fresh ``hotweights controller``: it must adopt the running engines, daemon and gateway. It is
        the cluster's controller from now on, so teardown leaves it to ``down`` (never to our SIGKILL)."""
        log_dir = self.config.state_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / "controller-restarted.log", "ab") as log:
            subprocess.Popen(self.cli("controller"), stdout=log, stderr=log, start_new_session=True)

    def start_failure(self) -> str | None:
        """None while our ``up`` runs (or there is none); else its exit code and the end of its log."""
        if self.up is None or self.up.poll() is None:
            return None
        tail = (self.workdir / "up.log").read_text(errors="replace").strip().splitlines()[-5:]
        return f"hotweights up exited with {self.up.returncode}: " + " | ".join(tail)

    def controller_target(self) -> Target | None:
        """The controller's process, from the state file it keeps."""
        try:
            controller = read_state(self.config.state_file).controller
        except ConfigError:
            return None
        return Target.of("controller", controller.pid) if controller else None

    def start_haproxy(self) -> None:
        cfg = self.workdir / "haproxy.cfg"
        subprocess.run(self.cli("haproxy-config", "--port", str(self.lb_port), "-o", str(cfg)), check=True)
        self.haproxy = self.spawn("haproxy", ["haproxy", "-db", "-f", str(cfg)])

    def haproxy_target(self) -> Target | None:
        return Target.of("haproxy", self.haproxy.pid) if self.haproxy else None

    def set_delay(self, public_port: int, seconds: float) -> None:
        """Delay every byte to and from the engine on ``public_port`` (the proxy applies it to new reads)."""
        assert self.proxy is not None and self.proxy.stdin is not None, "the stack runs without fault proxies"
        self.proxy.stdin.write(f"{public_port} {seconds}\n".encode())
        self.proxy.stdin.flush()

    def teardown(self) -> list[str]:
        """Stop all we started, in order: the stack (``down``), then our own processes, then stragglers."""
        lines = []
        if self.owned:
            down = subprocess.run(self.cli("down", "--timeout", "5"), capture_output=True, text=True, timeout=120)
            lines += down.stderr.strip().splitlines()
        for process in reversed(self.started):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        if self.owned:  # a straggler: something the controller started that `down` did not know about
            for pid in stack_pids(self.markers):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                lines.append(f"killed straggler pid {pid}")
        for process in self.started:
            if process.stdin:
                process.stdin.close()
        return lines
