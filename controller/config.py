"""The cluster configuration (``cluster.toml``): one dataclass tree, validated on load.

Every failover group is one device (or, with ``tp_size`` N, N devices): a cache daemon per device and
``engines`` engines attached to the daemons, one primary and the rest warm standbys. Every error names
the file, the key, what was expected and what was found; nothing starts until the whole file is valid.
``docs/cluster.example.toml`` documents every key, with these defaults (``tests/test_docs.py`` checks both).
"""

from __future__ import annotations

import math
import os
import re
import socket
import tomllib
import urllib.parse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hotweights.admission import MAX_WAITING, ServingLimits
from hotweights.cache import seedtransport
from hotweights.cache.protocol import KV_RETAIN_S
from hotweights.contract import ENGINE_PORT, read_token, refuse_open_listener
from hotweights.controller.ids import engine_id
from hotweights.controller.suspects import SuspectLimits
from hotweights.dtypes import MODEL_DTYPE_NAMES
from hotweights.engines import Engine
from hotweights.errors import ConfigError
from hotweights.httpguard import COMPLETION_BODY_BYTES, CONTROLLER_BODY_BYTES, MAX_CONNECTIONS
from hotweights.paths import hotweights_home
from hotweights.quant import QUANT_METHODS
from hotweights.spawn import SPARE_DUTY
from hotweights.standby.kvpool import MAX_AUTO_BATCH

# Why an exposed gateway needs the cluster's token: it forwards only /v1, and the engines behind it then
# refuse role changes without the token, whatever a client manages to send.
GATEWAY_TOKEN_FIX = "set cluster.token_file so that the engines behind the gateway need it for role changes"


OPEN_FILES_BASE = 256  # ClusterConfig.open_files_needed: the controller, daemons, logs, pipes
OPEN_FILES_PER_ENGINE = 64  # its health checks, spare pipes, clients
OPEN_FILES_PER_HELD_REQUEST = 4  # the gateway's client and upstream sockets, with room for those in flight
MAX_GATEWAY_WORKERS = 16
IN_FLIGHT_HEADROOM = 4  # gateway_in_flight: a worker proxies this many times what the primaries take at once
SUSPECT_AFTER = 2  # engines that may fail with a request in flight before the gateway stops re-sending it
SUSPECT_TTL_S = 3600.0  # how long a failure counts for the body in flight (controller.suspects, rule 2)
CLIENT_FAILURES = 2  # failures of its requests of death after which a client is refused (rule 3; 0: never)
CLIENT_WINDOW_S = 60.0  # ... within this many seconds
MAX_SPARE_ENGINES = 16
SEED_PORT = 8300  # [seeding] port: the first daemon's seeding listener
START_TIMEOUTS_S = {Engine.REFERENCE: 120.0, Engine.VLLM: 600.0, Engine.SGLANG: 600.0}


@dataclass(frozen=True)
class ClusterSection:
    name: str = "hotweights"
    host: str = "127.0.0.1"
    port: int = 8100
    token_file: str = ""
    state_dir: str = ""
    api_max_body_bytes: int = CONTROLLER_BODY_BYTES
    launcher: bool = True  # reference engines forked from a launcher that did their imports once (standby.launcher)


@dataclass(frozen=True)
class ModelSection:
    path: str = ""
    dtype: str = ""
    quantize: str = ""


@dataclass(frozen=True)
class GroupSection:
    device: str = "cpu"
    engines: int = 3
    max_engines: int = 8  # POST /engines adds standbys up to this many engines in the group
    tp_size: int = 1  # ranks per engine: a daemon per rank, each engine a tensor-parallel group of rank processes
    base_port: int = ENGINE_PORT
    listen_base_port: int = 0  # 0: engines listen on their client ports (base_port + i)
    backend: str = ""
    engine: Engine = Engine.REFERENCE
    engine_python: str = ""
    engine_args: tuple[str, ...] = ()
    engine_env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 0.0
    snapshot: str = ""  # a processed snapshot the daemon tries after re-adoption, before the checkpoint
    direct_io: bool = False  # the daemons read with O_DIRECT
    kv_retain_s: float = KV_RETAIN_S  # how long the daemons keep a failed engine's KV cache for its successor
    spare: bool = True  # pre-imported engine and daemon processes waiting to replace the primary, the daemon
    spare_warm_up: bool = True  # the spare engine attaches and warms up while it waits
    spare_engines: int = 1  # warmed spare engines kept for the group's slots (with spare)
    spare_duty: float = SPARE_DUTY  # the share of time a spare's warm-up may keep the device busy
    batch_port: int = 0  # a co-located, lower-priority batch engine on this port (0: none)
    batch_yield_timeout_s: float = 1.0  # a yielding batch engine's drain, before its requests are cancelled

    def start_timeout(self) -> float:
        """How long an engine of this group may take to become ready (vLLM and SGLang profile and warm up first)."""
        return self.start_timeout_s or START_TIMEOUTS_S[self.engine]

    def rank_device(self, rank: int) -> str:
        """Where an engine's ``rank`` runs: rank r on cuda:r in a tensor-parallel group on GPUs (``_check_tp``)."""
        return f"cuda:{rank}" if self.device.startswith("cuda") and self.tp_size > 1 else self.device


