"""Tensor-parallel engine groups: rank 0 serves and drives the steps, ranks 1..N-1 follow them.

``hotweights engine --tp-size N`` is one engine made of N rank processes in one torch.distributed process
group (gloo on CPU; NCCL on CUDA, rank r on ``cuda:r``). Rank 0 is the process that was started: it binds
the port, starts ranks 1..N-1 as its children (``follower_command``), serves HTTP and runs the scheduler.
Every rank attaches its own rank's arena (its own daemon, ``cache serve --tp-rank r``). The model's
forward already all-reduces and all-gathers across the ranks; what the followers need from rank 0 is
*which* forward to run, so every decoder call on rank 0 first broadcasts a command (``Op``) on a gloo
group of its own, and each follower runs the same call on its own ``Decoder``:

    header  int64[4]  (op, payload length, a, b)          one broadcast from rank 0
    payload int64[n]  (prompt count, lengths and ids; or tokens + positions)  a second one, when n > 0

Only rank 0 samples (the logits are all-gathered, so it has the whole vocabulary). A follower holds at
most one decoder (KV cache) at a time, as rank 0 does: ``ALLOCATE`` replaces it, ``FREE`` drops it.

The group lives and dies as one (nothing is left holding memory or a port):

- A follower dies with rank 0: ``PR_SET_PDEATHSIG`` SIGKILL, set by the follower itself (and it exits at
  once if rank 0 is already gone). Rank 0 starts followers from its main thread, because the kernel sends
  that signal when the *thread* that forked the child ends.
- Rank 0 dies with any follower: a thread per follower waits for its exit and ends rank 0 at once
  (``os._exit``, no graceful stop: the group cannot compute any more), and a collective that fails during
  a step ends it the same way, so no request is answered from a broken group; a load balancer or the
  gateway sees a dead engine and re-sends the request elsewhere.
- Followers ignore SIGINT and SIGTERM: rank 0 stops them (``STOP``) after its own graceful stop. All ranks
  share rank 0's process group, so a supervisor's ``killpg`` reaches every rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from hotweights.engines import SOCKET_RANK
from hotweights.errors import ConfigError, HotweightsError
from hotweights.spawn import hotweights_command
from hotweights.standby.decoder import Decoder, Launched, bucket
from hotweights.standby.engineoptions import EngineOptions
from hotweights.standby.roles import KvCapacity

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h
IDLE_LIMIT = timedelta(days=365)  # a follower waits this long for rank 0's next command (an idle engine)
BROKEN_GRACE_S = 3.0  # how long a failed collective waits for the follower exit that likely caused it
STOP_TIMEOUT_S = 10.0  # how long rank 0 waits for a stopped follower before it kills it
STEP_STALL_S = 10.0  # a step of the group running this long means a rank hangs: rank 0 is then not ready


class GroupError(HotweightsError):
    """A tensor-parallel group cannot start: the message names the engine and the rank."""


class Op(IntEnum):
    ALLOCATE = 1  # a: 1 for CUDA graphs; payload: rows, pool positions; a fresh KV cache, replacing the current one
    WARM_UP = 2
    PREFILL = 3  # a: slot; payload: prompt ids
    DECODE = 4  # payload: tokens then positions
    FREE = 5  # drop the KV cache
    STOP = 6
    TABLE = 7  # a: row; payload: its blocks (none: the row is free)


# --- checks and names -----------------------------------------------------------------------------


def rank_device(device: str, size: int, rank: int) -> str:
    """The device of ``rank`` in a group of ``size`` given ``--device``: ``cpu`` for every rank, ``cuda``
    (or ``cuda:r`` for rank r itself) gives rank r ``cuda:r``. Raises ConfigError for anything else."""
    kind = torch.device(device)
    if size == 1 or kind.type == "cpu":
        return device
    if kind.type != "cuda":
        raise ConfigError(f"--device {device}: a tensor-parallel group runs on cpu or cuda")
    if kind.index is not None and kind.index != rank:
        raise ConfigError(
            f"--device {device} is not this rank's GPU: rank r of a group of {size} runs on cuda:r; pass --device cuda"
        )
    return f"cuda:{rank}"


def check_group(size: int, device: str, socket_path: str | None) -> None:
    """Refuse a group that cannot run here (rank 0, before it starts any follower)."""
    rank_device(device, size, 0)
    if torch.device(device).type == "cuda" and size > (found := torch.cuda.device_count()):
        raise ConfigError(f"--tp-size {size} needs one GPU per rank, found {found} GPU(s)")
    if socket_path and SOCKET_RANK not in socket_path:
        raise ConfigError(
            f"--socket {socket_path} names one daemon, but --tp-size {size} needs one per rank: put "
            f"{SOCKET_RANK} in it (e.g. g0.r{SOCKET_RANK}.sock), or leave it unset"
        )


def rank_socket(socket_path: str | None, rank: int) -> str | None:
    """Rank ``rank``'s daemon socket from a ``--socket`` with the ``{rank}`` placeholder."""
    return socket_path.replace(SOCKET_RANK, str(rank)) if socket_path else None


