"""The shapes the scheduler runs the model at, warmed up before an engine serves; CUDA graphs of decode.

A ``Decoder`` owns one paged KV cache (``standby.kvpool``: a pool of blocks, and a block table of ``batch`` rows of up
to ``max_tokens`` positions; the scheduler gives a row its blocks with ``assign``) and runs two things on it for the
scheduler:

- ``prefill(first, prompts)``: one forward pass over up to ``batch`` prompts, each padded to the next
  length of ``lengths`` (powers of two from 16, ending with ``max_tokens``) that holds the longest,
  written into the blocks of consecutive rows from ``first``. Padding sits after each prompt, so causal attention
  keeps it out of the prompt's logits; its keys and values are overwritten by the decode steps that
  follow, and masked until then (padding past a row's blocks lands in the null block). A prefill holds at most
  ``max_tokens`` tokens in all (rows times padded length: ``prefill_fits``), as one row's longest prompt does, so
  prompts that arrive together (a queue after a failover) cost one pass instead of one each.
- ``decode(tokens, positions)``: one step for rows 0 .. n-1 at once (``Transformer.decode``), each
  at its own position. Graphed where the split-KV kernels serve the model (``split_kv``: CUDA with Triton,
  ``standby.decodeattention``), each row attends over its own length, device data, so the step's shape is
  its batch size alone; otherwise over the next length of ``lengths`` that holds every row, with a mask.

So the shapes serving uses form a small fixed set, and ``warm_up`` runs them (and the sampling path) before the
engine reports ready (with graphs, the decode steps as their captures' first runs): later requests find every
kernel, allocator block and library plan already made. Eagerly, though, only the shapes
of up to WARMED_LENGTH tokens (the longest that fits) at one row and every row, and one prompt filling a whole row
(its time is what the progress check expects of the longest prefills, ``standby.progress``; with graphs only the
host's first engine runs it, later ones read its time, ``standby.kernelcheck``); with graphs, the short
shapes are the graphed prefills instead, which their captures time: ``warmed_prefills``. The progress check bounds
the other shapes' prefills from theirs. The first run
of any other shape costs what its later runs do, there being no per-shape plan to make (cuDNN's attention is
excluded, ``standby.model``), while running them all cost a new engine seconds of its start (every prompt count up to
4096 tokens in all, every batch size up to a ``batch`` of 32 on CPU). Measured: on an H100
with ``xl`` (``bench/warmup.py --cold-shapes``) each prefill shape's first run in a process cost at most 9.9 ms more
than its second, where running them all took 2.35 s of warm-up; on CPU with ``tiny`` a first prefill of 4096
tokens 0.69 s against 0.62-0.71 s again, a first decode step at KV length 4096 within the later ones' spread.
With ``graphs`` (CUDA only)
the decode step at each batch size of ``batch_buckets`` (the powers of two below ``batch``, then ``batch``)
is captured as a CUDA graph during warm-up (with ``split_kv`` one graph per batch size, serving every KV length;
without it one per batch size and KV length), its elementwise steps fused
(``standby.fused``), each kernel first checked against plain torch on the device (``standby.kernelcheck``: one
that fails there is not used); a step of n rows replays the smallest size that holds them, its extra rows the same dummy
rows the scheduler already feeds free rows (token 0 at position 0 of a row no sequence uses: the null block). A replay
copies the step's tokens and positions into the graph's own input buffer first and returns a copy of its output, so it
never reads a previous step's inputs nor hands out a buffer the next replay overwrites. Prefills of up to
GRAPHED_PREFILL_ROWS prompts of up to GRAPHED_PREFILL tokens each (the short prompts most requests bring, a few at a
time) are captured too, one graph per prompt count of ``batch_buckets``, of the longest length up to GRAPHED_PREFILL
that fits (fewer prompts replay the next count up, their padding rows written into the null block; shorter prompts
are padded to its length, as to a bucket), with the eager path's own kernels: an eager pass over
every layer is bound by the host's kernel launches (on ``xl`` ~36 ms, against ~11 ms of device time), and every sequence
in a batch waits for each newcomer's prefill. A larger prefill runs eagerly: it costs those launches once for all its
prompts, and capturing every prompt count up to a ``batch`` of 64 would hold an output per capture. A prefill from
position 0 attends only to its own keys and values, never to what the cache held; the graph writes them through a block
table of its own, into which a replay copies its rows' entries first: one capture serves every first row. The number of
graphs thus grows with the logarithm of ``batch``, not with its product with the lengths (``batch`` 64 on ``xl``
would otherwise take minutes of captures), and each capture is a share of a new engine's start: on ``xl`` some
0.1 s. Graphs point at this cache's memory (its blocks and table), which is why a graphed ``Decoder`` is kept for the
engine's whole life (reserved at start-up, standby included) rather than allocated on promote. Why one
decode graph per batch size: a graph replays fixed shapes, and with masked SDPA the KV length is one of them (attention
over all ``max_tokens`` positions at every step would cost an ``xl`` step 8 ms more at 4096, measured on an H200:
"Measured facts" in ``docs/architecture.md``), so the lengths were bucketed, 9 of them up to 4096 times the batch sizes,
each capture and its first run a share of a standby's warm-up. The split-KV kernels read each row's length on the device
and stop there, so one capture per batch size costs a step what its rows' lengths cost. Without graphs
(``--no-cuda-graphs``, CPU) decode keeps the masked SDPA at bucketed lengths: eagerly a shape is only a first run, and
CPU has no Triton kernels to run.

``batch_invariant``: a sequence's logits then depend on its own tokens only, never on what shares its steps, so
that a request gives the same text alone or in any batch, and a migrated one continues exactly. Low-precision
kernels round differently with a step's shape (a GEMM of 4 rows and one of 64, a prefill of one prompt and one
of several), and a model whose logits are nearly flat turns such rounding into other tokens. So every prefill
holds one prompt (its shape is the prompt's length bucket alone), and every decode step runs at the one shape
(``batch`` rows, ``max_tokens`` KV positions), its unused rows the usual dummy rows. Which blocks hold a sequence
never changes what it computes: its keys and values are the same wherever they lie. It costs the padding: a step
of one sequence costs what a full batch does, and the prompts that arrive together are prefilled one by one.
With ``split_kv`` attention computes each row from its own query, keys, values and length alone, whatever the
batch, so only the rows are padded: a step pays its rows' lengths, not ``max_tokens`` positions each.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from hotweights.standby import decodeattention, kernelcheck
from hotweights.standby.fused import fusing
from hotweights.standby.kvpool import NULL_BLOCK
from hotweights.standby.kvshare import SharedKv
from hotweights.standby.model import KVCache, Transformer
from hotweights.standby.sampling import sample_rows
from hotweights.standby.steptimes import WATCH, Clock, StepWatch

log = logging.getLogger(__name__)
T = TypeVar("T")

MIN_LENGTH = 16  # the shortest prefill and KV length
GRAPHED_PREFILL = 64  # with graphs, prefills of prompts padded to at most this many tokens replay a capture ...
GRAPHED_PREFILL_ROWS = 8  # ... when they hold at most this many prompts (a larger prefill runs eagerly: docstring)
WARMED_LENGTH = 64  # warm-up runs the shapes of at most this many tokens eagerly, and the longest (docstring)


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
    """The decode batch sizes captured as graphs, and the prompt counts of graphed prefills up to ``batch``: the
    powers of two below ``batch``, then ``batch``."""
    return [*(2**i for i in range((batch - 1).bit_length())), batch]


def _step(
    model: Transformer, inputs: torch.Tensor, kv: KVCache, kv_len: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for ``inputs`` (2, B) (tokens, positions): (B, V) logits and each row's argmax. ``kv_len``
    as for ``Transformer.decode`` (None: each row's own length, split-KV)."""
    logits = model.decode(inputs[0], inputs[1], kv, kv_len)
    return logits, logits.argmax(-1)


