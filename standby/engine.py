"""``hotweights engine``: serve a model over HTTP as the primary or as a warm standby.

Start-up order: bind the port (a taken one ends it at once, exit code 2), load or attach the weights, warm
up every shape serving uses (``standby.decoder``), start the inference thread, listen, and only then print one
``{"event": "ready", ...}`` line to stdout. Logs go to stderr. On SIGTERM or SIGINT: stop listening, let
in-flight requests finish for up to --shutdown-timeout, cancel the rest, stop the inference thread, exit 0.
SIGUSR2 freezes the inference thread for good while the HTTP server goes on (the drill's stall fault,
``standby.progress``: the engine then reports itself unhealthy); SIGUSR1 and SIGRTMIN toggle slower steps and wrong
outputs (the drills' gray faults, ``standby.drillfaults``).
The HTTP contract is ``docs/engine-contract.md``.

Where the KV cache lives: on CUDA with --cuda-graphs (the default there) it is allocated at start-up by
every engine, standby included, and the decode step is captured as a CUDA graph per batch size against it;
promote then only attaches it. Otherwise warm-up runs through a scratch KV cache of the real shape, which
a standby frees again, and promote allocates the KV cache (its time counted in the promote's). An engine that
serves from a daemon's arena allocates the KV cache it serves from through the arena's backend, and deposits
it with the daemon while it is a primary, so that the next primary can continue its requests from it
(``standby.kvshare``).

With --start-fd FD the process is a spare the controller started ahead of need: the imports above (torch,
uvicorn, the model code: most of a start on CPU, seconds with CUDA) are done before anything waits, and so is
what a load can do without the daemon (``standby.weights.prepare``: the CUDA context, the checkpoint's headers
and fingerprint, the model's meta skeleton; used after the start only if no file of the checkpoint changed);
it goes on with the start-up order only once the controller writes to FD, when the slot it will take is free.
With --weight-cache client and one rank it also attaches and warms up ahead (--spare-warm-up, the default),
when its daemon serves: then it holds what a standby holds (the mapping; on CUDA with graphs its KV cache and
graphs) while it waits, and its start only binds the port and listens, once it has checked that no file of the
checkpoint changed and that the daemon still serves the allocation it maps (``Attachment.still_served``: a
re-adopted arena is that allocation; an arena filled again is not, and the spare then attaches and warms up
again rather than keep the old one's memory alive). A daemon that does not answer then changes nothing:
engines serve from the memory they map.

With --tp-size N this process is rank 0 of a tensor-parallel group: it starts ranks 1..N-1 (this command
again, with hidden --tp-rank/--tp-port/--tp-leader flags), each attaching its own rank's arena, and every
decoder call it makes runs on all of them (``standby.tpgroup``, which also says how the group lives and
dies as one). Ready is printed once every rank has attached and warmed up.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import uvicorn

from hotweights.admission import Admission
from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.connection import AttachRefused, DaemonUnavailable
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.pipeline import (
    check_spec,
    load_spec_from_args,
    model_dir_from_args,
)
from hotweights.contract import Role, read_token
from hotweights.errors import ConfigError, HotweightsError
from hotweights.httpguard import ErrorShape, HttpLimits, server_config
from hotweights.ports import free_port
from hotweights.spawn import Slot, readable, wait_for_start
from hotweights.standby import startclock, tpgroup
from hotweights.standby.decoder import Decoder
from hotweights.standby.engineflags import add_engine_arguments, check_options
from hotweights.standby.engineoptions import EngineOptions
from hotweights.standby.kvpool import (
    AUTO,
    BLOCK_SIZE,
    MAX_AUTO_BATCH,
    auto_max_batch,
    auto_pool_tokens,
    blocks_for,
    pool_blocks,
    pool_refusal,
)
from hotweights.standby.kvshare import KvShare
from hotweights.standby.metrics import EngineMetrics
from hotweights.standby.model import KVCache, Transformer
from hotweights.standby.pacing import CpuShare, Pacer
from hotweights.standby.progress import FREEZE_SIGNAL
from hotweights.standby.roles import CANCEL_GRACE_S, KvCapacity, Roles
from hotweights.standby.scheduler import Scheduler
from hotweights.standby.server import EngineContext, build_app, early_refusal
from hotweights.standby.serving import AnnouncingServer, bind_port, run_until_signal
from hotweights.standby.steptimes import WATCH
from hotweights.standby.weights import LoadedModel, Prepared, load_model, prepare
from hotweights.tokenizer import load_tokenizer, stop_token_ids

log = logging.getLogger(__name__)

# How long a thread may keep the GIL while another waits for it (Python: 5 ms, a third of an xl decode
# step): the inference thread gets it back this soon from the HTTP thread to launch its next step.
GIL_SWITCH_S = 0.0005


def new_decoder(
    model: Transformer,
    max_batch: int,
    kv_tokens: int,
    pool_tokens: int,
    batch_invariant: bool,
    graphs: bool = False,
    share: KvShare | None = None,
) -> Decoder:
    """A decoder with a fresh, zeroed KV pool of ``pool_tokens`` positions for ``max_batch`` rows of up to ``kv_tokens``
    (``standby.kvpool``); with ``share``, in memory that can outlive the engine (``standby.kvshare``)."""
    blocks = pool_blocks(pool_tokens)
    if share is None:
        kv = KVCache.pool(model.config, model.tp, max_batch, kv_tokens, blocks, model.device, model.dtype)
        return Decoder(model, kv, graphs, batch_invariant)
    shared = share.allocate(KVCache.shape(model.config, model.tp, blocks), max_batch, kv_tokens, model.dtype)
    return Decoder(model, shared.kv, graphs, batch_invariant, shared)


def sized(options: EngineOptions, model: Transformer) -> EngineOptions:
    """``options`` with the KV pool's positions and ``max_batch`` resolved where they are automatic (``pool_sizes``)."""
    sizes = pool_sizes(model, options.max_batch, options.kv_cache_tokens, options.kv_pool_tokens, options.kv_pool_share)
    return replace(options, max_batch=sizes[0], kv_pool_tokens=sizes[1])


