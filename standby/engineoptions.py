"""``hotweights engine``'s configuration: its flags as one typed, immutable object.

``standby.engineflags`` defines and documents every flag; ``EngineOptions.from_args`` takes the parsed
flags once, at the command's entry, and nothing below it sees an ``argparse.Namespace``. The load flags keep
the names that ``cache.pipeline``'s and ``standby.weights``' helpers read (``model``, ``device``, ...), which
every command that loads a model shares.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from hotweights.contract import Role


@dataclass(frozen=True)
class EngineOptions:
    # The weights: cache.pipeline.add_load_spec_arguments, standby.weights.add_weight_cache_arguments.
    model: str | None
    device: str
    dtype: str | None
    tp_size: int
    quantize: str | None
    weight_cache: str
    socket: str | None
    weight_cache_fallback: str | None
    weight_cache_timeout: float
    # Serving.
    host: str
    port: int
    role: Role
    token_file: str | None
    engine_id: str | None
    kv_cache_tokens: int
    max_batch: int  # 0 (kvpool.AUTO) until ``standby.engine.sized`` resolves it
    kv_pool_tokens: int  # likewise
    kv_pool_share: float
    queue_budget: float
    max_body_bytes: int
    cuda_graphs: bool
    batch_invariant: bool
    cpu_threads: int
    drain_timeout: float
    shutdown_timeout: float
    verbose: bool  # the CLI's -v, passed on to the ranks a tensor-parallel rank 0 starts
    # A spare: hotweights.spawn.add_spare_arguments, --spare-warm-up, --spare-duty.
    start_fd: int | None
    ready_fd: int | None
    spare_warm_up: bool
    spare_duty: float
    # A follower rank of a tensor-parallel group (standby.tpgroup): set by rank 0 on the ranks it starts.
    tp_rank: int
    tp_port: int
    tp_leader: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The parsed flags of ``hotweights engine`` (every field, by its flag's name)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        return cls(**values | {"role": Role(args.role), "verbose": bool(values["verbose"])})