@dataclass(frozen=True)
class EngineSection(ServingLimits):
    """``[engine]``: every group's engines' limits (``hotweights.admission.ServingLimits``)."""


@dataclass(frozen=True)
class HealthSection:
    interval_ms: int = 50
    timeout_ms: int = 200
    failure_threshold: int = 2
    redundancy_alert_s: float = 30.0  # degraded (fewer ready standbys than wanted) longer than this: alerting
    canary_interval_ms: int = 5000  # every engine's canary asked this often (``controller.graywatch``)
    degraded_factor: float = 4.0  # a primary this many times slower than its best and a standby's is degraded
    degraded_for_s: float = 2.0  # ... for this long in a row: switched over (planned)
    degraded_every_s: float = 300.0  # at most one such switchover per group this often


@dataclass(frozen=True)
class GatewaySection:
    host: str = "127.0.0.1"
    port: int = 8000
    queue_limit: int = 256
    hold_timeout_s: float = 10.0
    workers: int = 2  # one killed, the others accept at once; the socket queues while none runs
    probe_interval_ms: int = 200  # with 2 workers, the probes one worker sent every 100 ms
    max_body_bytes: int = COMPLETION_BODY_BYTES  # completion bodies, at the gateway and the engines: 413 above
    max_in_flight: int = 0  # proxied at once per worker (0: IN_FLIGHT_HEADROOM x every group's max_batch + MAX_WAITING)
    suspect_after: int = SUSPECT_AFTER  # engines that failed with a request in flight before it is refused
    suspect_ttl_s: float = SUSPECT_TTL_S
    client_failures: int = CLIENT_FAILURES
    client_window_s: float = CLIENT_WINDOW_S

    def suspect_limits(self) -> SuspectLimits:
        return SuspectLimits(self.suspect_after, self.suspect_ttl_s, self.client_failures, self.client_window_s)

    def worker_ids(self) -> list[str]:
        """The gateway workers' service ids: ``gateway`` (the one a single-worker gateway always had),
        then ``gateway-1`` and on."""
        return ["gateway", *(f"gateway-{i}" for i in range(1, self.workers))]


@dataclass(frozen=True)
class SeedingSection:
    """A new host's daemons fill from a peer's (``[dcs]`` only; docs/operations.md, Seeding)."""

    enabled: bool = False
    port: int = SEED_PORT  # the daemon of each group and rank listens on port + its index, at dcs.address
    token_file: str = ""  # the token every host's daemons share (required)
    streams: int = seedtransport.STREAMS
    max_clients: int = seedtransport.MAX_CLIENTS
    rate_gbps: float = seedtransport.RATE_GBPS
    wait_s: float = seedtransport.WAIT_S


PREFIX = re.compile(r"(/[A-Za-z0-9._-]+)+")  # absolute, no trailing slash, plain segments


@dataclass(frozen=True)
class DcsSection:
    """etcd, when several hosts share the cluster (``etcd`` empty: one host, no DCS)."""

    etcd: tuple[str, ...] = ()
    prefix: str = "/hotweights"
    host: str = ""
    address: str = "127.0.0.1"
    ttl_s: int = 2
    loop_wait_s: float = 0.5
    retry_timeout_s: float = 0.5

    @property
    def enabled(self) -> bool:
        return bool(self.etcd)

    @property
    def host_name(self) -> str:
        return self.host or socket.gethostname()


