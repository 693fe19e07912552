"""The inference thread: one worker owns the model and interleaves every active sequence.

The HTTP loop never runs model compute. Sequences are submitted here; the worker keeps up to
``max_batch`` of them active, each in its own slot of one KV cache, and gives each one decode
step per round, so concurrent streams progress together (round-robin over batch-1 forwards, not
batched kernels). Every step is the same computation as ``standby.model.generate``, so a
sequence yields exactly the tokens ``generate`` would for the same prompt, seed and temperature.

Events reach the caller through its sink, called on the worker thread: token ids as they are
sampled, then one ``Finish``. A standby has no KV cache attached, and a sequence that reaches the
worker then finishes with an error.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hotweights.standby.model import KVCache, Transformer, sample_token

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle worker sleeps between heartbeats


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed (greedy never draws from it)
    stop_ids: frozenset[int] = frozenset()  # end of sequence; never yielded


@dataclass(frozen=True)
class Finish:
    """The last event of a sequence."""

    reason: str  # "stop" (a stop id), "length" (max_tokens), "cancelled" or "error"
    error: str | None = None


Event = int | Finish
Sink = Callable[[Event], None]  # called on the worker thread; must not block


class Sequence:
    """One prompt's generation. Only ``cancel`` may be called from other threads."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.sink = sink
        self.cancelled = False  # read by the worker between steps
        # Owned by the worker once submitted:
        self.slot: int | None = None
        self.cache: KVCache | None = None  # a batch-1 view of the slot
        self.logits: torch.Tensor | None = None  # (V,) for the next token
        self.pos = 0  # where the next fed token goes
        self.generated = 0
        self.generator: torch.Generator | None = None

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    """Owns the model on one worker thread; the KV cache is attached on promote, released on demote."""

    def __init__(self, model: Transformer, max_batch: int) -> None:
        self.model = model
        self.max_batch = max_batch
        self.heartbeat = time.monotonic()  # last time the worker went round its loop
        self._inbox: queue.Queue[Sequence | None] = queue.Queue()  # None only wakes the worker
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._lock = threading.Condition()  # guards _kv, _free_slots and _live
        self._kv: KVCache | None = None
        self._free_slots: list[int] = []
        self._live: set[Sequence] = set()  # submitted and not yet finished
        self._closed = False  # the worker has ended: a submitted sequence would never be answered
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)

    # --- called from other threads -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Cancel everything, end the worker and wait for it (bounded)."""
        cancelled = self.cancel_all()
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("inference thread did not stop within %.1f s", timeout_s)
        elif cancelled:
            log.info("cancelled %d sequence(s) at shutdown", cancelled)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, seq: Sequence) -> None:
        with self._lock:
            if not self._closed:
                self._live.add(seq)
                self._inbox.put(seq)  # under the lock, so the ending worker either sees it or refuses it
                return
        seq.sink(Finish("error", "the inference thread has stopped"))

    def cancel_all(self) -> int:
        """Cancel every live sequence; returns how many. Each still gets its ``Finish``."""
        with self._lock:
            live = list(self._live)
        for seq in live:
            seq.cancel()
        self._inbox.put(None)
        return len(live)

    def attach_kv(self, kv: KVCache) -> None:
        with self._lock:
            if self._kv is not None:
                raise RuntimeError("a KV cache is already attached")
            self._kv = kv
            self._free_slots = list(range(kv.batch))

    def release_kv(self, timeout_s: float) -> int:
        """Detach the KV cache once no sequence uses it (waiting up to ``timeout_s`` for cancelled
        ones to unwind); returns the bytes released. Raises RuntimeError if sequences remain."""
        with self._lock:
            if not self._lock.wait_for(lambda: not self._live, timeout_s):
                raise RuntimeError(f"{len(self._live)} sequence(s) still use the KV cache")
            freed = 0 if self._kv is None else self._kv.nbytes
            self._kv, self._free_slots = None, []
        return freed

    @property
    def kv_cache_bytes(self) -> int:
        kv = self._kv
        return 0 if kv is None else kv.nbytes

    # --- the worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.heartbeat = time.monotonic()
                self._collect(block=not self._active)
                self._admit()
                for seq in list(self._active):
                    self._step(seq)
        except Exception:
            log.exception("inference thread crashed; this is a bug, please report it")
            raise
        finally:
            with self._lock:
                self._closed = True
            self._collect(block=False)  # sequences submitted since the last round must get their Finish too
            for seq in [*self._active, *self._waiting]:
                self._retire(seq, Finish("cancelled"))

    def _collect(self, block: bool) -> None:
        """Move submitted sequences to the waiting line; sleep briefly when there is nothing to do."""
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _admit(self) -> None:
        """Give free slots to waiting sequences, in order, and prefill them."""
        for seq in [s for s in self._waiting if s.cancelled]:
            self._waiting.remove(seq)
            self._retire(seq, Finish("cancelled"))
        while self._waiting:
            with self._lock:
                kv = self._kv
                if kv is not None and not self._free_slots:
                    return
                slot = self._free_slots.pop() if kv is not None else None
            seq = self._waiting.popleft()
            if slot is None:
                self._retire(seq, Finish("error", "no KV cache is attached: this engine is a standby"))
                continue
            seq.slot = slot
            seq.cache = KVCache(kv.k[:, slot : slot + 1], kv.v[:, slot : slot + 1])
            self._active.append(seq)
            self._guarded(seq, self._prefill)

    def _prefill(self, seq: Sequence) -> None:
        params = seq.params
        seed = params.seed
        if seed is None:
            seed = secrets.randbits(62) if params.temperature > 0 else 0
        seq.generator = torch.Generator(device=self.model.device).manual_seed(seed)
        ids = torch.tensor([seq.prompt_ids], dtype=torch.long, device=self.model.device)  # (1, T)
        seq.logits = self.model(ids, 0, seq.cache)[0, -1]
        seq.pos = len(seq.prompt_ids)

    def _step(self, seq: Sequence) -> None:
        if seq.cancelled:
            self._retire(seq, Finish("cancelled"))
        elif seq.logits is not None:  # None: its prefill failed and it is already retired
            self._guarded(seq, self._decode)

    def _decode(self, seq: Sequence) -> None:
        """Sample one token from the pending logits, hand it over, and compute the next logits."""
        params = seq.params
        token = sample_token(seq.logits, params.temperature, params.top_p, seq.generator)
        if token in params.stop_ids:
            self._retire(seq, Finish("stop"))
            return
        seq.sink(token)
        seq.generated += 1
        if seq.generated == params.max_tokens:
            self._retire(seq, Finish("length"))
            return
        ids = torch.tensor([[token]], dtype=torch.long, device=self.model.device)
        seq.logits = self.model(ids, seq.pos, seq.cache)[0, -1]
        seq.pos += 1

    def _guarded(self, seq: Sequence, work: Callable[[Sequence], None]) -> None:
        """A failing sequence ends with an error; the others carry on."""
        try:
            work(seq)
        except Exception as exc:
            log.exception("sequence failed")
            self._retire(seq, Finish("error", f"{type(exc).__name__}: {exc}"))

    def _retire(self, seq: Sequence, finish: Finish) -> None:
        if seq in self._active:
            self._active.remove(seq)
        seq.cache = seq.logits = None
        with self._lock:
            if seq.slot is not None and self._kv is not None:
                self._free_slots.append(seq.slot)
            seq.slot = None
            self._live.discard(seq)
            self._lock.notify_all()
        seq.sink(finish)
