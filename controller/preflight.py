"""What ``up`` and ``controller`` check before they start or adopt anything, so that a stack that cannot run is
refused in one line naming its ``cluster.toml`` key (a ConfigError: exit 2), instead of engines that fail the same
way restarted for ever:

- every port the stack listens on (each engine's, the gateway's, a batch engine's) can be bound; a port another
  process holds is named with that process;
- the model (``model.path``, or the embedded tiny model) is what a group's daemon loads and its engines read:
  config, index, safetensors headers, the load settings' checks, tokenizer;
- each group's ``device`` exists for this torch (``cuda:N``: a CUDA build that sees more than N devices);
- one engine's KV pool can hold a sequence of ``engine.kv_cache_tokens`` (``standby.kvpool``), and beside the
  group's arena fits in the device's free memory (``controller.devices``): ``engine.kv_pool_tokens`` x the model's
  bytes per token position, where automatic on CPU its fixed size, on CUDA one sequence (the rest is a share of
  what the device holds, sized by each engine). One engine's: a lower bound, since a standby frees its KV cache
  after its warm-up; a stack that fits one engine but not all of them is stopped by the give-up rule instead
  (``controller.startfailures``).

Only a fresh start is checked: a start that adopts a running stack (some process of it runs) checks nothing, since
its model loaded, its ports and memory are its own, and a restarted controller must take over at once, not wait
for a model check nor refuse the whole stack for one slot (a slot that cannot start is then told at its first
failure, ``controller.startfailures``).

The model and device checks need torch: they run in one checking process (``controller.checks``), a second or
two, longer on a busy host. A vLLM or SGLang group's model is read by its own engine's loader, with its own
Python: only ``model.path`` (a directory) and the ports are checked for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hotweights.controller.checks import Serving, never, serving_checks
from hotweights.controller.config import ClusterConfig, EngineSection
from hotweights.controller.devices import free_bytes
from hotweights.controller.stack import Layout
from hotweights.controller.supervisor import listening_pids, read_identity, stack_marker, stack_orphans
from hotweights.engines import Engine
from hotweights.errors import ConfigError, HotweightsError
from hotweights.standby.kvpool import MAX_AUTO_BATCH, auto_pool_tokens, pool_refusal
from hotweights.standby.serving import PortUnavailable, bind_port
from hotweights.stats import human_bytes

log = logging.getLogger(__name__)

PORT_FIX = "stop it or choose another port"
COMMAND_CHARS = 80  # of a stranger's command line, in a refusal


def preflight(layout: Layout, with_gateway: bool, stopped: Callable[[], bool] = never) -> None:
    """Every check of the module docstring, cheapest first; ConfigError naming the key of the first that fails.
    ``stopped``: the checking process's (``controller.checks.Stopped``)."""
    if ours := stack_pids(layout):
        log.info("adopting a running stack (%d processes): its ports, model and memory are not checked", len(ours))
        return
    check_ports(layout.config, with_gateway)
    groups = [i for i, group in enumerate(layout.config.groups) if group.engine == Engine.REFERENCE]
    specs = [layout.load_spec(i) for i in groups]
    outcomes = serving_checks(layout.model_dir, [(spec, spec.device) for spec in specs], stopped)
    for i, spec, (serving, device_refusal) in zip(groups, specs, outcomes, strict=True):
        src = layout.config.source
        if device_refusal is not None:
            raise ConfigError(f"{src}: groups[{i}].device: {device_refusal}")
        if isinstance(serving, HotweightsError):
            raise ConfigError(f"{src}: model.path: {serving}")
        check_memory(layout.config, i, spec.device, serving)


def stack_pids(layout: Layout) -> set[int]:
    """The live processes of this stack (``supervisor.stack_orphans``): what a start adopts, not a stranger."""
    return {identity.pid for _, identity in stack_orphans(stack_marker(layout.state_dir), layout.markers)}