@dataclass(frozen=True)
class EngineSpec:
    """One engine the controller supervises; ids are stable across controller restarts.

    ``port`` is where clients reach it (health checks, gateway, HAProxy, the controller's engine API);
    ``listen_port`` is where the engine itself listens: the same unless a proxy sits in front of it
    (``groups[].listen_base_port``). Left at 0 it becomes ``port``.
    """

    id: str
    group: int
    device: str
    port: int
    listen_port: int = 0
    host: str = "127.0.0.1"  # the address it listens on and is reached at ([dcs] address)

    def __post_init__(self) -> None:
        if not self.listen_port:
            object.__setattr__(self, "listen_port", self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def batch_spec(group: int, section: GroupSection) -> EngineSpec | None:
    """The group's batch engine (``g<group>-batch`` on ``batch_port``), None when it has none."""
    return EngineSpec(f"g{group}-batch", group, section.device, section.batch_port) if section.batch_port else None


@dataclass(frozen=True)
class ClusterConfig:
    source: str = "(defaults)"
    cluster: ClusterSection = field(default_factory=ClusterSection)
    model: ModelSection = field(default_factory=ModelSection)
    groups: tuple[GroupSection, ...] = (GroupSection(),)
    engine: EngineSection = field(default_factory=EngineSection)
    health: HealthSection = field(default_factory=HealthSection)
    gateway: GatewaySection = field(default_factory=GatewaySection)
    dcs: DcsSection = field(default_factory=DcsSection)
    seeding: SeedingSection = field(default_factory=SeedingSection)

    def engines(self) -> list[EngineSpec]:
        """Every engine of every group: ``g<group>-e<index>`` on ``base_port + index``, listening on
        ``listen_base_port + index`` (when set)."""
        return [
            EngineSpec(
                id=engine_id(g, i),
                group=g,
                device=group.device,
                port=group.base_port + i,
                listen_port=group.listen_base_port + i if group.listen_base_port else 0,
                host=self.dcs.address,
            )
            for g, group in enumerate(self.groups)
            for i in range(group.engines)
        ]

    def gateway_in_flight(self) -> int:
        """Requests each gateway worker proxies at once: ``gateway.max_in_flight``, by default ``IN_FLIGHT_HEADROOM``
        times what every group's primary generates (at most MAX_AUTO_BATCH where ``engine.max_batch`` is automatic) and
        lets wait at most (``MAX_WAITING``). The engines refuse what is beyond their own bound in milliseconds; the
        headroom is for the requests a hung primary holds until it is fenced, which would otherwise fill a worker and
        turn the hang into 429s."""
        per_group = (self.engine.max_batch or MAX_AUTO_BATCH) + MAX_WAITING
        return self.gateway.max_in_flight or IN_FLIGHT_HEADROOM * per_group * len(self.groups)

    def engines_on(self, device: str) -> int:
        """The engine processes every group keeps on ``device``: its engines, spare engines and batch engine."""
        return sum(
            group.engines + (group.spare_engines if group.spare else 0) + (1 if group.batch_port else 0)
            for group in self.groups
            if group.device == device
        )

    def kv_pool_share(self, device: str) -> float:
        """What each reference engine on ``device`` passes as --kv-pool-share: ``engine.kv_memory_share`` split evenly
        between the engines that device holds (``engines_on``)."""
        return self.engine.kv_memory_share / max(self.engines_on(device), 1)

    def engine_urls(self) -> list[str]:
        return [spec.url for spec in self.engines()]

    @property
    def state_dir(self) -> Path:
        if self.cluster.state_dir:
            return Path(self.cluster.state_dir).expanduser()
        return hotweights_home() / "clusters" / self.cluster.name

    @property
    def state_file(self) -> Path:
        """The controller's persisted state; the gateway reads it too (engines added at runtime)."""
        return self.state_dir / "state.json"

    def open_files_needed(self) -> int:
        """The open-files limit a stack needs (its processes inherit the controller's): a base for the
        controller, daemons and logs, some per engine (health checks, pipes, its clients), and for the
        gateway's clients and upstream connections a few per request it may hold."""
        engines = sum(group.engines + group.spare_engines for group in self.groups)
        return (
            OPEN_FILES_BASE + OPEN_FILES_PER_ENGINE * engines + OPEN_FILES_PER_HELD_REQUEST * self.gateway.queue_limit
        )

    def open_files_wanted(self) -> int:
        """What a stack takes where the hard limit allows: its need, and room for each server's connection cap
        (``httpguard.connection_cap``: half the limit) on top."""
        return self.open_files_needed() + 2 * MAX_CONNECTIONS

    def token(self) -> str | None:
        """The bearer token from ``token_file`` (None when unset)."""
        if not self.cluster.token_file:
            return None
        return read_token(Path(self.cluster.token_file), f"{self.source}: cluster.token_file")


SECTIONS = {
    "cluster": ClusterSection,
    "model": ModelSection,
    "engine": EngineSection,
    "health": HealthSection,
    "gateway": GatewaySection,
    "dcs": DcsSection,
    "seeding": SeedingSection,
}


# What a rollout applies besides [engine]: the keys of a group that only its engines' command lines read.
ROLLOUT_GROUP_KEYS = ("engine_args", "engine_env", "start_timeout_s")


def rollout_changes(old: ClusterConfig, new: ClusterConfig) -> list[str]:
    """The engine settings that differ from ``old`` in ``new`` (``engine.max_batch``, ``groups[0].engine_args``):
    what a rolling restart applies. ConfigError naming every other key that differs: the daemons, the
    gateway and the controller read those, so they take a controller restart, not a rollout."""
    changed, other = [], []
    pairs = [(name, getattr(old, name), getattr(new, name)) for name in SECTIONS]
    if len(old.groups) != len(new.groups):
        other.append(f"the number of [[groups]] ({len(old.groups)} -> {len(new.groups)})")
    pairs += [(f"groups[{i}]", a, b) for i, (a, b) in enumerate(zip(old.groups, new.groups, strict=False))]
    for name, before, after in pairs:
        for f in fields(before):
            if getattr(before, f.name) != getattr(after, f.name):
                applied = name == "engine" or (name.startswith("groups[") and f.name in ROLLOUT_GROUP_KEYS)
                (changed if applied else other).append(f"{name}.{f.name}")
    if other:
        raise ConfigError(
            f"{new.source}: {', '.join(other)} changed; a rollout applies only [engine] and groups[].{{"
            f"{','.join(ROLLOUT_GROUP_KEYS)}}}: restart the controller for the rest, or undo them"
        )
    return changed


def load_config(path: str | Path | None) -> ClusterConfig:
    """Read and validate ``path``; None gives the defaults (the embedded tiny model on CPU)."""
    if path is None:
        config = ClusterConfig()
    else:
        source = str(path)
        try:
            raw = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
        config = _from_raw(raw, source)
    validate(config)
    return config


def _from_raw(raw: dict[str, Any], source: str) -> ClusterConfig:
    unknown = raw.keys() - {*SECTIONS, "groups"}
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {sorted(unknown)}; expected {sorted([*SECTIONS, 'groups'])}")
    sections = {name: _section(cls, raw.get(name, {}), name, source) for name, cls in SECTIONS.items()}
    groups_raw = raw.get("groups", [{}])
    if not isinstance(groups_raw, list) or not groups_raw:
        raise ConfigError(f"{source}: [[groups]] must be a non-empty array of tables")
    groups = tuple(_section(GroupSection, g, f"groups[{i}]", source) for i, g in enumerate(groups_raw))
    return ClusterConfig(source=source, groups=groups, **sections)


def _section(cls: type, raw: object, name: str, source: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: [{name}] must be a table, found {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = raw.keys() - known.keys()
    if unknown:
        raise ConfigError(f"{source}: [{name}] unknown key(s) {sorted(unknown)}; expected {sorted(known)}")
    values = {}
    for key, value in raw.items():
        values[key] = _typed(value, known[key].type, f"{source}: {name}.{key}")
    return cls(**values)


def _typed(value: object, kind: str, where: str) -> object:
    """``value`` as the field type ``kind`` names (an int is a float too); ConfigError naming ``where``."""
    if kind == "tuple[str, ...]":
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ConfigError(f"{where} must be a list of strings, found {value!r}")
        return tuple(value)
    if kind == "dict[str, str]":
        if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
            raise ConfigError(f"{where} must be a table of strings, found {value!r}")
        return dict(value)
    if kind == "Engine":
        if value not in Engine._value2member_map_:
            raise ConfigError(f"{where} must be one of {sorted(Engine)}, found {value!r}")
        return Engine(value)
    expected = {"int": int, "float": float, "str": str, "bool": bool}[kind]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not expected:
        raise ConfigError(f"{where} must be {expected.__name__}, found {type(value).__name__} {value!r}")
    return value


def _check_engine(group: GroupSection, where: str) -> None:
    """The engine kind of a group, and what a vLLM or SGLang group needs."""
    if group.start_timeout_s < 0:
        raise ConfigError(f"{where}.start_timeout_s must be >= 0 (0: the default), found {group.start_timeout_s}")
    if group.engine == Engine.REFERENCE:
        if group.engine_python or group.engine_args or group.engine_env:
            raise ConfigError(f'{where}: engine_python, engine_args and engine_env need engine = "vllm" or "sglang"')
        return
    if not group.engine_python:
        raise ConfigError(
            f"{where}.engine_python is required with engine = {group.engine!r} (a Python with it and hotweights)"
        )
    if not os.access(group.engine_python, os.X_OK):
        raise ConfigError(f"{where}.engine_python {group.engine_python!r} is not an executable file")


def _check_tp(group: GroupSection, where: str) -> None:
    """A tensor-parallel group: reference engines, rank r on cuda:r (or every rank on cpu)."""
    if group.tp_size < 1:
        raise ConfigError(f"{where}.tp_size must be >= 1, found {group.tp_size}")
    if group.tp_size == 1:
        return
    if group.engine != Engine.REFERENCE:
        raise ConfigError(f'{where}.tp_size {group.tp_size} needs engine = "reference", found {group.engine!r}')
    if group.device not in ("cpu", "cuda:0"):
        raise ConfigError(
            f"{where}.device must be cpu or cuda:0 with tp_size {group.tp_size} (rank r runs on cuda:r), "
            f"found {group.device!r}"
        )
    if group.snapshot and "{rank}" not in group.snapshot:
        raise ConfigError(f"{where}.snapshot must hold {{rank}} with tp_size {group.tp_size} (a snapshot per rank)")


def _check_batch(config: ClusterConfig, i: int, ports: dict[int, str]) -> None:
    """A group's batch engine: a free port of its own, a single-host group of reference engines of one rank."""
    group, where = config.groups[i], f"{config.source}: groups[{i}]"
    if not group.batch_port:
        return
    if not 0 < group.batch_port < 65536:
        raise ConfigError(f"{where}.batch_port must be 1..65535 (0: no batch engine), found {group.batch_port}")
    if group.batch_port in ports:
        raise ConfigError(f"{where}.batch_port {group.batch_port} collides with {ports[group.batch_port]}")
    ports[group.batch_port] = f"groups[{i}].batch_port"
    if group.batch_yield_timeout_s <= 0:
        raise ConfigError(f"{where}.batch_yield_timeout_s must be > 0, found {group.batch_yield_timeout_s}")
    for needs, ok, found in [
        ('engine = "reference"', group.engine == Engine.REFERENCE, f"engine = {group.engine!r}"),
        ("tp_size = 1", group.tp_size == 1, f"tp_size = {group.tp_size}"),
        ("one host (no [dcs] etcd)", not config.dcs.enabled, "dcs.etcd set"),
    ]:
        if not ok:
            raise ConfigError(f"{where}.batch_port: a batch engine needs {needs}, found {found}")


def _check_spares(group: GroupSection, where: str) -> None:
    if group.max_engines < group.engines:
        raise ConfigError(f"{where}.max_engines must be >= engines ({group.engines}), found {group.max_engines}")
    if not 0 <= group.spare_engines <= MAX_SPARE_ENGINES:
        raise ConfigError(f"{where}.spare_engines must be 0..{MAX_SPARE_ENGINES}, found {group.spare_engines}")
    if not 0 < group.spare_duty <= 1:
        raise ConfigError(f"{where}.spare_duty must be in (0, 1], found {group.spare_duty}")


def validate(config: ClusterConfig) -> None:
    """Cross-field checks: positive timings, distinct ports, a token for non-loopback binds."""
    src = config.source

    def positive(where: str, value: float) -> None:
        if not value > 0:  # NaN too
            raise ConfigError(f"{src}: {where} must be > 0, found {value}")

    for where, value in [
        ("health.interval_ms", config.health.interval_ms),
        ("health.timeout_ms", config.health.timeout_ms),
        ("health.failure_threshold", config.health.failure_threshold),
        ("health.redundancy_alert_s", config.health.redundancy_alert_s),
        ("health.canary_interval_ms", config.health.canary_interval_ms),
        ("health.degraded_for_s", config.health.degraded_for_s),
        ("health.degraded_every_s", config.health.degraded_every_s),
        ("engine.kv_cache_tokens", config.engine.kv_cache_tokens),
        ("engine.drain_timeout_s", config.engine.drain_timeout_s),
        ("gateway.queue_limit", config.gateway.queue_limit),
        ("gateway.hold_timeout_s", config.gateway.hold_timeout_s),
        ("gateway.probe_interval_ms", config.gateway.probe_interval_ms),
        ("gateway.max_body_bytes", config.gateway.max_body_bytes),
        ("gateway.suspect_after", config.gateway.suspect_after),
        ("gateway.suspect_ttl_s", config.gateway.suspect_ttl_s),
        ("gateway.client_window_s", config.gateway.client_window_s),
        ("cluster.api_max_body_bytes", config.cluster.api_max_body_bytes),
    ]:
        positive(where, value)
    if not config.health.degraded_factor > 1:  # NaN too
        raise ConfigError(f"{src}: health.degraded_factor must be > 1, found {config.health.degraded_factor}")
    if not 0 < config.engine.kv_memory_share <= 1:  # NaN too
        raise ConfigError(f"{src}: engine.kv_memory_share must be in (0, 1], found {config.engine.kv_memory_share}")
    for where, count in [
        ("engine.max_batch", config.engine.max_batch),
        ("engine.kv_pool_tokens", config.engine.kv_pool_tokens),
        ("engine.queue_budget_s", config.engine.queue_budget_s),
        ("gateway.max_in_flight", config.gateway.max_in_flight),
        ("gateway.client_failures", config.gateway.client_failures),
    ]:
        if not count >= 0:  # NaN too
            raise ConfigError(f"{src}: {where} must be >= 0, found {count}")
    if not 1 <= config.gateway.workers <= MAX_GATEWAY_WORKERS:
        raise ConfigError(f"{src}: gateway.workers must be 1..{MAX_GATEWAY_WORKERS}, found {config.gateway.workers}")
    if config.model.dtype not in ("", *MODEL_DTYPE_NAMES):
        names = ", ".join(MODEL_DTYPE_NAMES)
        raise ConfigError(f"{src}: model.dtype must be one of {names}, found {config.model.dtype!r}")
    if config.model.quantize not in ("", *QUANT_METHODS):
        expected = " or ".join(repr(m) for m in ("", *QUANT_METHODS))
        raise ConfigError(f"{src}: model.quantize must be {expected}, found {config.model.quantize!r}")
    for i, group in enumerate(config.groups):
        if group.engines < 1:
            raise ConfigError(f"{src}: groups[{i}].engines must be >= 1, found {group.engines}")
        if not (group.device == "cpu" or re.fullmatch(r"cuda:\d+", group.device)):
            raise ConfigError(f"{src}: groups[{i}].device must be cpu or cuda:N, found {group.device!r}")
        _check_engine(group, f"{src}: groups[{i}]")
        _check_spares(group, f"{src}: groups[{i}]")
        _check_tp(group, f"{src}: groups[{i}]")
        if not 0 <= group.kv_retain_s < math.inf:
            found = group.kv_retain_s
            raise ConfigError(f"{src}: groups[{i}].kv_retain_s must be a number of seconds >= 0, found {found}")
        if group.listen_base_port < 0:
            found = group.listen_base_port
            raise ConfigError(f"{src}: groups[{i}].listen_base_port must be >= 0 (0: base_port), found {found}")
    ports: dict[int, str] = {config.cluster.port: "cluster.port", config.gateway.port: "gateway.port"}
    if config.cluster.port == config.gateway.port:
        raise ConfigError(f"{src}: cluster.port and gateway.port are both {config.cluster.port}")
    for spec in config.engines():
        if not 0 < spec.port < 65536:
            raise ConfigError(f"{src}: engine {spec.id} port {spec.port} is out of range")
        if spec.port in ports:
            raise ConfigError(f"{src}: engine {spec.id} port {spec.port} collides with {ports[spec.port]}")
        ports[spec.port] = f"engine {spec.id} port (groups[{spec.group}].base_port)"
    for spec in config.engines():  # after all client ports: a listen port may be no one else's port
        if spec.listen_port == spec.port:
            continue
        where = f"groups[{spec.group}].listen_base_port gives engine {spec.id} listen port {spec.listen_port}"
        if not 0 < spec.listen_port < 65536:
            raise ConfigError(f"{src}: {where}, out of range")
        if spec.listen_port in ports:
            raise ConfigError(f"{src}: {where}, which collides with {ports[spec.listen_port]}")
        ports[spec.listen_port] = f"engine {spec.id} listen port (groups[{spec.group}].listen_base_port)"
    for i in range(len(config.groups)):
        _check_batch(config, i, ports)
    has_token = bool(config.cluster.token_file)
    refuse_open_listener(
        config.cluster.host, has_token, f"{src}: cluster.host", "set cluster.token_file so that mutations need it"
    )
    refuse_open_listener(config.gateway.host, has_token, f"{src}: gateway.host", GATEWAY_TOKEN_FIX)
    refuse_open_listener(config.dcs.address, has_token, f"{src}: dcs.address", GATEWAY_TOKEN_FIX)
    if config.dcs.enabled:
        _check_dcs(config.dcs, src)
    if config.seeding.enabled:
        _check_seeding(config, src)
    if has_token:
        config.token()


def _check_dcs(dcs: DcsSection, src: str) -> None:
    """etcd URLs, a prefix of plain segments, and Patroni's timing rule ttl >= loop_wait + 2 * retry_timeout
    (a renewal may take two retry timeouts and still land before the lease expires)."""
    for url in dcs.etcd:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path not in ("", "/"):
            raise ConfigError(f"{src}: dcs.etcd entry {url!r} must be an http(s)://HOST:PORT client URL")
    if not PREFIX.fullmatch(dcs.prefix):
        raise ConfigError(
            f"{src}: dcs.prefix must be an absolute key path of plain segments without a trailing slash, "
            f'e.g. "/hotweights", found {dcs.prefix!r}'
        )
    for where, value in [("dcs.ttl_s", dcs.ttl_s), ("dcs.loop_wait_s", dcs.loop_wait_s),
                         ("dcs.retry_timeout_s", dcs.retry_timeout_s)]:  # fmt: skip
        if not value > 0:  # NaN too
            raise ConfigError(f"{src}: {where} must be > 0, found {value}")
    if dcs.ttl_s < dcs.loop_wait_s + 2 * dcs.retry_timeout_s:
        raise ConfigError(
            f"{src}: dcs.ttl_s ({dcs.ttl_s}) must be >= dcs.loop_wait_s + 2 * dcs.retry_timeout_s "
            f"({dcs.loop_wait_s + 2 * dcs.retry_timeout_s:g}), or a renewal may land after the lease expired"
        )
    if not re.fullmatch(r"[A-Za-z0-9._-]+", dcs.host_name):
        raise ConfigError(f"{src}: dcs.host must be a name of letters, digits, '.', '_' or '-', found {dcs.host!r}")


def _check_seeding(config: ClusterConfig, src: str) -> None:
    """[seeding] needs [dcs] (etcd names the peers), a readable token file, ports in range, sane limits."""
    seeding = config.seeding
    if not config.dcs.enabled:
        raise ConfigError(f"{src}: seeding.enabled needs [dcs] (etcd tells a new host which peers serve)")
    if not seeding.token_file:
        raise ConfigError(f"{src}: seeding.token_file is empty; every host's daemons need the same token file")
    read_token(Path(seeding.token_file), f"{src}: seeding.token_file")
    last = seeding.port + sum(group.tp_size for group in config.groups) - 1
    if not 0 < seeding.port <= last < 65536:
        raise ConfigError(f"{src}: seeding.port {seeding.port} gives ports up to {last}, expected 1-65535")
    bounds = [("seeding.streams", seeding.streams, 1), ("seeding.max_clients", seeding.max_clients, 1),
              ("seeding.rate_gbps", seeding.rate_gbps, 0), ("seeding.wait_s", seeding.wait_s, 0)]  # fmt: skip
    for where, value, low in bounds:
        if not value >= low:  # NaN too
            raise ConfigError(f"{src}: {where} must be >= {low}, found {value}")
