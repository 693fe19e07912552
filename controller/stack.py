"""What the controller runs: the paths and command lines of a cluster's daemons, engines and gateway.

The controller passes every daemon an explicit ``--socket`` under ``state_dir/run`` and gives the
engines of its group the same path, so engines and daemon agree without recomputing fingerprints.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hotweights.cache.launcher import daemon_command
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.paths import DaemonPaths
from hotweights.contract import Role
from hotweights.controller.checks import default_model, never, tensor_parallel_refusals
from hotweights.controller.config import ClusterConfig, EngineSpec
from hotweights.controller.ids import spare_engine_id
from hotweights.controller.sockets import run_dir
from hotweights.dtypes import model_config_name
from hotweights.engines import KINDS, LOAD_FORMAT, PORT_PLACEHOLDER, SERVED_NAME_FLAG, SOCKET_RANK, Engine
from hotweights.errors import ConfigError, HotweightsError
from hotweights.paths import private_dir, runtime_dir
from hotweights.spawn import hotweights_command

MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the NUL


def cpu_threads(config: ClusterConfig, cores: int) -> int:
    """The threads each CPU engine of ``config`` may use: the host's ``cores`` shared out among every engine,
    spare engine and batch engine of its CPU groups, at least one. Each would otherwise use every core, so that
    engines warming up beside a serving primary (or several at once after a fault) oversubscribe the cores, and
    torch's threads spin at their barriers while their siblings wait for a core (measured on 2 cores beside other
    work: one engine's warm-up 0.29 s on one thread, 4.2 s on two)."""
    return max(1, cores // max(1, config.engines_on("cpu")))


def controller_lock(state_dir: Path) -> Path:
    """The lock the stack's controller holds for its life (``supervisor.ControllerLock``), with its pid."""
    return state_dir / "controller.lock"


@dataclass(frozen=True)
class Generation:
    """A group's weights: generation 0 is cluster.toml's ``[model]``, each model update the next one, served
    by a daemon of its own (its own socket) until its last engine is gone."""

    number: int
    model_dir: Path

    @property
    def weights_id(self) -> str:
        """What its agents name as their weights (``agent --weights-id``): the same for every engine of this
        generation, another for the next one."""
        return hashlib.sha256(f"{self.number}:{self.model_dir}".encode()).hexdigest()[:16]


def check_directories(config: ClusterConfig) -> None:
    """ConfigError in one line unless the state directory (state.json, pid records, sockets, logs) and the
    runtime directory (where the daemons publish themselves) are ours and only we can write them; each is
    made owner-only if missing."""
    private_dir(config.state_dir, "state directory")
    private_dir(runtime_dir(), "runtime directory")


@dataclass(frozen=True)
class Layout:
    config: ClusterConfig
    config_path: Path | None  # handed to the gateway; None: the defaults
    model_dir: Path

    @classmethod
    def create(cls, config: ClusterConfig, config_path: Path | None, stopped: Callable[[], bool] = never) -> Layout:
        """Resolve the model (a relative [model] path is relative to the config file; none: the embedded
        tiny model, generated on first use) and check that it is a directory and that the socket paths fit.
        ``stopped``: the checking processes' (``controller.checks``)."""
        if config.model.path:
            model_dir = Path(config.model.path).expanduser()
            if not model_dir.is_absolute() and config_path is not None:
                model_dir = config_path.parent / model_dir
            if not model_dir.is_dir():
                found = "is not a directory" if model_dir.exists() else "does not exist"
                raise ConfigError(f"{config.source}: model.path: {model_dir} {found}")
        else:
            model_dir = default_model(stopped)
        layout = cls(config, config_path.resolve() if config_path else None, model_dir.resolve())
        check_directories(config)
        layout.check_tensor_parallel(stopped)
        longest = max(
            (layout.socket(len(config.groups) - 1), layout.gateway_probe_socket(config.gateway.worker_ids()[-1])),
            key=lambda path: len(str(path)),
        )
        if len(str(longest)) > MAX_SOCKET_PATH:
            raise ConfigError(
                f"{config.source}: cluster.state_dir gives a socket path of {len(str(longest))} bytes "
                f"({longest}); Unix sockets allow {MAX_SOCKET_PATH}: choose a shorter state_dir"
            )
        return layout

    def check_tensor_parallel(self, stopped: Callable[[], bool] = never) -> None:
        """Refuse a ``tp_size`` the model cannot be split by, or more ranks than this host has GPUs, naming the
        group, before anything starts (its daemons and engines would each refuse it, over and over). The checks
        run in one checking process (``controller.checks``), only when a group has more than one rank."""
        groups = [i for i, group in enumerate(self.config.groups) if group.tp_size > 1]
        try:
            refusals = tensor_parallel_refusals(
                self.model_dir, [(self.load_spec(i), self.config.groups[i].device) for i in groups], stopped
            )
        except HotweightsError as exc:
            raise ConfigError(f"{self.config.source}: checking groups {groups}' tensor-parallel split: {exc}") from None
        for i, refusal in zip(groups, refusals, strict=True):
            if refusal is not None:
                tp_size = self.config.groups[i].tp_size
                raise ConfigError(f"{self.config.source}: groups[{i}].tp_size = {tp_size}: {refusal}")

    @property
    def state_dir(self) -> Path:
        return self.config.state_dir

    @property
    def state_file(self) -> Path:
        return self.config.state_file

    @property
    def lock_file(self) -> Path:
        return controller_lock(self.state_dir)

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def events_file(self) -> Path:
        return self.state_dir / "events.jsonl"

    @property
    def markers(self) -> tuple[str, ...]:
        """What the command lines of this stack's processes name: the state dir (daemon and engine
        sockets), the config file (the gateway)."""
        return (str(self.state_dir), *([str(self.config_path)] if self.config_path else []))

    @property
    def first_generation(self) -> Generation:
        return Generation(0, self.model_dir)

    def socket(self, group: int, rank: int | str = 0, generation: int = 0) -> Path:
        """The socket of the group's daemon of ``rank`` and weight ``generation``; ``rank`` "{rank}" gives a
        tensor-parallel engine's ``--socket`` template."""
        name = f"g{group}" + (f".gen{generation}" if generation else "")
        if self.config.groups[group].tp_size == 1:
            return run_dir(self.state_dir) / f"{name}.sock"
        return run_dir(self.state_dir) / f"{name}.r{rank}.sock"

    def load_spec(self, group: int, rank: int = 0) -> LoadSpec:
        model, config = self.config.model, self.config.groups[group]
        return LoadSpec(
            device=config.rank_device(rank),
            dtype=model.dtype or None,
            tp_size=config.tp_size,
            tp_rank=rank,
            quantize=model.quantize or None,
        )

    def daemon_command(self, group: int, rank: int = 0, generation: Generation | None = None) -> list[str]:
        """The group's cache daemon (of ``rank``, in a tensor-parallel group) for ``generation`` (default the
        first); a vLLM (SGLang) group's runs vLLM's (SGLang's) loader with its Python. Every start tries
        re-adoption from a live engine, then the group's ``snapshot`` (if any, for the first generation), then the
        checkpoint; it keeps a failed engine's KV cache ``kv_retain_s``."""
        config, generation = self.config.groups[group], generation or self.first_generation
        paths, backend = DaemonPaths(self.socket(group, rank, generation.number)), config.backend or None
        extra = ["--snapshot", str(self.snapshot(group, rank))] if config.snapshot and not generation.number else []
        extra += ["--direct-io"] if config.direct_io else []
        extra += self.seed_flags(group, rank) if self.config.seeding.enabled and not generation.number else []
        if config.engine == Engine.REFERENCE:  # only its engines deposit KV caches
            spec = self.load_spec(group, rank)
            extra += ["--kv-retain-s", f"{config.kv_retain_s:g}"]
            return [*daemon_command(generation.model_dir, spec, paths, backend), *extra]
        spec, python = self.load_spec(group), config.engine_python
        command = daemon_command(generation.model_dir, spec, paths, backend, python=python)
        return [*command, "--format", config.engine, *extra]  # the formats are named after the engines

    def seed_address(self, group: int, rank: int = 0) -> str:
        """Where the daemon of ``group`` and ``rank`` seeds peers: ``[dcs] address``, ``seeding.port`` plus the
        daemon's place among every group's ranks."""
        index = sum(g.tp_size for g in self.config.groups[:group]) + rank
        return f"{self.config.dcs.address}:{self.config.seeding.port + index}"

    def seed_flags(self, group: int, rank: int) -> list[str]:
        """``[seeding]`` as the daemon's flags: it serves its arena to peers and fills from the peers its controller
        lists in its sources file (``controller.seedplacement``) before its snapshot or checkpoint."""
        seeding, sources = self.config.seeding, DaemonPaths(self.socket(group, rank)).seed_sources
        return ["--seed-listen", self.seed_address(group, rank), "--seed-from", f"@{sources}",
                "--seed-token-file", seeding.token_file, "--seed-streams", str(seeding.streams),
                "--seed-max-clients", str(seeding.max_clients), "--seed-rate-gbps", f"{seeding.rate_gbps:g}",
                "--seed-wait-s", f"{seeding.wait_s:g}"]  # fmt: skip

    def snapshot(self, group: int, rank: int = 0) -> Path:
        """The group's ``snapshot`` path (its ``{rank}`` replaced by ``rank``); a relative one is relative to
        the config file."""
        path = Path(self.config.groups[group].snapshot.replace(SOCKET_RANK, str(rank))).expanduser()
        if not path.is_absolute() and self.config_path is not None:
            path = self.config_path.parent / path
        return path

    @property
    def compile_cache(self) -> Path:
        """Where a vLLM or SGLang group's servers keep their compile caches (``EngineKind.compile_caches``): in the
        state dir, so that every later server of the stack, spares included, reuses what an earlier one compiled."""
        return self.state_dir / "compile-cache"

    @property
    def cpu_threads(self) -> int:
        """The threads each CPU engine of the stack may use on this host (``cpu_threads``)."""
        return cpu_threads(self.config, len(os.sched_getaffinity(0)))

    def environment(self, group: int) -> dict[str, str] | None:
        """The environment of the group's daemon and engines: ours plus ``engine_env``, and for a vLLM or SGLang
        group, where neither names them, its compile caches under ``compile_cache`` and on a CPU each server's
        threads (``cpu_threads``, as a reference engine's ``--cpu-threads``) and its kind's ``cpu_env`` (None: ours)."""
        config = self.config.groups[group]
        defaults = {}
        if config.engine != Engine.REFERENCE:
            kind = KINDS[config.engine]
            defaults = {name: str(self.compile_cache / folder) for name, folder in kind.compile_caches}
            if config.device == "cpu":
                defaults["OMP_NUM_THREADS"] = str(self.cpu_threads)
                defaults |= dict(kind.cpu_env)
        return {**defaults, **os.environ, **config.engine_env} if defaults or config.engine_env else None

    def engine_command(self, spec: EngineSpec, generation: Generation | None = None) -> list[str]:
        """Every engine starts as a standby; the controller promotes one, so no start races a live primary.
        It listens on ``spec.listen_port``; clients keep using ``spec.port`` (a proxy may sit in between). It
        maps ``generation``'s weights (default the first) from that generation's daemon."""
        generation = generation or self.first_generation
        if self.config.groups[spec.group].engine != Engine.REFERENCE:
            return self.agent_command(spec, generation)
        model, engine, tp_size = self.config.model, self.config.engine, self.config.groups[spec.group].tp_size
        command = hotweights_command("engine", "--model", str(generation.model_dir))
        command += ["--tp-size", str(tp_size)] if tp_size > 1 else []
        sockets = self.socket(spec.group, SOCKET_RANK, generation.number)
        command += ["--device", spec.device, "--weight-cache", "client", "--socket", str(sockets)]
        command += ["--host", spec.host, "--port", str(spec.listen_port)]
        command += ["--role", Role.STANDBY, "--engine-id", spec.id]
        command += ["--kv-cache-tokens", str(engine.kv_cache_tokens), "--max-batch", str(engine.max_batch)]
        command += ["--kv-pool-tokens", str(engine.kv_pool_tokens)]
        command += ["--kv-pool-share", f"{self.config.kv_pool_share(spec.device):g}"]
        command += ["--drain-timeout", str(engine.drain_timeout_s)]
        if spec.device == "cpu":
            command += ["--cpu-threads", str(self.cpu_threads)]
        command += ["--queue-budget", str(engine.queue_budget_s)]
        command += ["--batch-invariant"] if engine.batch_invariant else []
        command += ["--max-body-bytes", str(self.config.gateway.max_body_bytes)]
        if model.dtype:
            command += ["--dtype", model.dtype]
        if model.quantize:
            command += ["--quantize", model.quantize]
        if self.config.cluster.token_file:
            command += ["--token-file", str(Path(self.config.cluster.token_file).expanduser().resolve())]
        if not self.config.groups[spec.group].spare_warm_up:
            command += ["--no-spare-warm-up"]
        return command

    def spare_command(self, group: int, generation: Generation | None = None) -> list[str]:
        """A spare engine of ``group`` (``controller.spares``): its engines' command for no slot yet (port 0, id
        ``g<group>-spare``; its start message names the slot), a reference engine warming up at the group's
        ``spare_duty`` (an agent starts its server at once: ``standby.agentspare``)."""
        config, host = self.config.groups[group], self.config.dcs.address
        spec = EngineSpec(spare_engine_id(group), group, config.device, 0, host=host)
        if config.engine != Engine.REFERENCE:
            return self.engine_command(spec, generation)
        return [*self.engine_command(spec, generation), "--spare-duty", str(config.spare_duty)]

    def batch_command(self, spec: EngineSpec, generation: Generation) -> list[str]:
        """The group's batch engine: its engines' command on its own port, without CUDA graphs, which would keep
        its KV cache reserved through a demote (a batch engine yields that memory when the group needs it)."""
        return [*self.engine_command(spec, generation), "--no-cuda-graphs"]

    def agent_command(self, spec: EngineSpec, generation: Generation) -> list[str]:
        """``hotweights agent`` in front of a vLLM or SGLang server that serves ``generation``'s model, mapping its
        weights from that generation's daemon."""
        group, model = self.config.groups[spec.group], self.config.model
        kind = KINDS[group.engine]
        command = hotweights_command("agent", "--kind", kind.name, "--port", str(spec.listen_port))
        command += ["--role", Role.STANDBY]
        command += ["--engine-id", spec.id, "--drain-timeout", str(self.config.engine.drain_timeout_s)]
        command += ["--ready-timeout", str(group.start_timeout()), "--log-dir", str(self.log_dir)]
        command += ["--weights-id", generation.weights_id]
        if self.config.cluster.token_file:
            command += ["--token-file", str(Path(self.config.cluster.token_file).expanduser().resolve())]
        loader = json.dumps({"socket": str(self.socket(spec.group, 0, generation.number))})
        command += ["--", group.engine_python, "-m", kind.server_module, kind.model_flag, str(generation.model_dir)]
        command += [SERVED_NAME_FLAG, str(self.model_dir)]  # a weight update keeps the name clients use
        command += ["--host", "127.0.0.1", "--port", PORT_PLACEHOLDER]
        command += ["--load-format", LOAD_FORMAT, "--model-loader-extra-config", loader]
        command += ["--dtype", model_config_name(model.dtype)] if model.dtype else []
        return [*command, *group.engine_args]

    def gateway_probe_socket(self, worker_id: str) -> Path:
        """Where the controller reaches one gateway worker (the shared port reaches any of them)."""
        return run_dir(self.state_dir) / f"{worker_id}.sock"

    def gateway_command(self, worker_id: str, fd: int) -> list[str]:
        """A gateway worker serving on the controller's listening socket, inherited as ``fd``."""
        command = hotweights_command(
            "gateway", "--fd", str(fd), "--probe-socket", str(self.gateway_probe_socket(worker_id))
        )
        return [*command, "--config", str(self.config_path)] if self.config_path else command