def in_group(exc: HotweightsError, group: str, rank: int) -> GroupError:
    """``exc`` as one line that names the group and the rank (once: a GroupError names them already)."""
    return exc if isinstance(exc, GroupError) else GroupError(f"engine {group} rank {rank}: {exc}")


def exit_refused(exc: HotweightsError) -> NoReturn:
    """A follower's bad input: the CLI's one line, then exit code 2 at once."""
    print(f"hotweights engine: error: {exc}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(2)


# --- the command channel --------------------------------------------------------------------------


class Channel:
    """Rank 0's commands to the followers over a gloo group of their own (any backend's world). ``send``
    may be called from any thread of rank 0: one command goes out whole before the next; a send that
    fails calls ``broken`` (rank 0's), which ends the process. Followers pass no ``broken``."""

    def __init__(self, broken: Callable[[str], NoReturn] | None = None) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE_LIMIT)
        self.broken = broken
        self.step_since: float | None = None  # time.monotonic() when the step in progress was sent
        self._lock = threading.Lock()

    def send(self, op: Op, a: int = 0, payload: Sequence[int] = ()) -> None:
        with self._lock:
            try:
                dist.broadcast(torch.tensor([op, len(payload), a, 0], dtype=torch.long), 0, group=self.group)
                if payload:
                    dist.broadcast(torch.tensor(payload, dtype=torch.long), 0, group=self.group)
            except Exception as exc:
                self.broken(f"sending {op.name}: {type(exc).__name__}: {exc}")

    def receive(self) -> tuple[Op, int, list[int]]:
        """The next command: (op, a, payload). Blocks for as long as rank 0 sends nothing."""
        header = torch.empty(4, dtype=torch.long)
        dist.broadcast(header, 0, group=self.group)
        op, n, a, _ = header.tolist()
        payload = torch.empty(n, dtype=torch.long)
        if n:
            dist.broadcast(payload, 0, group=self.group)
        return Op(op), a, payload.tolist()