def pool_sizes(model: Transformer, max_batch: int, kv_tokens: int, pool_tokens: int, share: float) -> tuple[int, int]:
    """(max_batch, pool positions) of an engine of ``model`` on its device: the given ones, each where automatic (0)
    as ``standby.kvpool`` sizes it, the pool on CUDA from ``share`` of the device's memory beyond this rank's weights
    (--kv-pool-share); ConfigError when the pool cannot hold one sequence of ``kv_tokens``."""
    pool = pool_tokens
    if pool == AUTO:
        memory = None
        if model.device.type == "cuda":
            weights = sum(tensor.nbytes for tensor in model.parameters())
            memory = int(share * max(torch.cuda.mem_get_info(model.device)[1] - weights, 0))
        position = KVCache.position_bytes(model.config, model.tp, model.dtype)
        pool = auto_pool_tokens(memory, position, max_batch or MAX_AUTO_BATCH, kv_tokens)
    if reason := pool_refusal(pool, kv_tokens):
        setting = f"--kv-pool-tokens {pool_tokens}" + ("" if pool_tokens else " (automatic)")
        fix = "raise --kv-pool-tokens (or --kv-pool-share) or lower --kv-cache-tokens"
        raise ConfigError(f"--kv-cache-tokens {kv_tokens}: {reason} ({setting}); {fix}")
    return max_batch or auto_max_batch(pool), pool