def _captured(device: torch.device, pool: object, step: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T, float]:
    """``step`` run once on a side stream (lazy initialisation and compiles, which a capture cannot hold), then
    captured as a CUDA graph in ``pool``: the graph, what the captured call returned (its static outputs), and the
    seconds of that first run (its compiles included)."""
    started = time.perf_counter()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    first_run = time.perf_counter() - started
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = step()
    return graph, outputs, first_run


class DecodeGraph:
    """One decode step (and its rows' argmax) at a fixed batch size, and KV length unless ``kv_len`` is None (each
    row's own, split-KV), captured as a CUDA graph with its elementwise steps fused; ``first_run_s``: the seconds
    of its step's run before the capture (the compiles of its kernels included)."""

    def __init__(
        self, model: Transformer, kv: KVCache, batch: int, kv_len: int | None, pool: object, fuse: bool = True
    ) -> None:
        self.inputs = torch.zeros((2, batch), dtype=torch.long, device=model.device)  # tokens, positions

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            with fusing() if fuse else contextlib.nullcontext():
                return _step(model, self.inputs, kv, kv_len)

        self.graph, (self.logits, self.argmax), self.first_run_s = _captured(model.device, pool, step)

    def run(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, V) logits and (batch,) argmax for ``inputs`` (2, batch): every input written before
        the replay, the outputs copied after it."""
        self.inputs.copy_(inputs)
        self.graph.replay()
        return self.logits.clone(), self.argmax.clone()


class PrefillGraph:
    """One prefill of ``rows`` padded prompts of ``length`` tokens from position 0, captured as a CUDA graph with
    the same kernels the eager pass runs (so the same results), its keys and values written through a block table of
    its own (``table``: the prefill's rows of the decoder's, copied in before each replay), so that one capture serves
    every first row."""

    def __init__(self, model: Transformer, kv: KVCache, rows: int, length: int, pool: object) -> None:
        self.ids = torch.zeros((rows, length), dtype=torch.long, device=model.device)
        self.table = torch.zeros((rows, kv.table.shape[1]), dtype=kv.table.dtype, device=model.device)
        written = KVCache(kv.k, kv.v, self.table, kv.max_tokens)
        self.graph, self.hidden, _ = _captured(model.device, pool, lambda: model.hidden(self.ids, 0, written))

    def run(self, ids: torch.Tensor, kv: KVCache, first: int) -> torch.Tensor:
        """(n, length, H) hidden states of ``ids`` (n <= rows prompts), valid until the next replay; their keys and
        values are written into the blocks of rows ``first`` .. first + n - 1 of ``kv`` (the cache the graph was
        captured on). The graph's other rows are padding: token 0, written into the null block."""
        n = ids.shape[0]
        self.ids[:n].copy_(ids)
        self.ids[n:].zero_()
        self.table[:n].copy_(kv.table[first : first + n])
        self.table[n:].fill_(NULL_BLOCK)
        self.graph.replay()
        return self.hidden[:n]