class GroupDecoder:
    """Rank 0's decoder: each call is broadcast to the followers, then run here; everything else is the
    local ``Decoder``'s. A request the local decoder would refuse (too long) is refused before anything
    is sent; a failure after it is a broken group."""

    chains = False  # a step chained behind another would run on this rank alone (``Decoder.chain``)

    def __init__(self, local: Decoder, channel: Channel) -> None:
        self.local = local
        self.channel = channel

    def __getattr__(self, name: str) -> object:
        return getattr(self.local, name)

    def prefill(self, first: int, prompts: list[list[int]]) -> torch.Tensor:
        self.local.check_prefill(first, prompts)  # refused before anything is sent
        payload = [len(prompts), *map(len, prompts), *itertools.chain.from_iterable(prompts)]
        return self._run(Op.PREFILL, first, payload, lambda: self.local.prefill(first, prompts))

    def decode(self, tokens: list[int], positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        return self.finish(self.launch(tokens, positions))

    def launch(self, tokens: list[int], positions: list[int]) -> Launched:
        """The step on every rank (each follower runs it whole); here queued, its results ``finish``'s."""
        bucket(self.local.lengths, max(positions) + 1)
        return self._run(Op.DECODE, 0, [*tokens, *positions], lambda: self.local.launch(tokens, positions))

    def finish(self, step: Launched) -> tuple[torch.Tensor, list[int]]:
        return self.local.finish(step)

    def assign(self, row: int, blocks: list[int]) -> None:
        self._run(Op.TABLE, row, blocks, lambda: self.local.assign(row, blocks))

    def warm_up(self, pace: Callable[[], object] = lambda: None) -> None:
        """``Decoder.warm_up`` on every rank; ``pace`` paces this rank (collectives keep the others in step)."""
        self._run(Op.WARM_UP, 0, (), lambda: self.local.warm_up(pace))

    def _run(self, op: Op, a: int, payload: Sequence[int], call: Callable[[], object]) -> object:
        self.channel.step_since = time.monotonic()
        self.channel.send(op, a, payload)
        try:
            return call()
        except Exception as exc:  # the followers run the same call: every rank's step is lost
            self.channel.broken(f"{op.name}: {type(exc).__name__}: {exc}")
        finally:
            self.channel.step_since = None


@dataclass
class GroupKvCapacity(KvCapacity):
    """``KvCapacity`` for rank 0: a released KV cache is dropped on every rank."""

    channel: Channel | None = None

    def release(self, grace_s: float) -> tuple[dict[str, object], str]:
        reply = super().release(grace_s)
        if self.reserved is None:
            self.channel.send(Op.FREE)
        return reply


def group_allocator(
    channel: Channel, make: Callable[[], Decoder], graphs: bool, options: EngineOptions
) -> Callable[[], GroupDecoder]:
    """Rank 0's decoder factory: every rank allocates its KV cache, of the rows and pool positions rank 0 sized
    (``options``, ``standby.engine.sized``), then rank 0 wraps its own."""

    def allocate() -> GroupDecoder:
        channel.send(Op.ALLOCATE, int(graphs), (options.max_batch, options.kv_pool_tokens))
        return GroupDecoder(make(), channel)

    return allocate


# --- rank 0: the followers ------------------------------------------------------------------------


def follower_command(options: EngineOptions, group: str, rank: int, port: int) -> list[str]:
    """The argv of follower ``rank``: the load, weight-cache and decoder flags rank 0 was given."""
    command = hotweights_command(*(["-v"] if options.verbose else []), "engine", "--engine-id", group)
    command += ["--tp-size", str(options.tp_size), "--tp-rank", str(rank), "--tp-port", str(port)]
    command += ["--tp-leader", str(os.getpid()), "--device", rank_device(options.device, options.tp_size, rank)]
    command += ["--weight-cache", options.weight_cache]
    command += ["--weight-cache-timeout", str(options.weight_cache_timeout)]
    command += ["--kv-cache-tokens", str(options.kv_cache_tokens), "--max-batch", str(options.max_batch)]
    command += ["--cuda-graphs" if options.cuda_graphs else "--no-cuda-graphs"]
    for flag in ("model", "dtype", "quantize", "socket", "weight_cache_fallback"):
        if value := getattr(options, flag):
            command += [f"--{flag.replace('_', '-')}", str(value)]
    return command


class Followers:
    """Ranks 1..N-1 as rank 0's children, watched: one that exits unasked ends rank 0 (module docstring)."""

    def __init__(self, commands: list[list[str]], group: str) -> None:
        self.group = group
        self.stopping = False
        self._ending = threading.Lock()
        # stdout is rank 0's alone (its ready line); the followers log to the same stderr.
        self.processes = [subprocess.Popen(command, stdout=subprocess.DEVNULL) for command in commands]
        for rank, process in enumerate(self.processes, start=1):
            threading.Thread(target=self._watch, args=(rank, process), name=f"rank-{rank}", daemon=True).start()

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(process.pid for process in self.processes)

    def refusal(self, channel: Channel) -> str | None:
        """Why rank 0 is not ready although its own thread runs: a follower is stopped (SIGSTOP; it cannot
        join the next collective), or a step has waited on the ranks for STEP_STALL_S. None: all is well."""
        for rank, process in enumerate(self.processes, start=1):
            if _is_stopped(process.pid):
                return f"rank {rank} (pid {process.pid}) of the tensor-parallel group is stopped"
        since = channel.step_since
        if since is not None and (waited := time.monotonic() - since) > STEP_STALL_S:
            return f"a step of the tensor-parallel group has waited on its ranks for {waited:.0f} s"
        return None

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        if not self.stopping:
            self._go_down(f"rank {rank} exited with code {code}", 2 if code == 2 else 1)

    def broken(self, reason: str) -> NoReturn:
        """End rank 0 because a collective or a command failed: name the follower that exited, if one did
        within BROKEN_GRACE_S (its exit is the cause; the failure only its echo), else the failure."""
        deadline = time.monotonic() + BROKEN_GRACE_S
        for rank, process in enumerate(self.processes, start=1):
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = process.wait(max(0.0, deadline - time.monotonic()))
                self._go_down(f"rank {rank} exited with code {code}", 2 if code == 2 else 1)
        self._go_down(f"rank 0: {reason}", 1)

    def _go_down(self, why: str, code: int) -> NoReturn:
        """One line on stderr, then exit at once (whichever thread comes first; the others wait for it)."""
        self._ending.acquire()
        print(f"hotweights engine: error: engine {self.group}: {why}; the whole group goes down", file=sys.stderr)
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)

    def stop(self, channel: Channel | None) -> None:
        """Ask every follower to stop (when the channel is up), then wait, killing any that lingers."""
        self.stopping = True
        if channel is not None:
            channel.send(Op.STOP)
        for rank, process in enumerate(self.processes, start=1):
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.error("rank %d did not stop within %.0f s; killing it", rank, STOP_TIMEOUT_S)
                process.kill()
                process.wait()


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal or a tracer (state T or t in /proc); False once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rindex(")") + 2] in "Tt"