def warm_up(
    allocate: Callable[[], Decoder],
    graphs: bool,
    keep: bool,
    free: Callable[[], object] = lambda: None,
    pace: Callable[[], object] = lambda: None,
) -> Decoder | None:
    """Warm up every shape serving uses on a decoder of the real KV layout from ``allocate``
    (``Decoder.warm_up``). With ``graphs`` the decoder, its KV cache and its CUDA graphs are returned to
    be kept for the engine's life; otherwise it is returned only when ``keep`` (a primary serves from
    it), and a freed one's device memory goes back to the driver (``free`` then drops it on the other
    ranks of a tensor-parallel group), so a standby holds no KV cache. ``pace``: after each shape
    (``standby.pacing``)."""
    start = time.perf_counter()
    decoder = allocate()
    try:
        decoder.warm_up(pace)
    except BaseException:
        decoder.close()  # a shared KV cache's memory is not the allocator's: free it now
        raise
    log.info(
        "warmed up in %.3f s: eager prefills %s, decode at batch 1..%d%s",
        time.perf_counter() - start,
        ", ".join(f"{rows}x{length}" for rows, length in decoder.warm_up_times.prefills_run)
        or "none (the longest one's time read from the host's kernel verdict)",
        decoder.batch,
        f", CUDA graphs {decoder.graph_bytes} bytes" if graphs else f" and {len(decoder.warmed_kv_lengths)} KV lengths",
    )
    if graphs or keep:
        return decoder
    device = decoder.model.device
    del decoder
    free()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return None


def uses_graphs(options: EngineOptions, model: Transformer) -> bool:
    """Whether the engine captures CUDA graphs: --cuda-graphs, on a CUDA device."""
    return options.cuda_graphs and model.device.type == "cuda"


def warm(
    options: EngineOptions,
    model: Transformer,
    channel: tpgroup.Channel | None,
    pacer: Pacer | None = None,
    share: KvShare | None = None,
) -> Decoder | None:
    """``warm_up`` at the flags' shapes (``options`` ``sized``), on this rank or (``channel``) on the whole group; the
    decoder to keep. ``pacer``: a spare's, on one rank. ``share``: where a decoder that is kept allocates its KV
    cache."""
    graphs = uses_graphs(options, model)
    keep = options.role is Role.PRIMARY
    sizes = (options.max_batch, options.kv_cache_tokens, options.kv_pool_tokens)
    make = functools.partial(
        new_decoder, model, *sizes, options.batch_invariant, graphs, share if graphs or keep else None
    )
    if channel is None:
        return warm_up(make, graphs, keep=keep, pace=pacer.step if pacer else lambda: None)
    free = functools.partial(channel.send, tpgroup.Op.FREE)
    return warm_up(tpgroup.group_allocator(channel, make, graphs, options), graphs, keep=keep, free=free)


class EngineServer(AnnouncingServer):
    """The engine's uvicorn: on shutdown, ``cancel`` runs ``cancel_after_s`` in, so requests still
    generating end as at a drain deadline (503, or an SSE error event) rather than by uvicorn cancelling
    their tasks, which logs an "Exception in ASGI application" traceback; uvicorn's own deadline should
    come CANCEL_GRACE_S later."""

    def __init__(
        self,
        config: uvicorn.Config,
        ready: dict[str, object],
        cancel: Callable[[], object],
        cancel_after_s: float,
    ) -> None:
        super().__init__(config, ready)
        self.cancel = cancel
        self.cancel_after_s = cancel_after_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.cancel_after_s, self.cancel)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()


def rank_spec(options: EngineOptions, rank: int) -> LoadSpec:
    """Rank ``rank``'s load spec: the flags', on the rank's device."""
    spec = load_spec_from_args(options, tp_rank=rank)
    return replace(spec, device=tpgroup.rank_device(options.device, options.tp_size, rank))


@dataclass
class Ahead:
    """What a spare did before its start, its daemon serving: the attach and the warm-up (``warm``'s decoder)."""

    prepared: Prepared
    loaded: LoadedModel
    warmed: Decoder | None

    def still_current(self, options: EngineOptions) -> bool:
        """Whether the start can use it: no file of the checkpoint changed and the daemon, if one answers, still
        serves the allocation it maps (module docstring)."""
        if not self.prepared.still_valid(model_dir_from_args(options), rank_spec(options, 0)):
            log.info("spare: the checkpoint changed since it attached: attaching again")
            return False
        assert self.loaded.attachment is not None
        try:
            if self.loaded.attachment.still_served():
                return True
        except (DaemonUnavailable, AttachRefused) as exc:
            log.warning("spare: %s; serving the arena it attached before its start", exc)
            return True
        log.info("spare: its daemon serves another allocation than the one it attached: attaching again")
        return False

    def held(self) -> dict[str, int]:
        """The device memory it holds beside the arena's mapping: the ready message's body."""
        if self.warmed is None:
            return {"kv_cache_bytes": 0, "cuda_graph_bytes": 0}
        return {"kv_cache_bytes": self.warmed.kv.nbytes, "cuda_graph_bytes": self.warmed.graph_bytes}

    def release(self) -> None:
        """Drop the decoder and the model (every view of the arena), then unmap; nothing here is usable after."""
        attachment = self.loaded.attachment
        if self.warmed is not None:
            self.warmed.close()
        del self.loaded, self.warmed
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        assert attachment is not None
        attachment.close()


