"""The inference thread: one worker owns the model and steps every active sequence at once.

The HTTP loop never runs model compute. Sequences are submitted here; the worker keeps up to ``max_batch`` of them
active, each in its own slot (a row of the KV cache's block table) with the blocks of the pool it can need
(``standby.kvpool``: its prompt and every token it may generate), taken when it starts and given back when it ends, so
that a started sequence always finishes: one that finds no slot or not its blocks free waits, first in line, and nothing
is ever preempted (kept slots, below, are given up first). A new sequence is prefilled as soon as a slot and its blocks
are free; then every round samples one token for each active sequence from its pending logits and runs ONE batched
decode step (``Decoder.decode``) over slots 0 .. n-1, where n is one past the highest slot in use: slots are handed out
lowest first, and a free slot below n rides along as a dummy row (token 0 at position 0 of its own, unused slot, whose
table names the null block). The round's tokens are chosen for every sequence at once (``standby.sampling.sample_rows``:
each sequence draws from its own seed per token, whatever rows share the step), and the computation is
``standby.model.generate``'s (prefill, then one decode step per token, with the same sampling function), so a sequence
yields the tokens ``generate`` yields for the same prompt, seed and temperature, up to the rounding differences of
batched kernels (tests compare them exactly).

A sequence may continue: the last ``replay`` tokens of its prompt are ones an engine generated before (a migrated
request's continuation). Where another engine's deposited KV cache holds its tokens (``standby.kvshare``: the failed
primary's), their keys and values are copied into the sequence's blocks and only the last token is fed, through a decode
step. Otherwise, with a batch-invariant ``Decoder``, only the rest is prefilled and the replayed tokens are fed one per
round through the same decode steps that first computed them; nothing is emitted for them, so the sequence's keys,
values and logits are the ones of the uninterrupted run. Without one, the whole prompt is prefilled.

With a shared KV cache the worker keeps its ``SlotLedger``: a slot's tokens are recorded once the device has computed
their keys and values (after the next decode step's results reached the host), and a slot is given up before anything
can overwrite it. While the engine stops serving (``keep_cut``: a drain), a cancelled sequence's slot is kept as it is,
with its blocks, for the next primary to continue the request from (``standby.kvshare``; its table is cleared at once,
so no dummy row writes into its blocks): it is given up when the engine serves again, or when a waiting sequence finds
no free slot or blocks; a KV cache released with kept slots is handed over to the daemon rather than withdrawn.

While every active sequence goes on greedily (no forced token, none at its last token, nothing waiting to start, on a
device that runs its steps in the order queued), the next decode step is chained behind the one in flight before the
host reads its results (``Decoder.chain``: it feeds each row that step's argmax, device data), so the device goes from
one step to the next without waiting for this thread's work between them (emitting the tokens, the next round's
bookkeeping; on an H100 with ``xl`` one stream's tokens a second through the gateway went from 76.2 to 77.2, the step
itself ~12 ms). The next round takes the chained step as its own where it fed every active sequence the token the round
chose at its position (always, for greedy sequences, unless one joined); otherwise it is dropped and a step is launched
as usual, which writes the same keys and values again. A chained step's row for a sequence that ends meanwhile writes
one position past its last token, in its own blocks, before anything queued after it can reuse them.

Events reach the caller through its sink, called on the worker thread: token ids as they are sampled, then one
``Finish``. A standby has no KV cache attached, and a sequence that reaches the worker then finishes with an error.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import torch

from hotweights.standby.decoder import Decoder, Launched
from hotweights.standby.kvpool import BlockPool, sequence_blocks, shortfall
from hotweights.standby.kvshare import REQUEST_TIMEOUT_S, KvShare, SlotLedger
from hotweights.standby.opening import Opening
from hotweights.standby.progress import ProgressClock, averaged, padded
from hotweights.standby.sampling import sample_rows, uniform

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

    def __init__(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, replay: int = 0) -> None:
        """``replay``: how many of the prompt's last tokens an engine generated before (module docstring),
        0 <= replay < len(prompt_ids)."""
        if not 0 <= replay < len(prompt_ids):
            raise ValueError(f"replay {replay} must be in [0, {len(prompt_ids)})")
        self.prompt_ids = prompt_ids
        self.replay = replay
        self.forced: deque[int] = deque()  # fed next, one per round, not emitted
        self.params = params
        self.sink = sink
        self.cancelled = False  # read by the worker between steps
        # Owned by the worker once submitted:
        self.slot: int | None = None
        self.blocks: list[int] = []  # of the KV pool, held from its slot's claim to its end (``standby.kvpool``)
        self.logits: torch.Tensor | None = None  # (V,) for the next token
        self.greedy: int | None = None  # the argmax of ``logits`` when the step computed it
        self.pos = 0  # where the next fed token goes
        self.token = 0  # the last token sampled: the next one fed
        self.generated = 0
        self.seed = 0  # the request's seed, or a fresh one (see ``sampling.token_seed``)

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def needs(self) -> int:
        """The KV blocks it holds while it runs (``kvpool.sequence_blocks``)."""
        return sequence_blocks(len(self.prompt_ids), self.params.max_tokens)

    def prefilled(self, batch_invariant: bool) -> list[int]:
        """The tokens its prefill computes (module docstring): with a batch-invariant decoder, the prompt without
        the replayed tokens."""
        return self.prompt_ids[: len(self.prompt_ids) - self.replay] if batch_invariant else self.prompt_ids


@dataclass(frozen=True)
class Ahead:
    """A decode step chained behind the last one (``Decoder.chain``), and what it fed: slot -> (its sequence, the
    position it fed that sequence's next token at)."""

    step: Launched
    fed: dict[int, tuple[Sequence, int]]


class Scheduler:
    """Owns the model on one worker thread; a ``Decoder`` (the KV cache and the shapes to run it at) is
    attached on promote, released on demote. ``kv_share``: the engine's link to its daemon's KV deposits."""

    def __init__(self, kv_share: KvShare | None = None) -> None:
        self.kv_share = kv_share
        self.adopted = 0  # sequences started from another engine's KV cache
        self.adopted_tokens = 0  # the tokens whose keys and values they copied
        self._recorded: list[tuple[int, list[int], int, list[int]]] = []  # (slot, ids, prefilled, blocks), computed
        self.heartbeat = time.monotonic()  # last time the worker went round its loop
        self.progress = ProgressClock()  # its operations as the health checks judge them (``standby.progress``)
        self._frozen = threading.Event()  # the drill's stall fault (``freeze``)
        self._inbox: queue.Queue[tuple[Sequence, ...] | None] = queue.Queue()  # None only wakes the worker
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._lock = threading.Condition()  # guards _decoder, _free_slots, _blocks, _kept, _keeping and _live
        self._decoder: Decoder | None = None
        self._free_slots: set[int] = set()
        self._blocks = BlockPool(1)  # the attached KV pool's free blocks
        self._kept: list[tuple[int, list[int]]] = []  # (slot, blocks) of sequences cut while keeping, oldest first
        self._keeping = False
        self._live: set[Sequence] = set()  # submitted and not yet finished
        self._closed = False  # the worker has ended: a submitted sequence would never be answered
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)
        self._round_s = 0.0  # a round's time (a token for every active sequence, newcomers' prefills), averaged
        self._ahead: Ahead | None = None  # the step chained behind the last one, not read yet (worker thread only)

    # --- called from other threads -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Cancel everything, end the worker and wait for it (bounded); withdraw a deposited KV cache."""
        cancelled = self.cancel_all()
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout_s)
        if self.kv_share is not None:
            futures.wait([self._give_up_deposit(self.kept_slots > 0)], timeout=REQUEST_TIMEOUT_S)
        if self._thread.is_alive():
            log.error("inference thread did not stop within %.1f s", timeout_s)
        elif cancelled:
            log.info("cancelled %d sequence(s) at shutdown", cancelled)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def received(self) -> None:
        """A request reached the server (parsed and validated; ``standby.opening``). Any thread."""
        self.progress.opening.received(time.monotonic())

    def submit(self, *seqs: Sequence) -> None:
        """Hand ``seqs`` (one request's) to the worker as one: they join the waiting line together, so they are
        prefilled together where they fit, whatever the worker was doing as they came."""
        with self._lock:
            if not self._closed:
                if not self._live:
                    self.progress.arrived()
                self.progress.opening.arrived(time.monotonic())
                self._live.update(seqs)
                self._inbox.put(seqs)  # under the lock, so the ending worker either sees them or refuses them
                return
        for seq in seqs:
            seq.sink(Finish("error", "the inference thread has stopped"))

    def remaining_s(self) -> list[float] | None:
        """How long each live sequence has yet to go: its remaining tokens at this worker's measured round time
        (``hotweights.admission.Timing``); None until a round has been timed."""
        if not self._round_s:
            return None
        return [tokens * self._round_s for tokens in self._remaining()]

    def _remaining(self) -> list[int]:
        """The tokens each live sequence has yet to generate."""
        with self._lock:
            return [seq.params.max_tokens - seq.generated for seq in self._live]

    def stall_refusal(self) -> str | None:
        """Why the worker counts as stalled (``standby.progress``: work pending, no progress within its bound), or
        None."""
        return self.progress.refusal(len(self._live))

    def freeze(self) -> None:
        """Freeze the worker for the rest of the process's life at its next round, whatever it holds (the drill's
        stall fault: ``standby.progress.FREEZE_SIGNAL``); the HTTP server goes on answering. Any thread, or a
        signal handler."""
        self._frozen.set()

    def cancel_all(self) -> int:
        """Cancel every live sequence; returns how many. Each still gets its ``Finish``."""
        with self._lock:
            live = list(self._live)
        for seq in live:
            seq.cancel()
        self._inbox.put(None)
        return len(live)

    def keep_cut(self, keep: bool) -> None:
        """Whether the slots of sequences cancelled from now on are kept for a successor (module docstring); False
        gives up those kept so far. Any thread."""
        with self._lock:
            self._keeping = keep
            while not keep and self._kept:
                self._give_up_kept()

    def attach_kv(self, decoder: Decoder) -> None:
        """Serve from ``decoder``; a shared KV cache is deposited with the daemon (``standby.kvshare``)."""
        if decoder.shared is not None:
            decoder.shared.ledger.reset_all()
        self.progress.learn(decoder.prefill_times)
        self.progress.opening = Opening(time.monotonic())  # the first seconds of serving (``standby.opening``)
        with self._lock:
            if self._decoder is not None:
                raise RuntimeError("a KV cache is already attached")
            self._decoder = decoder
            self._free_slots = set(range(decoder.batch))
            self._blocks = BlockPool(decoder.kv.blocks)
            self._kept, self._keeping = [], False
        if decoder.shared is not None and self.kv_share is not None:
            self.kv_share.deposit(decoder.shared)

    def release_kv(self, timeout_s: float) -> tuple[Decoder | None, int]:
        """Detach the decoder once no sequence uses its KV cache (waiting up to ``timeout_s`` for
        cancelled ones to unwind) and return it, with how many kept slots went with its deposit to a successor
        (counted once the cancelled sequences have unwound). Raises RuntimeError if sequences remain."""
        with self._lock:
            if not self._lock.wait_for(lambda: not self._live, timeout_s):
                raise RuntimeError(f"{len(self._live)} sequence(s) still use the KV cache")
            decoder, self._decoder, self._free_slots = self._decoder, None, set()
            kept, self._kept = len(self._kept), []
        if decoder is not None and decoder.shared is not None:
            if self.kv_share is not None:  # done before the caller may free the memory
                futures.wait([self._give_up_deposit(kept > 0)], timeout=2 * REQUEST_TIMEOUT_S)  # behind a deposit
            if not kept:
                decoder.shared.ledger.reset_all()
        return decoder, kept

    def _give_up_deposit(self, kept: bool) -> futures.Future[None]:
        """Hand the deposited KV cache over to a successor when slots are ``kept`` for one, else withdraw it."""
        assert self.kv_share is not None
        return self.kv_share.hand_over() if kept else self.kv_share.withdraw()

    @property
    def kept_slots(self) -> int:
        """Slots kept for a successor now (``keep_cut``)."""
        with self._lock:
            return len(self._kept)

    def pool(self) -> dict[str, int]:
        """The attached KV pool now: its blocks (``blocks``, ``used``: held by sequences, kept ones included), and
        the sequences running (holding blocks) and waiting here for a slot or blocks. Any thread."""
        with self._lock:
            attached = self._decoder is not None
            blocks, used = (self._blocks.total, self._blocks.used) if attached else (0, 0)
            running = sum(seq.slot is not None for seq in self._live)
            return {"blocks": blocks, "used": used, "running": running, "waiting": len(self._live) - running}

    @property
    def kv_cache_bytes(self) -> int:
        decoder = self._decoder
        return 0 if decoder is None else decoder.nbytes

    # --- the worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        self.progress.waits.follow_this_thread()
        try:
            while not self._stopping.is_set():
                if self._frozen.is_set():
                    log.error("the inference thread is frozen for good (the drill's stall fault)")
                    threading.Event().wait()
                self.heartbeat = time.monotonic()
                self._collect(block=not (self._active or self._waiting))  # sleep only with nothing to do
                if self.kv_share is not None:
                    with self.progress.calling_daemon():
                        self.kv_share.idle()
                started = time.monotonic()
                self._admit()
                if self._active:
                    self._step()
                    self._round_s = averaged(self._round_s, time.monotonic() - started)
                if opening := self.progress.opening.ended(time.monotonic()):
                    log.info("%s", opening)
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
                    self._waiting.extend(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _admit(self) -> None:
        """Give free slots and their blocks to waiting sequences, in order, and prefill them: as many at once as take
        consecutive free slots, find their blocks and fit one prefill (``Decoder.prefill_fits``). The first waits for
        a slot and its blocks (kept slots given up first); one that needs more than the whole pool ends at once."""
        for seq in [s for s in self._waiting if s.cancelled]:
            self._waiting.remove(seq)
            self._retire(seq, Finish("cancelled"))
        while self._waiting:
            with self._lock:
                decoder, head = self._decoder, self._waiting[0]
                reason = None if decoder is None else shortfall(head.needs, self._blocks.total)
                if decoder is not None and reason is None and not self._room_for(head):
                    return
            if decoder is None or reason is not None:
                self._waiting.popleft()
                self._retire(head, Finish("error", reason or "no KV cache is attached: this engine is a standby"))
                continue
            with self.progress.calling_daemon() as began:
                adopted = self._adopt(decoder, head)
            if adopted:
                self.progress.opening.adopted(time.monotonic() - began)
                continue
            with self._lock:
                group = self._claim(decoder)
            self._active.extend(group)
            try:
                for seq in group:
                    decoder.assign(seq.slot, seq.blocks)
                self._prefill(decoder, group)
            except Exception as exc:
                for seq in group:
                    self._fail(seq, exc)

    def _room_for(self, seq: Sequence) -> bool:
        """Under the lock: whether a slot and ``seq``'s blocks are free, once kept slots are given up for it (a
        waiting sequence comes before a cut one's successor)."""
        while self._kept and not (self._free_slots and self._blocks.free >= seq.needs):
            self._give_up_kept()
        return bool(self._free_slots) and self._blocks.free >= seq.needs

    def _claim(self, decoder: Decoder) -> list[Sequence]:
        """The waiting sequences of the next prefill, each given its slot and blocks: the lowest free slot and the
        free slots right after it, as far as their blocks are free and the prompts fit one prefill (a prompt that fits
        none goes alone). A continuation behind the first joins none where it could adopt a slot (``_adopt``)."""
        group = [self._waiting.popleft()]
        first = min(self._free_slots)
        invariant = decoder.batch_invariant
        needed = group[0].needs
        adopts = self.kv_share is not None and decoder.shared is not None
        while self._waiting and first + len(group) in self._free_slots and not (adopts and self._waiting[0].replay):
            longest = max(len(s.prefilled(invariant)) for s in [*group, self._waiting[0]])
            needed += self._waiting[0].needs
            if not decoder.prefill_fits(len(group) + 1, longest) or needed > self._blocks.free:
                break
            group.append(self._waiting.popleft())
        for i, seq in enumerate(group):
            seq.slot, seq.blocks = first + i, self._blocks.take(seq.needs)
            self._free_slots.discard(seq.slot)
        return group

    def _adopt(self, decoder: Decoder, seq: Sequence) -> bool:
        """Start ``seq``, a continuation, from a deposited slot that holds its tokens (module docstring): True when
        it took the lowest free slot and its blocks and is active, its last token to be fed."""
        if not seq.replay:
            return False
        if self.kv_share is None or decoder.shared is None:
            self.progress.opening.not_adopted("no shared KV cache here")
            return False
        ids, prompt = seq.prompt_ids, len(seq.prompt_ids) - seq.replay
        match = self.kv_share.find(ids, prompt, prompt if decoder.batch_invariant else None, decoder.kv)
        if match is None:
            self.progress.opening.not_adopted(f"none of {self.kv_share.sources} deposits holds its prompt")
            return False
        with self._lock:
            slot, blocks = min(self._free_slots), self._blocks.take(seq.needs)
            self._free_slots.discard(slot)
        if not self.kv_share.copy(match, decoder.kv, blocks):
            with self._lock:
                self._free_slots.add(slot)
                self._blocks.give(blocks)
            self.progress.opening.not_adopted("its slot was given up as it was copied")
            return False
        decoder.assign(slot, blocks)
        decoder.shared.ledger.record(slot, ids[: match.length], match.prefilled, blocks)
        self._waiting.popleft()
        _seed(seq)
        seq.slot, seq.blocks, seq.pos, seq.forced = slot, blocks, match.length, deque(ids[match.length :])
        self._active.append(seq)
        self.adopted += 1
        self.adopted_tokens += match.length
        return True

    def _prefill(self, decoder: Decoder, group: list[Sequence]) -> None:
        for seq in group:
            _seed(seq)
        prompts = [seq.prefilled(decoder.batch_invariant) for seq in group]
        with self.progress.prefilling((len(prompts), padded(decoder.lengths, max(map(len, prompts))))):
            logits = decoder.prefill(group[0].slot, prompts)
            if logits.device.type == "cuda":  # its time is the device's (the next round would wait for it anyway)
                torch.cuda.synchronize(logits.device)
        for seq, prompt, row in zip(group, prompts, logits, strict=True):
            seq.logits, seq.greedy = row, None
            seq.pos = len(prompt)
            seq.forced = deque(seq.prompt_ids[len(prompt) :])
            if decoder.shared is not None:
                self._recorded.append((seq.slot, prompt, len(prompt), seq.blocks))

    def _step(self) -> None:
        """One token for every active sequence, then one batched decode step for those that go on."""
        for seq in [s for s in self._active if s.cancelled]:
            self._retire(seq, Finish("cancelled"))
        for seq, token in zip(list(self._active), self._next_tokens(), strict=True):
            self._emit(seq, token)
        if not self._active:
            self._ahead = None  # what it computes has no sequence left to go to
            return
        try:
            self._decode_all(self._decoder)
        except Exception as exc:  # the step is shared: every sequence in it fails
            self._ahead = None
            for seq in list(self._active):
                self._fail(seq, exc)

    def _next_tokens(self) -> list[int]:
        """Each active sequence's next token from its pending logits: the greedy ones the step computed as they
        are, the rest sampled together (``sample_rows``)."""
        chosen = [
            seq.forced[0] if seq.forced else seq.greedy if seq.params.temperature == 0.0 else None
            for seq in self._active
        ]
        rest = [seq for seq, token in zip(self._active, chosen, strict=True) if token is None]
        if rest:
            logits = torch.stack([seq.logits for seq in rest])
            params = [seq.params for seq in rest]
            draws = [uniform(seq.seed, seq.pos) for seq in rest]
            sampled = iter(sample_rows(logits, [p.temperature for p in params], [p.top_p for p in params], draws))
            chosen = [next(sampled) if token is None else token for token in chosen]
        return chosen

    def _emit(self, seq: Sequence, token: int) -> None:
        """Hand ``token`` over, or retire the sequence at a stop id or its ``max_tokens``; a replayed token is only
        fed on."""
        if seq.forced:
            seq.token = seq.forced.popleft()
            return
        params = seq.params
        if token in params.stop_ids:
            self._retire(seq, Finish("stop"))
            return
        seq.sink(token)
        self.progress.opening.emitted(time.monotonic())
        seq.generated += 1
        seq.token = token
        if seq.generated == params.max_tokens:
            self._retire(seq, Finish("length"))

    def _decode_all(self, decoder: Decoder) -> None:
        """Feed every active sequence its last token at its position; rows are slots 0 .. n-1. The step chained last
        round (module docstring) is this one where it fed every active sequence just that; while the sequences go on
        greedily, the next step is chained behind this one before its results are read."""
        n = 1 + max(seq.slot for seq in self._active)
        tokens, positions = [0] * n, [0] * n  # a free slot's row: token 0 at its own position 0
        for seq in self._active:
            tokens[seq.slot], positions[seq.slot] = seq.token, seq.pos
        ahead, self._ahead = self._ahead, None
        with self.progress.decoding(n):
            if ahead is not None and all(ahead.fed.get(seq.slot) == (seq, seq.pos) for seq in self._active):
                step = ahead.step
            else:
                step = decoder.launch(tokens, positions)
            if self._chainable(decoder):
                fed = {seq.slot: (seq, seq.pos + 1) for seq in self._active}
                later = [fed[slot][1] if slot in fed else 0 for slot in range(step.n)]
                chained = decoder.chain(step, later, [slot in fed for slot in range(step.n)])
                self._ahead = Ahead(chained, fed)
            logits, greedy = decoder.finish(step)  # (n, V), n argmaxes, on the host: the step is done
        if decoder.shared is not None:
            self._record(decoder.shared.ledger, tokens, positions)
        for seq in self._active:
            seq.logits, seq.greedy = logits[seq.slot], greedy[seq.slot]
            seq.pos += 1

    def _chainable(self, decoder: Decoder) -> bool:
        """Whether the next step's tokens are this one's argmaxes for every active sequence, and nothing else joins
        it: each goes on greedily (no forced token, not at its last token, not cancelled), nothing waits to start,
        and the drill's faults (which change the tokens or time the steps) are off."""
        if not decoder.chains or self._waiting or not self._inbox.empty():
            return False
        faults = decoder.watch.faults
        if faults.slow or faults.wrong:
            return False
        return all(
            seq.params.temperature == 0.0
            and not seq.forced
            and not seq.cancelled
            and seq.generated + 1 < seq.params.max_tokens
            and seq.pos + 1 < decoder.kv.max_tokens
            for seq in self._active
        )

    def _record(self, ledger: SlotLedger, tokens: list[int], positions: list[int]) -> None:
        """Into the ledger: the prefills before this step, then the tokens it fed the active sequences."""
        for slot, ids, prefilled, blocks in self._recorded:
            ledger.record(slot, ids, prefilled, blocks)
        self._recorded.clear()
        slots = [seq.slot for seq in self._active]
        ledger.append(slots, [positions[slot] for slot in slots], [tokens[slot] for slot in slots])

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        """A failed sequence ends with an error; the others carry on."""
        log.error("sequence failed", exc_info=exc)
        self._retire(seq, Finish("error", f"{type(exc).__name__}: {exc}"))

    def _retire(self, seq: Sequence, finish: Finish) -> None:
        """End ``seq`` with ``finish``: its slot's table is cleared at once (nothing writes its blocks any more, not
        even a dummy row), then its slot and blocks are free, or kept as they are for the next primary (module
        docstring). The worker's thread only."""
        if seq in self._active:
            self._active.remove(seq)
        seq.logits = seq.greedy = None
        if seq.slot is not None and self._decoder is not None:
            self._decoder.assign(seq.slot, [])
        with self._lock:
            if seq.slot is not None and self._decoder is not None:
                shared = self._decoder.shared
                if shared is not None:
                    self._recorded = [entry for entry in self._recorded if entry[0] != seq.slot]
                if shared is not None and self._keeping and finish.reason == "cancelled":
                    self._kept.append((seq.slot, seq.blocks))  # as it is, for the next primary (module docstring)
                else:
                    if shared is not None:
                        shared.ledger.reset(seq.slot)
                    self._free_slots.add(seq.slot)
                    self._blocks.give(seq.blocks)
            seq.slot, seq.blocks = None, []
            self._live.discard(seq)
            self._lock.notify_all()
        seq.sink(finish)

    def _give_up_kept(self) -> None:
        """Under the lock: the oldest kept slot is given up and free, with its blocks (its table was cleared when it
        was kept: no device work here, so any thread may)."""
        slot, blocks = self._kept.pop(0)
        assert self._decoder is not None and self._decoder.shared is not None
        self._decoder.shared.ledger.reset(slot)
        self._free_slots.add(slot)
        self._blocks.give(blocks)


def _seed(seq: Sequence) -> None:
    """The sequence's seed: its request's, else a fresh one (greedy never draws from it)."""
    seed = seq.params.seed
    if seed is None:
        seed = secrets.randbits(62) if seq.params.temperature > 0 else 0
    seq.seed = seed