def listeners(config: ClusterConfig, with_gateway: bool) -> list[tuple[str, int, str]]:
    """(host, port, the key that sets it and whose it is) of every address the stack listens on."""
    found = [(config.gateway.host, config.gateway.port, "gateway.port")] if with_gateway else []
    for spec in config.engines():
        group = config.groups[spec.group]
        key = "listen_base_port" if group.listen_base_port else "base_port"
        found.append((spec.host, spec.listen_port, f"groups[{spec.group}].{key} (engine {spec.id})"))
    for i, group in enumerate(config.groups):
        if group.batch_port:
            found.append((config.dcs.address, group.batch_port, f"groups[{i}].batch_port"))
    return found


def check_ports(config: ClusterConfig, with_gateway: bool) -> None:
    """ConfigError for the first address in ``listeners`` that cannot be bound."""
    for host, port, key in listeners(config, with_gateway):
        if refusal := port_refusal(host, port, set()):
            raise ConfigError(f"{config.source}: {key}: {refusal}")


def port_refusal(host: str, port: int, ours: set[int]) -> str | None:
    """Why ``host:port`` cannot be listened on, naming the process that holds it when one can be found, and the fix;
    None when it can be bound, or when it is held by processes of ``ours`` (pids) only."""
    try:
        bind_port(host, port).close()
    except PortUnavailable as exc:
        unavailable = str(exc)
    else:
        return None
    holders = listening_pids(port)
    if holders and holders <= ours:
        return None
    if not (strangers := sorted(holders - ours)):
        return unavailable  # not listening yet, or another user's: no pid to name
    identity = read_identity(strangers[0])
    command = " ".join(" ".join(identity.command).split())[:COMMAND_CHARS] if identity else "gone since"
    return f"{host}:{port} is in use by another process (pid {strangers[0]}: {command}): {PORT_FIX}"


def check_memory(config: ClusterConfig, group: int, device: str, serving: Serving) -> None:
    """ConfigError when one engine's KV pool cannot hold one sequence, or does not fit beside the group's arena in
    ``device``'s free memory (nothing when that cannot be read)."""
    engine, src = config.engine, config.source
    tokens = pool_tokens(engine, device)
    setting = f"engine.kv_pool_tokens = {engine.kv_pool_tokens}" + ("" if engine.kv_pool_tokens else " (automatic)")
    if reason := pool_refusal(tokens, engine.kv_cache_tokens):
        raise ConfigError(
            f"{src}: engine.kv_cache_tokens = {engine.kv_cache_tokens}: {reason} ({setting}); raise "
            "engine.kv_pool_tokens or lower engine.kv_cache_tokens"
        )
    free = free_bytes(device)
    kv = serving.kv_token_bytes * tokens
    need = serving.arena_bytes + kv
    log.debug("group %d needs %d bytes on %s (arena %d, one engine's KV pool %d), %s free", group, need, device,
              serving.arena_bytes, kv, free)  # fmt: skip
    if free is None or need <= free:
        return
    room = f"{human_bytes(free)} are free on {device}"
    if serving.arena_bytes > free:
        raise ConfigError(f"{src}: model.path: group {group}'s arena needs {human_bytes(serving.arena_bytes)}, {room}")
    raise ConfigError(
        f"{src}: {setting}: one engine's KV pool ({tokens} positions x {serving.kv_token_bytes} bytes a position = "
        f"{human_bytes(kv)}) and group {group}'s arena ({human_bytes(serving.arena_bytes)}) need {human_bytes(need)}, "
        f"{room}; lower engine.kv_pool_tokens"
    )


def pool_tokens(engine: EngineSection, device: str) -> int:
    """The positions of one engine's KV pool as the checks count them: ``engine.kv_pool_tokens``, else the automatic
    pool on CPU, else one sequence of ``engine.kv_cache_tokens`` (on CUDA the rest is a share of the device's
    memory)."""
    if engine.kv_pool_tokens:
        return engine.kv_pool_tokens
    if device == "cpu":
        return auto_pool_tokens(None, 1, engine.max_batch or MAX_AUTO_BATCH, engine.kv_cache_tokens)
    return engine.kv_cache_tokens