def prepare_spare(options: EngineOptions) -> tuple[Prepared | None, Ahead | None]:
    """A spare's load before its start: the CUDA context (made and warmed up), the checkpoint's headers, the
    fingerprint, the model skeleton, then (module docstring) the attach and the warm-up, paced by --spare-duty
    until a start message waits (``standby.pacing``). (None, None) where the preparation fails and (prepared,
    None) where the attach does: the load after the start reports it."""
    try:
        prepared = prepare(model_dir_from_args(options), rank_spec(options, 0), skeleton=options.tp_size == 1)
    except HotweightsError as exc:
        log.info("spare: nothing prepared (%s)", exc)
        return None, None
    prepared.context.join()
    if not (options.spare_warm_up and options.weight_cache == "client" and options.tp_size == 1):
        return prepared, None
    start = time.perf_counter()
    try:
        loaded = load_model(
            prepared.model_dir,
            prepared.spec,
            weight_cache="client",
            socket_path=tpgroup.rank_socket(options.socket, 0),
            prepared=prepared,
        )
    except HotweightsError as exc:
        log.info("spare: not attached before its start (%s)", exc)
        return prepared, None
    device = loaded.model.device
    sync = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else lambda: None
    pacer = Pacer(options.spare_duty, functools.partial(readable, options.start_fd), sync)
    try:
        share = KvShare.for_engine(loaded.attachment, device, options.tp_size)
        ahead = Ahead(prepared, loaded, warm(sized(options, loaded.model), loaded.model, None, pacer, share))
    except (torch.OutOfMemoryError, ConfigError) as exc:  # no device memory, or none for its KV pool
        first_line = str(exc).splitlines()[0]
        log.warning("spare: not warmed up before its start, it will at its start: %s", first_line)
        Ahead(prepared, loaded, None).release()
        return prepared, None
    seconds = time.perf_counter() - start
    log.info("spare: attached and warmed up in %.3f s before its start (%.3f s of it paused)", seconds, pacer.paused_s)
    return prepared, ahead


def load_rank(options: EngineOptions, rank: int, group: str, prepared: Prepared | None = None) -> LoadedModel:
    """Load or attach rank ``rank``'s weights (its device, its daemon); errors of a group name it and the rank."""
    try:
        spec = rank_spec(options, rank)
        return load_model(
            model_dir_from_args(options),
            spec,
            weight_cache=options.weight_cache,
            socket_path=tpgroup.rank_socket(options.socket, rank),
            fallback=options.weight_cache_fallback,
            group=dist.group.WORLD if options.tp_size > 1 else None,
            daemon_timeout=options.weight_cache_timeout,
            prepared=prepared,
        )
    except HotweightsError as exc:
        if options.tp_size == 1:
            raise
        raise tpgroup.in_group(exc, group, rank) from None


def start_followers(options: EngineOptions, group: str) -> tuple[tpgroup.Followers, tpgroup.Channel]:
    """Rank 0 of a group: check what can be checked once, start ranks 1..N-1 and join them."""
    try:
        tpgroup.check_group(options.tp_size, options.device, options.socket)
        options = replace(options, model=str(model_dir_from_args(options)))
        check_spec(read_checkpoint(options.model), load_spec_from_args(options))
    except HotweightsError as exc:
        raise tpgroup.in_group(exc, group, 0) from None
    port = free_port()
    commands = [tpgroup.follower_command(options, group, rank, port) for rank in range(1, options.tp_size)]
    followers = tpgroup.Followers(commands, group)
    tpgroup.init_group(options.tp_size, 0, port, tpgroup.rank_device(options.device, options.tp_size, 0))
    return followers, tpgroup.Channel(followers.broken)