def init_group(size: int, rank: int, port: int, device: str) -> None:
    """Join the group's process group: NCCL on CUDA (this rank's GPU made current), else gloo."""
    backend = "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        backend = "nccl"
        # NVLink multicast (NVLS) can put a host's shared GPUs out of service; opt in with NCCL_NVLS_ENABLE=1.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)


# --- a follower -----------------------------------------------------------------------------------


def die_with_leader(leader_pid: int) -> None:
    """SIGKILL this process when rank 0 (its parent) ends; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != leader_pid:
        log.error("rank 0 (pid %d) is gone before this rank started; exiting", leader_pid)
        os._exit(1)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


class Follower:
    """A follower rank: rank 0's commands run on this rank's decoder, one at a time. ``make(graphs, rows, pool
    positions)`` allocates a decoder; at most one is held (``ALLOCATE`` drops the previous one first)."""

    def __init__(self, make: Callable[[bool, int, int], Decoder]) -> None:
        self.make = make
        self.decoder: Decoder | None = None

    def run(self, channel: Channel) -> None:
        """Until ``STOP``. Any failure raises: the follower then exits, which ends the group."""
        handlers = {
            Op.ALLOCATE: self.allocate,
            Op.FREE: self.free,
            Op.WARM_UP: lambda a, payload: self.decoder.warm_up(),
            Op.PREFILL: self.prefill,
            Op.DECODE: self.decode,
            Op.TABLE: lambda a, payload: self.decoder.assign(a, payload),
        }
        while (command := channel.receive())[0] is not Op.STOP:
            op, a, payload = command
            handlers[op](a, payload)

    def prefill(self, first: int, payload: list[int]) -> None:
        rows = payload[0]
        lengths, tokens = payload[1 : 1 + rows], payload[1 + rows :]
        ends = list(itertools.accumulate(lengths))  # the prompts, one after another
        self.decoder.prefill(first, [tokens[end - n : end] for n, end in zip(lengths, ends, strict=True)])

    def decode(self, a: int, payload: list[int]) -> None:
        n = len(payload) // 2  # tokens, then positions
        self.decoder.decode(payload[:n], payload[n:])

    def allocate(self, graphs: int, payload: list[int]) -> None:
        self.free(0, payload)
        rows, pool_tokens = payload
        self.decoder = self.make(bool(graphs), rows, pool_tokens)

    def free(self, a: int, payload: list[int]) -> None:
        self.decoder = None
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # the KV cache's memory goes back to the driver, as on rank 0
