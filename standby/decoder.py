"""The shapes the scheduler runs the model at, warmed up before an engine serves; CUDA graphs of decode.

A ``Decoder`` owns one KV cache (``batch`` slots of ``max_tokens`` positions) and runs two things on
it for the scheduler:

- ``prefill(first, prompts)``: one forward pass over up to ``batch`` prompts, each padded to the next
  length of ``lengths`` (powers of two from 16, ending with ``max_tokens``) that holds the longest,
  written into consecutive slots from ``first``. Padding sits after each prompt, so causal attention
  keeps it out of the prompt's logits; its keys and values are overwritten by the decode steps that
  follow, and masked until then. A prefill holds at most ``max_tokens`` tokens in all (rows times
  padded length: ``prefill_fits``), as one slot's longest prompt does, so prompts that arrive together
  (a queue after a failover) cost one pass instead of one each.
- ``decode(tokens, positions)``: one step for slots 0 .. n-1 at once (``Transformer.decode``), each
  at its own position, attending over the next length of ``lengths`` that holds every row.

So the shapes serving uses form a small fixed set, and ``warm_up`` runs every one of them (and the sampling
path) before the engine reports ready (with graphs, the decode steps only as their captures' first runs):
later requests find every kernel, allocator block and library plan already made. With ``graphs`` (CUDA only)
the decode step at each batch size of ``batch_buckets`` (1, 2, 4, 8, then every multiple of 8, then ``batch``)
and each KV length is captured as a CUDA graph during warm-up, its elementwise steps fused
(``standby.fused``); a step of n rows replays the smallest size that holds them, its extra rows the same dummy
rows the scheduler already feeds free slots (token 0 at position 0 of a slot no sequence uses). A replay
copies the step's tokens and positions into the graph's own input buffer first and returns a copy of its
output, so it never reads a previous step's inputs nor hands out a buffer the next replay overwrites.
Prefills of up to GRAPHED_PREFILL tokens per prompt (the short prompts most requests bring) are captured
too, one graph per prompt count and length, with the eager path's own kernels: an eager pass over every
layer is bound by the host's kernel launches (on ``xl`` ~36 ms, against ~11 ms of device time), and every
sequence in a batch waits for each newcomer's prefill. A prefill from position 0 attends only to its own
keys and values, never to what the cache held, so the graph writes them into a scratch area of its own and
two copies move them into the prefill's slots: one capture serves every first slot. The number of graphs
thus grows with ``batch`` and the lengths, not with their product (``batch`` 64 on ``xl`` would otherwise
take minutes of captures). Graphs point at this cache's memory, which is why a graphed ``Decoder`` is kept for the
engine's whole life (reserved at start-up, standby included) rather than allocated on promote. KV lengths
stay bucketed with graphs too: attention over all ``max_tokens`` positions at every step would cost an
``xl`` step 8 ms more at 4096 (measured on an H200: "Measured facts" in ``docs/architecture.md``).

``batch_invariant``: a sequence's logits then depend on its own tokens only, never on what shares its steps, so
that a request gives the same text alone or in any batch, and a migrated one continues exactly. Low-precision
kernels round differently with a step's shape (a GEMM of 4 rows and one of 64, a prefill of one prompt and one
of several), and a model whose logits are nearly flat turns such rounding into other tokens. So every prefill
holds one prompt (its shape is the prompt's length bucket alone), and every decode step runs at the one shape
(``batch`` rows, ``max_tokens`` KV positions), its unused rows the usual dummy rows. It costs the padding: a step
of one sequence costs what a full batch does, and the prompts that arrive together are prefilled one by one.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from hotweights.standby.fused import fusing
from hotweights.standby.kvshare import SharedKv
from hotweights.standby.model import KVCache, Transformer
from hotweights.standby.sampling import sample_rows, to_host

log = logging.getLogger(__name__)
T = TypeVar("T")

MIN_LENGTH = 16  # the shortest prefill and KV length
GRAPHED_PREFILL = 64  # with graphs, prefills of prompts padded to at most this many tokens replay a capture


def length_buckets(max_tokens: int) -> list[int]:
    """Powers of two from MIN_LENGTH below ``max_tokens``, then ``max_tokens`` itself."""
    lengths = []
    length = MIN_LENGTH
    while length < max_tokens:
        lengths.append(length)
        length *= 2
    return [*lengths, max_tokens]


def bucket(lengths: list[int], n: int) -> int:
    """The smallest of the sorted ``lengths`` that is >= n; ValueError when none is."""
    i = bisect.bisect_left(lengths, n)
    if i == len(lengths):
        raise ValueError(f"{n} tokens exceed the KV slot's {lengths[-1]}")
    return lengths[i]


def batch_buckets(batch: int) -> list[int]:
    """The decode batch sizes captured as graphs: 1, 2, 4, 8, every multiple of 8 below ``batch``, ``batch``."""
    sizes = [n for n in (1, 2, 4) if n < batch] + list(range(8, batch, 8))
    return [*sizes, batch]


def _step(model: Transformer, inputs: torch.Tensor, kv: KVCache, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for ``inputs`` (2, B) (tokens, positions): (B, V) logits and each row's argmax."""
    logits = model.decode(inputs[0], inputs[1], kv, kv_len)
    return logits, logits.argmax(-1)