def run_follower(options: EngineOptions) -> int:
    """Ranks 1..N-1 of a group: attach, then run rank 0's commands until it stops them or dies. Bad input
    is one line and exit code 2 at once (the process group is not torn down first), so that rank 0, which
    sees the connection close, finds the exit it names."""
    tpgroup.die_with_leader(options.tp_leader)
    try:
        device = tpgroup.rank_device(options.device, options.tp_size, options.tp_rank)
        tpgroup.init_group(options.tp_size, options.tp_rank, options.tp_port, device)
        channel = tpgroup.Channel()
        model = load_rank(options, options.tp_rank, options.engine_id).model
    except HotweightsError as exc:
        tpgroup.exit_refused(tpgroup.in_group(exc, options.engine_id, options.tp_rank))

    def decoder(graphs: bool, max_batch: int, pool_tokens: int) -> Decoder:  # rank 0 sized the pool (``sized``)
        return new_decoder(model, max_batch, options.kv_cache_tokens, pool_tokens, options.batch_invariant, graphs)

    tpgroup.Follower(decoder).run(channel)
    dist.destroy_process_group()
    return 0


def take_slot(options: EngineOptions, message: dict[str, object]) -> EngineOptions:
    """A spare's start message (``hotweights.spawn.Slot``): ``options`` with the slot's port and engine id for
    --port and --engine-id; stdout and stderr go on in the slot's log file. ConfigError for a malformed message."""
    slot = Slot.of(message)
    slot.move_output()
    port = options.port if slot.port is None else slot.port
    return replace(options, port=port, engine_id=slot.engine_id or options.engine_id)


def cmd_engine(args: argparse.Namespace) -> int:
    startclock.mark("command")
    options = EngineOptions.from_args(args)
    check_options(options)
    if options.cpu_threads:
        torch.set_num_threads(options.cpu_threads)
    if options.tp_rank > 0:
        return run_follower(options)
    prepared = ahead = None
    if options.start_fd is not None:  # a spare: prepare (and attach ahead), then wait to be started
        threads, cpus = torch.get_num_threads(), CpuShare()
        prepared, ahead = prepare_spare(options)
        slot = wait_for_start(options.start_fd, options.ready_fd, ahead.held() if ahead else {})
        if slot is None:
            return 0
        cpus.restore()
        torch.set_num_threads(threads)
        options = take_slot(options, slot)
        startclock.mark("spare_wait")  # its preparation too, and with a warm-up ahead its attach and warm-up
        if ahead is not None and not ahead.still_current(options):
            ahead.release()
            prepared = ahead = None
    engine_id = options.engine_id or f"{socket.gethostname()}-{os.getpid()}"
    token = read_token(Path(options.token_file), "--token-file") if options.token_file else None
    sock = bind_port(options.host, options.port)
    followers, channel = start_followers(options, engine_id) if options.tp_size > 1 else (None, None)
    try:
        return serve(options, sock, engine_id, token, channel, followers, prepared, ahead)
    finally:
        if followers is not None:
            followers.stop(channel)
            dist.destroy_process_group()