@dataclass(frozen=True)
class Launched:
    """A decode step queued on the device (``Decoder.launch``, ``Decoder.chain``) whose results the host has not read
    yet (``Decoder.finish``)."""

    n: int  # the rows asked for
    shape: tuple[int, int]  # (rows run, KV positions its shapes name), as ``watch`` times it
    logits: torch.Tensor  # (rows run, V), on the device
    argmax: torch.Tensor  # (rows run,), on the device: what a step chained behind it is fed
    greedy: torch.Tensor  # (n,) the argmax in host memory once ``done``
    done: torch.cuda.Event | None  # None: nothing to wait for (the CPU)
    started: Clock


@dataclass
class WarmUpTimes:
    """Seconds of ``warm_up``'s parts: what a decoder's readiness costs (``bench/warmup.py`` prints them); and which
    eager prefills it ran (the engine's warm-up line names them)."""

    eager: float = 0.0  # the shapes run eagerly: prefills, and decode steps without graphs
    sampling: float = 0.0
    # (batch size, KV length) -> its step's run before the capture: the first compiles the fused and attention kernels
    decode_first_runs: dict[tuple[int, int], float] = field(default_factory=dict)
    decode_captures: dict[tuple[int, int], float] = field(default_factory=dict)  # the capture and a first replay
    prefill_graphs: float = 0.0  # every short prefill's first run, capture and first replay
    kernel_check: float = 0.0  # the kernels' check against plain torch (``standby.kernelcheck``)
    prefills_run: list[tuple[int, int]] = field(default_factory=list)  # (rows, length) of the eager prefills run


