"""``hotweights engine``'s flags: their definitions, defaults and help, and the checks of their values that
argparse cannot make (``standby.engineoptions`` holds the parsed flags as one typed object)."""

from __future__ import annotations

import argparse

from hotweights.admission import MAX_WAITING, ServingLimits
from hotweights.cache.pipeline import add_load_spec_arguments
from hotweights.contract import ENGINE_PORT, SHUTDOWN_TIMEOUT_S, Role, refuse_open_listener
from hotweights.errors import ConfigError
from hotweights.httpguard import COMPLETION_BODY_BYTES
from hotweights.spawn import SPARE_DUTY, add_spare_arguments
from hotweights.standby.engineoptions import EngineOptions
from hotweights.standby.kvpool import (
    BLOCK_SIZE,
    CPU_POOL_TOKENS,
    ENGINE_KV_SHARE,
    MAX_AUTO_BATCH,
    SEQUENCE_TOKENS,
    pool_refusal,
)
from hotweights.standby.weights import add_weight_cache_arguments

LIMITS = ServingLimits()  # the flags' defaults


def duty(text: str) -> float:
    """--spare-duty: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], found {text!r}")
    return value


def check_options(options: EngineOptions) -> None:
    if options.tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1, found {options.tp_size}")
    if options.kv_cache_tokens < 2:
        raise ConfigError(f"--kv-cache-tokens must be >= 2, found {options.kv_cache_tokens}")
    if options.max_batch < 0:
        raise ConfigError(f"--max-batch must be >= 0 (0: what the KV pool holds), found {options.max_batch}")
    if options.kv_pool_tokens < 0:
        raise ConfigError(f"--kv-pool-tokens must be >= 0 (0: sized automatically), found {options.kv_pool_tokens}")
    if not 0 < options.kv_pool_share <= 1:  # NaN too
        raise ConfigError(f"--kv-pool-share must be in (0, 1], found {options.kv_pool_share}")
    if options.kv_pool_tokens and (reason := pool_refusal(options.kv_pool_tokens, options.kv_cache_tokens)):
        fix = "raise it or lower --kv-cache-tokens"
        raise ConfigError(f"--kv-pool-tokens {options.kv_pool_tokens}: {reason} (--kv-cache-tokens); {fix}")
    if options.max_body_bytes < 1:
        raise ConfigError(f"--max-body-bytes must be >= 1, found {options.max_body_bytes}")
    if not options.queue_budget >= 0:  # NaN too
        raise ConfigError(f"--queue-budget must be >= 0, found {options.queue_budget}")
    if options.cpu_threads < 0:
        raise ConfigError(f"--cpu-threads must be >= 0, found {options.cpu_threads}")
    for flag in ("drain_timeout", "shutdown_timeout"):
        if getattr(options, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 0, found {getattr(options, flag)}")
    fix = "pass --token-file so that role changes need it, or listen on 127.0.0.1"
    refuse_open_listener(options.host, bool(options.token_file), "--host", fix)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``hotweights engine`` on ``p``."""
    add_load_spec_arguments(p, with_rank=False)
    add_weight_cache_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=ENGINE_PORT, help=f"port to listen on; 0 picks a free one (default {ENGINE_PORT})"
    )
    p.add_argument("--role", choices=list(Role), default=Role.PRIMARY, help="starting role (default primary)")
    p.add_argument("--token-file", help="file holding the bearer token that promote/drain/demote require")
    tokens = LIMITS.kv_cache_tokens
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=tokens,
        help=f"the KV positions one sequence may hold, its prompt and generated tokens (default {tokens})",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=LIMITS.max_batch,
        help=f"sequences generated concurrently (default 0: those of {SEQUENCE_TOKENS} positions the KV pool holds at "
        f"once, at most {MAX_AUTO_BATCH})",
    )
    p.add_argument(
        "--kv-pool-tokens",
        type=int,
        default=LIMITS.kv_pool_tokens,
        help=f"KV positions in the engine's pool of {BLOCK_SIZE}-position blocks, which each sequence takes as many of "
        f"as its prompt and max_tokens need while it runs (default 0: on CPU {CPU_POOL_TOKENS}, on CUDA "
        "--kv-pool-share of the device memory beyond the weights; never more than --max-batch sequences of "
        "--kv-cache-tokens)",
    )
    p.add_argument(
        "--kv-pool-share",
        type=float,
        default=ENGINE_KV_SHARE,
        help="on CUDA with --kv-pool-tokens 0: the share of the device's memory beyond this engine's weights that its "
        "KV pool takes; the controller gives each engine of a device its part of engine.kv_memory_share "
        f"(default {ENGINE_KV_SHARE:g}: one of four engines' part of {LIMITS.kv_memory_share:g})",
    )
    p.add_argument(
        "--queue-budget",
        type=float,
        default=LIMITS.queue_budget_s,
        help="seconds a completion's expected start may be away (from the remaining tokens of what is generating "
        "and of what waits ahead, at the measured times) for it to wait for a slot; beyond, it is answered 429 at "
        f"once, with Retry-After (default {LIMITS.queue_budget_s:g}; at most {MAX_WAITING} sequences wait)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=COMPLETION_BODY_BYTES,
        help=f"largest request body, prompt included; larger ones are 413 (default {COMPLETION_BODY_BYTES})",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, capture the decode step per batch size as a CUDA graph at start-up; the KV cache is "
        "then allocated at start-up by standbys too (default on; no effect on CPU)",
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=LIMITS.batch_invariant,
        help="every prefill holds one prompt and every decode step runs at --max-batch rows over every row's "
        "--kv-cache-tokens positions, so a request's text does not depend on what shares its steps and a migrated "
        "one continues exactly, at the cost of the padding (default off)",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        help="on CPU, the threads each operation may use; the controller gives each engine its share of the host's "
        "cores (default 0: torch's default, every core)",
    )
    p.add_argument("--engine-id", help="name in health replies and metrics (default HOST-PID)")
    add_spare_arguments(p, "binding the port and attaching")
    p.add_argument(
        "--spare-warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --start-fd, --weight-cache client and one rank: attach and warm up before waiting, while the "
        "daemon serves, so the start only listens; the spare then holds a standby's device memory (default on)",
    )
    p.add_argument(
        "--spare-duty",
        type=duty,
        default=SPARE_DUTY,
        help="with --start-fd: the share of time the spare's warm-up may keep the device busy; it pauses for the "
        f"rest, so that it slows the engines serving beside it little, until it is started (default {SPARE_DUTY})",
    )
    # A follower rank of a tensor-parallel group (standby.tpgroup): set by rank 0 on the ranks it starts.
    p.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tp-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tp-leader", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=LIMITS.drain_timeout_s,
        help=f"seconds a drain waits before cancelling (default {LIMITS.drain_timeout_s:g})",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=SHUTDOWN_TIMEOUT_S,
        help=f"seconds in-flight requests get after SIGTERM before they are cancelled (default {SHUTDOWN_TIMEOUT_S:g})",
    )