def serve(
    options: EngineOptions,
    sock: socket.socket,
    engine_id: str,
    token: str | None,
    channel: tpgroup.Channel | None,
    followers: tpgroup.Followers | None,
    prepared: Prepared | None = None,
    ahead: Ahead | None = None,
) -> int:
    """Rank 0 (the only rank without --tp-size): load or attach, warm up (unless a spare did both ``ahead``),
    serve until a signal."""
    if ahead is not None:
        loaded, warmed = ahead.loaded, ahead.warmed
    else:
        loaded = load_rank(options, 0, engine_id, prepared)
        log.info("weights from %s (--weight-cache %s) in %.3f s", loaded.source, loaded.mode, loaded.seconds)
        startclock.mark("weights")  # the CUDA context and the attach (or load) and bind
    model = loaded.model
    options = sized(options, model)
    pool, batch = options.kv_pool_tokens, options.max_batch
    log.info("KV pool: %d positions in blocks of %d; sequences at once: %d", pool, BLOCK_SIZE, batch)
    share = KvShare.for_engine(loaded.attachment, model.device, options.tp_size)
    if ahead is None:
        warmed = warm(options, model, channel, share=share)
        startclock.mark("warm_up")
    role = options.role
    graphs = uses_graphs(options, model)
    sizes = (options.max_batch, options.kv_cache_tokens, options.kv_pool_tokens)
    make = functools.partial(new_decoder, model, *sizes, options.batch_invariant, share=share)
    scheduler = Scheduler(share)
    if channel is None:
        capacity = KvCapacity(scheduler, make, reserved=warmed if graphs else None)
    else:
        allocate = tpgroup.group_allocator(channel, make, False, options)
        capacity = tpgroup.GroupKvCapacity(scheduler, allocate, reserved=warmed if graphs else None, channel=channel)
    if warmed is not None and role is Role.PRIMARY:
        scheduler.attach_kv(warmed)
    roles = Roles(role, capacity, options.drain_timeout)
    metrics = EngineMetrics()
    info = {"engine_id": engine_id, "mode": loaded.mode, "source": loaded.source}
    metrics.bind(roles, capacity.held_bytes, info | {"fingerprint": loaded.fingerprint.digest()})
    metrics.bind_adoption(scheduler)
    ctx = EngineContext(
        engine_id=engine_id,
        model_name=loaded.checkpoint.path.name,
        loaded=loaded,
        tokenizer=load_tokenizer(loaded.checkpoint.path),
        stop_ids=frozenset(stop_token_ids(loaded.checkpoint.path)),
        context_tokens=min(options.kv_cache_tokens, model.config.max_position_embeddings),
        scheduler=scheduler,
        roles=roles,
        metrics=metrics,
        token=token,
        kv_cache_bytes=capacity.held_bytes,
        cuda_graph_bytes=warmed.graph_bytes if graphs else 0,
        rank_pids=(os.getpid(), *(followers.pids if followers else ())),
        group_refusal=functools.partial(followers.refusal, channel) if followers else lambda: None,
        admission=Admission(
            options.max_batch,
            budget_s=options.queue_budget,
            timing=scheduler,
            on_verdict=lambda verdict: metrics.admission.labels(verdict.value).inc(),
            on_wait=metrics.queue_wait.observe,
            blocks=blocks_for(options.kv_pool_tokens),
        ),
    )
    metrics.bind_pool(ctx.pool)
    config = server_config(
        build_app(ctx),
        HttpLimits(body_bytes=options.max_body_bytes),
        ErrorShape.OPENAI,
        early_refusal(ctx),
        host=options.host,
        port=options.port,
        lifespan="off",
        timeout_graceful_shutdown=options.shutdown_timeout + CANCEL_GRACE_S,
    )
    ready = {"engine_id": engine_id, "role": role.value, "fingerprint": ctx.fingerprint}
    ready |= {"kv_cache_bytes": capacity.held_bytes(), "cuda_graph_bytes": ctx.cuda_graph_bytes}
    ready |= {"rank_pids": list(ctx.rank_pids), "start_s": startclock.breakdown()}
    server = EngineServer(config, ready, scheduler.cancel_all, options.shutdown_timeout)

    sys.setswitchinterval(GIL_SWITCH_S)
    scheduler.start()
    signal.signal(FREEZE_SIGNAL, lambda *_: scheduler.freeze())  # the drill's stall fault (standby.progress)
    WATCH.faults.install()  # the drills' gray faults (standby.drillfaults)
    try:
        run_until_signal(server, sock)
    finally:
        scheduler.stop(options.shutdown_timeout + 5)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "engine",
        help="serve a model over HTTP (OpenAI completions) as primary or warm standby",
        description="Load or attach the weights, warm up, then serve OpenAI completions, health checks "
        "and role changes (promote, drain, demote). Prints a JSON ready line to stdout once listening.",
    )
    add_engine_arguments(p)
    p.set_defaults(func=cmd_engine)