class Decoder:
    """The model and one KV cache, run at the fixed shapes the module docstring lists. One thread only."""

    def __init__(
        self,
        model: Transformer,
        kv: KVCache,
        graphs: bool = False,
        batch_invariant: bool = False,
        shared: SharedKv | None = None,
        watch: StepWatch = WATCH,
    ) -> None:
        """``shared``: where ``kv`` lies when it can outlive the engine (``standby.kvshare``), its ledger included;
        ``watch``: what its decode steps are timed into and its drill faults come from (``standby.steptimes``)."""
        if graphs and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {model.device}")
        self.model = model
        self.kv = kv
        self.shared = shared
        self.watch = watch
        self.graphs_enabled = graphs
        self.batch_invariant = batch_invariant
        self.lengths = length_buckets(kv.max_tokens)  # of prefills
        # Graphed decode reads each row's own length where the split-KV kernels serve the model (module docstring).
        self.split_kv = graphs and decodeattention.supported(model.device, model.dtype, model.config.head_dim)
        one_length = batch_invariant or self.split_kv
        self.kv_lengths = self.lengths[-1:] if one_length else self.lengths  # the KV positions decode's shapes name
        self.fused = graphs  # graphed steps run the fused elementwise kernels (unless their check fails)
        self.graph_bytes = 0  # device memory the captured graphs hold
        self.graph_batches = [kv.batch] if batch_invariant else batch_buckets(kv.batch)  # decode's batch sizes
        self.prefill_rows = batch_buckets(min(kv.batch, GRAPHED_PREFILL_ROWS))  # graphed prefills' prompt counts
        self._graphed_lengths = {  # count -> the longest length up to GRAPHED_PREFILL that fits; every prefill reads it
            rows: fits[-1]
            for rows in self.prefill_rows
            if (fits := [n for n in self.lengths if n <= GRAPHED_PREFILL and self.prefill_fits(rows, n)])
        }
        self._graphs: dict[tuple[int, int], DecodeGraph] = {}  # (batch size, KV length) -> its captured step
        self._prefills: dict[tuple[int, int], PrefillGraph] = {}  # (rows, length) -> its capture
        self.prefill_times: dict[tuple[int, int], float] = {}  # (rows, length) -> its seconds at warm-up
        self.warm_up_times = WarmUpTimes()
        self._finished_at = 0.0  # time.monotonic() when the last step's results reached the host

    @property
    def batch(self) -> int:
        return self.kv.batch

    def assign(self, row: int, blocks: list[int]) -> None:
        """Row ``row`` holds a sequence in ``blocks`` from now on (``standby.kvpool``); no blocks: the row is free,
        its table on the null block (as a dummy row's must be)."""
        self.kv.assign(row, blocks)

    @property
    def warmed_rows(self) -> list[int]:
        """The prompt counts and (without graphs) decode batch sizes ``warm_up`` runs eagerly: one row and every
        row, as a shape's first run eagerly costs what its later runs do, and ``standby.progress`` bounds the others'
        prefills from theirs."""
        return sorted({1, self.batch})

    @property
    def warmed_prefills(self) -> list[tuple[int, int]]:
        """The prefills (rows, length) ``warm_up`` runs eagerly: one prompt of the longest length and, without graphs,
        for each of ``warmed_rows`` the longest length up to WARMED_LENGTH that fits. With graphs the short prefills
        are the graphed ones, which their captures run and time (``standby.progress`` bounds a larger batch's from
        theirs and the longest's)."""
        shapes = []
        for rows in [] if self.graphs_enabled else self.warmed_rows:
            short = [length for length in self.lengths if length <= WARMED_LENGTH and self.prefill_fits(rows, length)]
            shapes += [(rows, short[-1])] if short else []
        return list(dict.fromkeys([*shapes, (1, self.lengths[-1])]))

    @property
    def warmed_kv_lengths(self) -> list[int]:
        """The KV lengths of the decode steps ``warm_up`` runs eagerly (without graphs): those up to WARMED_LENGTH,
        and the longest."""
        return [length for length in self.kv_lengths if length <= WARMED_LENGTH or length == self.kv_lengths[-1]]

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
        """Write ``prompts[i]`` into the blocks of row (slot) ``first + i`` from position 0, in one forward pass;
        (len(prompts), V) float32 logits, row i for the token after ``prompts[i]``. ValueError unless
        ``prefill_fits``."""
        rows, longest = self.check_prefill(first, prompts)
        shape = self.graphed_shape(rows, longest)
        graph = self._prefills.get(shape) if shape else None
        length = graph.ids.shape[1] if graph is not None else bucket(self.lengths, longest)
        ids = torch.zeros((rows, length), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        if graph is not None:
            hidden = graph.run(ids, self.kv, first)
        else:
            hidden = self.model.hidden(ids.to(self.model.device), 0, self.kv.rows(first, rows))
        last = torch.tensor([len(prompt) - 1 for prompt in prompts], device=self.model.device)
        return self.watch.faults.logits(self.model.logits(hidden[torch.arange(rows, device=self.model.device), last]))

    def decode(self, tokens: list[int], positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        """(n, V) float32 logits and each row's argmax (the greedy token): slot b is fed ``tokens[b]``
        at ``positions[b]``, for b < n <= batch. With graphs or ``batch_invariant``, the slots from n up to the batch
        size run must be free (their tables on the null block, where position 0 of each is written). Waits for the
        device without holding the GIL, so the engine's HTTP thread runs meanwhile. The step's time, results on the
        host, goes to ``watch``. ``launch`` then ``finish``."""
        return self.finish(self.launch(tokens, positions))

    @property
    def chains(self) -> bool:
        """Whether ``chain`` may queue a step behind another (a CUDA device: its steps run in the order queued)."""
        return self.model.device.type == "cuda"

    def launch(self, tokens: list[int], positions: list[int]) -> Launched:
        """``decode``'s step queued on the device; its results are ``finish``'s."""
        shape = self._shape(len(tokens), positions)
        free = [0] * (shape[0] - len(tokens))
        return self._queue(torch.tensor([tokens + free, positions + free], dtype=torch.long), len(tokens), shape)

    def chain(self, after: Launched, positions: list[int], fed: list[bool]) -> Launched:
        """The step after ``after``, queued behind it before its results reach the host: row b < after.n is fed
        ``after``'s argmax at ``positions[b]`` where ``fed[b]``, token 0 at position 0 (a free slot's dummy row)
        elsewhere, so the device never waits for the host between the two. Only where ``chains``."""
        shape = self._shape(after.n, positions)
        free = [0] * (shape[0] - after.n)
        host = torch.tensor([[int(f) for f in fed] + free, positions + free], dtype=torch.long)
        if self.model.device.type == "cuda":  # a pageable copy would wait for ``after`` first
            host = host.pin_memory()
        staged = host.to(self.model.device, non_blocking=True)
        return self._queue(torch.stack([after.argmax[: shape[0]] * staged[0], staged[1]]), after.n, shape)

    def finish(self, step: Launched) -> tuple[torch.Tensor, list[int]]:
        """``step``'s (n, V) logits and greedy tokens (``decode``'s), waiting for it alone (a step chained behind it
        runs on) without holding the GIL. Its time goes to ``watch``: from its launch, or from the previous step's end
        where it was queued behind that one (the device's time for it)."""
        if step.done is not None:
            step.done.synchronize()
        greedy = step.greedy.tolist()
        begun = Clock(max(step.started.wall, self._finished_at), step.started.cpu)
        self.watch.stepped(step.shape, begun, self.model.device.type == "cpu")
        self._finished_at = time.monotonic()
        faults = self.watch.faults
        return faults.logits(step.logits[: step.n]), faults.greedy(greedy, step.logits.shape[-1])

    def _shape(self, n: int, positions: list[int]) -> tuple[int, int]:
        """(rows run, KV positions its shapes name) of a step of ``n`` rows at ``positions``: its graph's batch size, or
        ``n`` for an eager one (batch-invariant: the one batch size)."""
        size = bucket(self.graph_batches, n)
        kv_len = bucket(self.kv_lengths, max(positions) + 1)
        return (size if (size, kv_len) in self._graphs or self.batch_invariant else n), kv_len

    def _queue(self, inputs: torch.Tensor, n: int, shape: tuple[int, int]) -> Launched:
        """Queue the step of ``inputs`` (2, rows run): tokens, positions; on the host or the device. Its argmax's first
        ``n`` rows are copied to pinned host memory behind it, with an event to wait on."""
        started = Clock.now()
        kv_len = shape[1]
        graph = self._graphs.get(shape)
        if graph is not None:
            logits, argmax = graph.run(inputs)
        else:
            logits, argmax = _step(self.model, inputs.to(self.model.device), self.kv, self._reads(kv_len))
        done = None
        if argmax.device.type == "cuda":
            greedy = torch.empty((n,), dtype=torch.long, pin_memory=True)
            greedy.copy_(argmax[:n], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            greedy = argmax[:n]
        return Launched(n, shape, logits, argmax, greedy, done, started)

    def _reads(self, kv_len: int) -> int | None:
        """What a step whose shapes name ``kv_len`` passes ``Transformer.decode``: None where it reads each row's
        own length (``split_kv``)."""
        return None if self.split_kv else kv_len

    def warm_up(self, pace: Callable[[], object] = lambda: None) -> None:
        """Run every shape serving uses (module docstring) and the sampling path once; with graphs, capture the
        decode step at every batch size instead of running it eagerly (a capture runs its step once first).
        ``pace`` is called after each shape (``standby.pacing.Pacer.step``); each prefill's time is kept in
        ``prefill_times`` (what ``standby.progress`` expects of a prefill of its shape). Leaves finite garbage in the
        KV cache, which serving overwrites before it reads (reads beyond a sequence's length are masked). The parts'
        times go to ``warm_up_times``."""
        device = self.model.device
        verdict = None
        if self.graphs_enabled:  # first: the host's verdict may hold the longest prefill's time (kernelcheck)
            started = time.perf_counter()
            key, verdict = self._check_kernels()
            self.warm_up_times.kernel_check = time.perf_counter() - started
        started = time.perf_counter()
        longest = (1, self.lengths[-1])
        for rows, length in self.warmed_prefills:
            if (rows, length) == longest and verdict is not None and verdict.longest_prefill_s:
                self.prefill_times[longest] = verdict.longest_prefill_s  # a sibling measured it on this host
                continue
            self.prefill_times[rows, length] = self._timed_prefill(rows, length)
            self.warm_up_times.prefills_run.append((rows, length))
            pace()
        if verdict is not None and not verdict.longest_prefill_s:  # checked now: remembered once, with that time
            kernelcheck.remember(key, dataclasses.replace(verdict, longest_prefill_s=self.prefill_times[longest]))
        if not self.graphs_enabled:
            for n in self.warmed_rows:
                for kv_len in self.warmed_kv_lengths:
                    self.decode([0] * n, [kv_len - 1] * n)
                    pace()
        self.warm_up_times.eager = time.perf_counter() - started
        started = time.perf_counter()
        logits = torch.zeros((1, self.model.config.vocab_size), device=device)
        for rows in (1, self.batch):  # the sampling path: one row, and every slot at once
            sample_rows(logits.expand(rows, -1), [1.0] * rows, [0.9] * rows, [0.5] * rows)
            sample_rows(logits.expand(rows, -1), [0.0] * rows, [1.0] * rows, [0.5] * rows)
        self.warm_up_times.sampling = time.perf_counter() - started
        if self.graphs_enabled:
            self._capture(pace)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _timed_prefill(self, rows: int, length: int) -> float:
        """Seconds of one prefill of ``rows`` prompts of ``length`` tokens from slot 0, its device work included."""
        started = time.monotonic()
        self.prefill(0, [[0] * length] * rows)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.monotonic() - started

    def _check_kernels(self) -> tuple[str, kernelcheck.KernelVerdict]:
        """Use only the kernels that compute on this device what plain torch does (``standby.kernelcheck``): a
        failed split-KV check brings back a graph per KV length, a failed fused one unfused graphed steps. The
        host's key and verdict: remembered, or checked now (``warm_up`` remembers it, with its longest prefill)."""
        config = self.model.config
        inputs = kernelcheck.probe_inputs(self.batch, self.kv.max_tokens, config.vocab_size, self.model.device)

        def step(kv_len: int | None, fuse: bool) -> torch.Tensor:
            with fusing() if fuse else contextlib.nullcontext():
                return _step(self.model, inputs, self.kv, kv_len)[0]

        key = kernelcheck.host_key(self.model.device, config, self.model.dtype, self.kv.max_tokens)
        verdict = kernelcheck.remembered(key)
        if verdict is None:
            with self._probed():
                verdict = kernelcheck.verdict(step, self.split_kv, self.kv.max_tokens)
        else:
            log.info("kernel check: this host's verdict (%s), not checked again", kernelcheck.verdict_path(key))
            for line in verdict.warnings:
                log.warning("%s", line)
        if self.split_kv and not verdict.split_kv:
            self.split_kv = False
            self.kv_lengths = self.lengths[-1:] if self.batch_invariant else self.lengths
        self.fused = verdict.fused
        return key, verdict

    @contextlib.contextmanager
    def _probed(self) -> Iterator[None]:
        """The kernel check's cache: every row's table spread over the pool's blocks in a shuffled order, the blocks
        holding random keys and values, so that a kernel reading another block or offset than the table names computes
        otherwise; the tables as they were after, the blocks zeroed."""
        kv = self.kv
        rows, width = kv.table.shape
        saved = kv.table.clone()
        order = 1 + torch.randperm(kv.blocks - 1, generator=torch.Generator().manual_seed(0))
        kv.table.copy_(order[torch.arange(rows * width) % (kv.blocks - 1)].view(rows, width))
        kv.k.normal_()
        kv.v.normal_()
        try:
            yield
        finally:
            kv.table.copy_(saved)
            kv.k.zero_()
            kv.v.zero_()

    def _capture(self, pace: Callable[[], object]) -> None:
        """A decode graph per batch size (and KV length, unless ``split_kv``), and per short prefill (module
        docstring), sharing one memory pool; ``graph_bytes`` is what they added. ``pace`` after each capture."""
        device = self.model.device
        before = _reserved_in_use(device)
        pool = torch.cuda.graph_pool_handle()
        times = self.warm_up_times
        for n in self.graph_batches:
            for kv_len in self.kv_lengths:
                started = time.perf_counter()
                reads = self._reads(kv_len)
                graph = self._graphs[n, kv_len] = DecodeGraph(self.model, self.kv, n, reads, pool, self.fused)
                graph.run(torch.zeros((2, n), dtype=torch.long))  # a first replay, as serving's would be
                torch.cuda.synchronize(device)
                times.decode_first_runs[n, kv_len] = graph.first_run_s
                times.decode_captures[n, kv_len] = time.perf_counter() - started - graph.first_run_s
                pace()
        started = time.perf_counter()
        for rows, length in self.graphed_prefills():
            self._prefills[rows, length] = PrefillGraph(self.model, self.kv, rows, length, pool)
            self.prefill_times[rows, length] = self._timed_prefill(rows, length)  # its first replay
            pace()
        times.prefill_graphs = time.perf_counter() - started
        self.graph_bytes = _reserved_in_use(device) - before
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s, %s) in %.3f s, their first runs (kernels compiled) "
            "%.3f s, and %d prefill graphs in %.3f s: %d bytes",
            len(self._graphs),
            self.graph_batches,
            "each row's own KV length" if self.split_kv else f"KV lengths {self.kv_lengths}",
            sum(times.decode_captures.values()),
            sum(times.decode_first_runs.values()),
            len(self._prefills),
            times.prefill_graphs,
            self.graph_bytes,
        )

    def graphed_prefills(self) -> list[tuple[int, int]]:
        """(rows, length) of every prefill captured with graphs: for each prompt count of ``prefill_rows``, the longest
        length up to GRAPHED_PREFILL that fits (one prompt only in ``batch_invariant`` mode)."""
        return list(self._graphed_lengths.items())

    def graphed_shape(self, rows: int, longest: int) -> tuple[int, int] | None:
        """The graphed prefill (``graphed_prefills``) that ``rows`` prompts of up to ``longest`` tokens replay: the
        fewest prompts that hold them, if its length holds the longest; None: an eager prefill."""
        if rows > self.prefill_rows[-1]:
            return None
        count = bucket(self.prefill_rows, rows)
        length = self._graphed_lengths.get(count, 0)
        return (count, length) if longest <= length else None


def _reserved_in_use(device: torch.device) -> int:
    """Device memory torch's allocator holds for live tensors and graph pools, once its unused cached
    blocks (e.g. warm-up's scratch) are returned to the driver."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)