def _captured(device: torch.device, pool: object, step: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """``step`` run once on a side stream (lazy initialisation and compiles, which a capture cannot hold), then
    captured as a CUDA graph in ``pool``: the graph, and what the captured call returned (its static outputs)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = step()
    return graph, outputs


class DecodeGraph:
    """One decode step (and its rows' argmax) at a fixed batch size and KV length, captured as a CUDA graph with
    its elementwise steps fused."""

    def __init__(self, model: Transformer, kv: KVCache, batch: int, kv_len: int, pool: object) -> None:
        self.inputs = torch.zeros((2, batch), dtype=torch.long, device=model.device)  # tokens, positions

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            with fusing():
                return _step(model, self.inputs, kv, kv_len)

        self.graph, (self.logits, self.argmax) = _captured(model.device, pool, step)  # (batch, V), (batch,)

    def run(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, V) logits and (batch,) argmax for ``inputs`` (2, batch): every input written before
        the replay, the outputs copied after it."""
        self.inputs.copy_(inputs)
        self.graph.replay()
        return self.logits.clone(), self.argmax.clone()


class PrefillGraph:
    """One prefill of ``rows`` padded prompts of ``length`` tokens from position 0, captured as a CUDA graph with
    the same kernels the eager pass runs (so the same results), its keys and values written into ``scratch``
    (a flat (layers, N) pair, N >= rows * length * kv heads * head dim) and copied into the slots of a replay."""

    def __init__(self, model: Transformer, scratch: KVCache, rows: int, length: int, pool: object) -> None:
        self.ids = torch.zeros((rows, length), dtype=torch.long, device=model.device)
        shape = (scratch.k.shape[0], rows, model.config.num_key_value_heads // model.tp.size, length, -1)
        n = rows * length * shape[2] * model.config.head_dim
        self.written = KVCache(scratch.k[:, :n].view(shape), scratch.v[:, :n].view(shape))  # (L, rows, nkv, T, hd)
        self.graph, self.hidden = _captured(model.device, pool, lambda: model.hidden(self.ids, 0, self.written))

    def run(self, ids: torch.Tensor, kv: KVCache, first: int) -> torch.Tensor:
        """(rows, length, H) hidden states of ``ids``, valid until the next replay; their keys and values are
        written into slots ``first`` .. of ``kv``."""
        self.ids.copy_(ids)
        self.graph.replay()
        rows, length = self.ids.shape
        kv.k[:, first : first + rows, :, :length].copy_(self.written.k)
        kv.v[:, first : first + rows, :, :length].copy_(self.written.v)
        return self.hidden


class Decoder:
    """The model and one KV cache, run at the fixed shapes the module docstring lists. One thread only."""

    def __init__(
        self,
        model: Transformer,
        kv: KVCache,
        graphs: bool = False,
        batch_invariant: bool = False,
        shared: SharedKv | None = None,
    ) -> None:
        """``shared``: where ``kv`` lies when it can outlive the engine (``standby.kvshare``), its ledger included."""
        if graphs and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {model.device}")
        self.model = model
        self.kv = kv
        self.shared = shared
        self.graphs_enabled = graphs
        self.batch_invariant = batch_invariant
        self.lengths = length_buckets(kv.max_tokens)  # of prefills
        self.kv_lengths = self.lengths[-1:] if batch_invariant else self.lengths  # the KV positions decode reads
        self.graph_bytes = 0  # device memory the captured graphs hold
        self.graph_batches = [kv.batch] if batch_invariant else batch_buckets(kv.batch)  # decode's batch sizes
        self._graphs: dict[tuple[int, int], DecodeGraph] = {}  # (batch size, KV length) -> its captured step
        self._prefills: dict[tuple[int, int], PrefillGraph] = {}  # (rows, length) -> its capture
        self.prefill_times: dict[tuple[int, int], float] = {}  # (rows, length) -> its seconds at warm-up

    @property
    def batch(self) -> int:
        return self.kv.batch

    def close(self) -> None:
        """Free a shared KV cache's memory now (a plain one goes with the last reference)."""
        if self.shared is not None:
            self.shared.close()

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def prefill_fits(self, rows: int, longest: int) -> bool:
        """Whether ``rows`` prompts, the longest of ``longest`` tokens, make one prefill (module docstring)."""
        fits = 0 < longest <= self.lengths[-1] and 0 < rows <= (1 if self.batch_invariant else self.batch)
        return fits and rows * bucket(self.lengths, longest) <= self.lengths[-1]

    def check_prefill(self, first: int, prompts: list[list[int]]) -> tuple[int, int]:
        """(rows, longest prompt) of a prefill of ``prompts`` from slot ``first``; ValueError unless it fits."""
        rows, longest = len(prompts), max(map(len, prompts))
        if not self.prefill_fits(rows, longest) or first + rows > self.batch:
            raise ValueError(f"{rows} prompts of up to {longest} tokens from slot {first} do not fit one prefill")
        return rows, longest

    def prefill(self, first: int, prompts: list[list[int]]) -> torch.Tensor:
        """Write ``prompts[i]`` into KV slot ``first + i`` from position 0, in one forward pass; (len(prompts), V)
        float32 logits, row i for the token after ``prompts[i]``. ValueError unless ``prefill_fits``."""
        rows, longest = self.check_prefill(first, prompts)
        length = bucket(self.lengths, longest)
        ids = torch.zeros((rows, length), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        graph = self._prefills.get((rows, length))
        if graph is not None:
            hidden = graph.run(ids, self.kv, first)
        else:
            hidden = self.model.hidden(ids.to(self.model.device), 0, self.kv.rows(first, rows))
        last = torch.tensor([len(prompt) - 1 for prompt in prompts], device=self.model.device)
        return self.model.logits(hidden[torch.arange(rows, device=self.model.device), last])

    def decode(self, tokens: list[int], positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        """(n, V) float32 logits and each row's argmax (the greedy token): slot b is fed ``tokens[b]``
        at ``positions[b]``, for b < n <= batch. With graphs or ``batch_invariant``, the slots from n up to the
        batch size run must be free: position 0 of each is written. Waits for the device without holding the GIL,
        so the engine's HTTP thread runs meanwhile."""
        n = len(tokens)
        kv_len = bucket(self.kv_lengths, max(positions) + 1)
        size = bucket(self.graph_batches, n)
        graph = self._graphs.get((size, kv_len))
        if graph is None and not self.batch_invariant:
            size = n  # eager: the rows there are
        free = [0] * (size - n)  # rows past n: token 0 at position 0 of a free slot
        inputs = torch.tensor([tokens + free, positions + free], dtype=torch.long)
        if graph is not None:
            logits, argmax = graph.run(inputs)
        else:
            logits, argmax = _step(self.model, inputs.to(self.model.device), self.kv, kv_len)
        return logits[:n], to_host(argmax[:n])

    def warm_up(self, pace: Callable[[], object] = lambda: None) -> None:
        """Run every shape serving uses (module docstring) and the sampling path once; with graphs, capture the
        decode step at every batch size instead of running it eagerly (a capture runs its step once first).
        ``pace`` is called after each shape (``standby.pacing.Pacer.step``); each prefill's time is kept in
        ``prefill_times`` (what ``standby.progress`` expects of a prefill of its shape). Leaves finite garbage in the
        KV cache, which serving overwrites before it reads (reads beyond a sequence's length are masked)."""
        device = self.model.device
        for rows in range(1, self.batch + 1):
            for length in self.lengths:
                if self.prefill_fits(rows, length):
                    started = time.monotonic()
                    logits = self.prefill(0, [[0] * length] * rows)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    self.prefill_times[rows, length] = time.monotonic() - started
                    pace()
        if not self.graphs_enabled:
            for n in self.graph_batches if self.batch_invariant else range(1, self.batch + 1):
                for kv_len in self.kv_lengths:
                    self.decode([0] * n, [kv_len - 1] * n)
                    pace()
        for rows in (1, self.batch):  # the sampling path: one row, and every slot at once
            sample_rows(logits[:1].expand(rows, -1), [1.0] * rows, [0.9] * rows, [0.5] * rows)
            sample_rows(logits[:1].expand(rows, -1), [0.0] * rows, [1.0] * rows, [0.5] * rows)
        if self.graphs_enabled:
            self._capture(pace)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _capture(self, pace: Callable[[], object]) -> None:
        """A graph per batch size and KV length, and per short prefill (module docstring), sharing one memory
        pool; ``graph_bytes`` is what they added. ``pace`` after each capture."""
        device = self.model.device
        before = _reserved_in_use(device)
        pool = torch.cuda.graph_pool_handle()
        for n in self.graph_batches:
            for kv_len in self.kv_lengths:
                graph = self._graphs[n, kv_len] = DecodeGraph(self.model, self.kv, n, kv_len, pool)
                graph.run(torch.zeros((2, n), dtype=torch.long))  # a first replay, as serving's would be
                pace()
        prefills = self.graphed_prefills()
        if prefills:
            scratch = self.prefill_scratch(prefills)
            for rows, length in prefills:
                prefill = self._prefills[rows, length] = PrefillGraph(self.model, scratch, rows, length, pool)
                prefill.run(torch.zeros((rows, length), dtype=torch.long), self.kv, 0)
                pace()
        self.graph_bytes = _reserved_in_use(device) - before
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s, KV lengths %s) and %d prefill graphs: %d bytes",
            len(self._graphs),
            self.graph_batches,
            self.kv_lengths,
            len(self._prefills),
            self.graph_bytes,
        )

    def prefill_scratch(self, prefills: list[tuple[int, int]]) -> KVCache:
        """Flat (layers, N) keys and values that the largest of ``prefills`` (rows, length) fills."""
        layers, _, heads, _, head_dim = self.kv.k.shape
        size = max(rows * length for rows, length in prefills) * heads * head_dim
        k, v = (torch.zeros((layers, size), dtype=self.kv.k.dtype, device=self.kv.k.device) for _ in range(2))
        return KVCache(k, v)

    def graphed_prefills(self) -> list[tuple[int, int]]:
        """(rows, length) of every prefill captured with graphs: lengths up to GRAPHED_PREFILL."""
        short = [length for length in self.lengths if length <= GRAPHED_PREFILL]
        return [
            (rows, length) for rows in range(1, self.batch + 1) for length in short if self.prefill_fits(rows, length)
        ]


def _reserved_in_use(device: torch.device) -> int:
    """Device memory torch's allocator holds for live tensors and graph pools, once its unused cached
    blocks (e.g. warm-up's scratch) are returned to the driver."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)
