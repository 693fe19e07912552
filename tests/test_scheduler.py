"""The inference thread in process, on the tiny checkpoint: batched decode against one sequence at a time."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hotweights.cache.loadspec import LoadSpec
from hotweights.standby.decoder import Decoder, Launched, bucket
from hotweights.standby.kvpool import BlockPool, blocks_for
from hotweights.standby.model import KVCache, Transformer, generate
from hotweights.standby.scheduler import Finish, SamplingParams, Scheduler, Sequence
from hotweights.standby.weights import load_model

# Prompts of different lengths (so different prefill buckets), and token budgets that end them at
# different steps: with 3 slots, the fourth and later sequences join as earlier ones leave, and a
# sequence leaving slot 0 or 1 leaves a dummy row below the others.
PROMPTS = [[5, 9, 13], list(range(40, 61)), [7], list(range(100, 109)), [3, 1, 4, 1, 5], list(range(200, 240))]
MAX_TOKENS = [12, 30, 5, 20, 26, 9]


class RecordingDecoder(Decoder):
    """A real decoder that also records the shape of every prefill and decode step it runs."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.prefills: list[tuple[int, int]] = []  # (prompts, padded length)
        self.decodes: list[tuple[int, int]] = []  # (batch size run, KV length)

    @property
    def batch_sizes(self) -> list[int]:
        return [n for n, _ in self.decodes]

    def prefill(self, first: int, prompts: list[list[int]]) -> torch.Tensor:
        self.prefills.append((len(prompts), bucket(self.lengths, max(map(len, prompts)))))
        return super().prefill(first, prompts)

    def finish(self, step: Launched) -> tuple[torch.Tensor, list[int]]:
        self.decodes.append(step.shape)
        return super().finish(step)

    def warmed_decodes(self) -> set[tuple[int, int]]:
        """The decode shapes warm-up made ready: run eagerly, or (with graphs) captured."""
        captured = {(n, kv) for n in self.graph_batches for kv in self.kv_lengths} if self.graphs_enabled else set()
        return set(self.decodes) | captured


class ChainingDecoder(RecordingDecoder):
    """A recording decoder that chains its steps on the CPU too (``Decoder.chain``; there each runs at once), and
    records which of its chained steps the scheduler took as its next step."""

    chains = True

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.chained: list[Launched] = []
        self.taken = 0

    def chain(self, after: Launched, positions: list[int], fed: list[bool]) -> Launched:
        self.chained.append(super().chain(after, positions, fed))
        return self.chained[-1]

    def finish(self, step: Launched) -> tuple[torch.Tensor, list[int]]:
        self.taken += any(step is chained for chained in self.chained)
        return super().finish(step)


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Transformer:
    return load_model(tiny_model, LoadSpec()).model


class Collected:
    """One sequence's events, and an event set when its Finish arrives."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: Finish | None = None
        self.done = threading.Event()

    def __call__(self, event: int | Finish) -> None:
        if isinstance(event, Finish):
            self.finish = event
            self.done.set()
        else:
            self.tokens.append(event)


def run(
    model: Transformer,
    max_batch: int,
    params: list[SamplingParams],
    graphs: bool = False,
    batch_invariant: bool = False,
    sequences: list[tuple[list[int], int]] | None = None,
    blocks: int = 0,
    decoder_class: type[RecordingDecoder] = RecordingDecoder,
    made: list[RecordingDecoder] | None = None,
) -> tuple[list[Collected], list[int], list[tuple[int, int]]]:
    """Submit every prompt (``sequences``: (prompt, replay) each, default PROMPTS, none replayed) before starting a
    scheduler with ``max_batch`` slots (and a pool of ``blocks``, default one for every slot's 128 positions); each
    sequence's events, the batch sizes of the decode steps and the prefills' shapes. With graphs, or batch-invariant,
    every decode shape serving ran must be one warm-up ran first (a prefill's shape eagerly costs what its later runs
    do: ``standby.decoder``). The decoder is a ``decoder_class``, appended to ``made`` where one is given."""
    blocks = blocks or 1 + max_batch * blocks_for(128)
    kv = KVCache.pool(model.config, model.tp, max_batch, 128, blocks, model.device, model.dtype)
    decoder = decoder_class(model, kv, graphs, batch_invariant)
    if made is not None:
        made.append(decoder)
    decoder.warm_up()
    warmed = decoder.warmed_decodes()
    decoder.prefills.clear()
    decoder.decodes.clear()
    scheduler = Scheduler()
    scheduler.attach_kv(decoder)
    sequences = sequences or [(prompt, 0) for prompt in PROMPTS]
    sinks = [Collected() for _ in sequences]
    for (prompt, replay), p, sink in zip(sequences, params, sinks, strict=True):
        scheduler.submit(Sequence(prompt, p, sink, replay))  # all queued before the worker starts: no race
    scheduler.start()
    try:
        for sink in sinks:
            assert sink.done.wait(60), "a sequence never finished"
    finally:
        scheduler.stop(10)
    if graphs or batch_invariant:  # eagerly, a shape's first run costs what its later runs do (standby.decoder)
        assert set(decoder.decodes) <= warmed, "a decode shape warm-up missed"
    return sinks, decoder.batch_sizes, decoder.prefills


def test_batched_greedy_equals_one_at_a_time(model: Transformer) -> None:
    stop = next(iter(generate(model, PROMPTS[3], 20)))  # PROMPTS[3]'s first token ends it at once
    params = [SamplingParams(n, stop_ids=frozenset({stop} if i == 3 else ())) for i, n in enumerate(MAX_TOKENS)]
    batched, sizes, prefills = run(model, 3, params)
    alone, alone_sizes, alone_prefills = run(model, 1, params)
    assert set(alone_sizes) == {1} and max(sizes) == 3
    # The first three prompts, queued together, are prefilled in one pass (padded to the longest's 32).
    assert prefills[0] == (3, 32) and {n for n, _ in alone_prefills} == {1}
    assert len(sizes) < sum(len(s.tokens) for s in batched) / 2, "decode steps were not shared"
    for prompt, p, b, a in zip(PROMPTS, params, batched, alone, strict=True):
        expected = list(generate(model, prompt, p.max_tokens, stop_ids=p.stop_ids))
        assert b.tokens == a.tokens == expected
        assert b.finish == a.finish == Finish("stop" if len(expected) < p.max_tokens else "length")
    assert batched[3].tokens == [] and batched[3].finish == Finish("stop")


def test_chained_steps_generate_what_steps_one_at_a_time_do(model: Transformer) -> None:
    """Greedy sequences whose steps are chained (``Decoder.chain``) yield ``generate``'s tokens, through sequences
    joining, stopping at a stop id and ending at their token budgets, and a sampled one that breaks the chain."""
    stop = next(iter(generate(model, PROMPTS[3], 20)))
    params = [SamplingParams(n, stop_ids=frozenset({stop} if i == 3 else ())) for i, n in enumerate(MAX_TOKENS)]
    params[5] = SamplingParams(MAX_TOKENS[5], temperature=0.9, seed=5)
    made: list[RecordingDecoder] = []
    chained, _, _ = run(model, 3, params, decoder_class=ChainingDecoder, made=made)
    for prompt, p, c in zip(PROMPTS, params, chained, strict=True):
        expected = generate(model, prompt, p.max_tokens, temperature=p.temperature, seed=p.seed, stop_ids=p.stop_ids)
        assert c.tokens == list(expected)
    decoder = made[0]
    assert isinstance(decoder, ChainingDecoder)
    assert decoder.taken > len(decoder.chained) / 2 > 0, "the chained steps were not taken"


def test_batched_seeded_sampling_equals_generate(model: Transformer) -> None:
    """Each sequence draws from its own seed per token: batching does not change what it samples."""
    params = [SamplingParams(n, temperature=0.9, top_p=0.95, seed=i) for i, n in enumerate(MAX_TOKENS)]
    batched, _, _ = run(model, 3, params)
    for prompt, p, b in zip(PROMPTS, params, batched, strict=True):
        assert b.tokens == list(generate(model, prompt, p.max_tokens, temperature=0.9, top_p=0.95, seed=p.seed))


def test_batch_invariant_runs_one_decode_shape_and_prefills_one_prompt_at_a_time(model: Transformer) -> None:
    params = [SamplingParams(n) for n in MAX_TOKENS]
    batched, sizes, prefills = run(model, 3, params, batch_invariant=True)
    assert set(sizes) == {3}, "a decode step ran at another batch size"
    assert {rows for rows, _ in prefills} == {1} and len(prefills) == len(PROMPTS)
    for prompt, p, b in zip(PROMPTS, params, batched, strict=True):
        assert b.tokens == list(generate(model, prompt, p.max_tokens))


def test_a_replayed_continuation_emits_only_what_follows_and_prefills_only_the_prompt(model: Transformer) -> None:
    """The continuation of a cut request: its prompt, then the tokens generated before the cut, replayed through
    decode steps; it emits the uncut run's remaining tokens, and prefills the prompt alone."""
    prompt, total, cut = PROMPTS[1], 30, 12  # 21 prompt tokens: 32 padded; with the 12 replayed, 64
    uncut = list(generate(model, prompt, total))
    params = [SamplingParams(total - cut)]
    (continued,), _, prefills = run(model, 3, params, batch_invariant=True, sequences=[(prompt + uncut[:cut], cut)])
    assert continued.tokens == uncut[cut:] and continued.finish == Finish("length")
    assert prefills == [(1, 32)], "the replayed tokens were prefilled, or the prompt was not alone"


def test_sequences_wait_for_their_blocks_and_generate_what_they_generate_alone(model: Transformer) -> None:
    """Three slots over a pool of 5 blocks: the sequences need 1 to 4 blocks each (their prompts and max_tokens), so
    they wait for blocks as well as slots, never preempted, each generating what ``generate`` does; their steps still
    share rows."""
    params = [SamplingParams(n) for n in MAX_TOKENS]
    assert [Sequence(p, q, Collected()).needs for p, q in zip(PROMPTS, params, strict=True)] == [1, 4, 1, 2, 2, 3]
    batched, sizes, _ = run(model, 3, params, blocks=6)
    assert max(sizes) >= 2
    for prompt, p, b in zip(PROMPTS, params, batched, strict=True):
        assert b.tokens == list(generate(model, prompt, p.max_tokens)) and b.finish == Finish("length")


def test_a_sequence_that_needs_more_blocks_than_the_pool_ends_saying_so(model: Transformer) -> None:
    (refused,), _, _ = run(model, 3, [SamplingParams(MAX_TOKENS[1])], sequences=[(PROMPTS[1], 0)], blocks=4)
    assert refused.tokens == [] and refused.finish.reason == "error"
    assert "need 4 KV blocks of 16 positions" in refused.finish.error and "pool of 3 blocks" in refused.finish.error


@pytest.mark.parametrize(("adopts", "grouped"), [(True, 1), (False, 3)], ids=["adopting", "not-adopting"])
def test_a_continuation_joins_no_prefill_behind_another_where_it_could_adopt_a_slot(adopts: bool, grouped: int) -> None:
    """A failover's burst: a fresh prompt, a continuation (3 tokens generated before the cut), another fresh one,
    every slot free and the three fitting one prefill. Where the engine adopts deposited slots the continuation waits
    to head the next turn, which tries it for one; its tokens are not prefilled behind the fresh prompt's. Where it
    cannot, the three are prefilled together."""
    scheduler = Scheduler(kv_share=SimpleNamespace() if adopts else None)  # only whether it has one is read here
    decoder = SimpleNamespace(batch_invariant=False, shared=SimpleNamespace(), prefill_fits=lambda rows, longest: True)
    scheduler._free_slots, scheduler._blocks = set(range(4)), BlockPool(64)
    sequences = [
        Sequence([1, 2, 3], SamplingParams(8), Collected()),
        Sequence([4, 5, 6, 7], SamplingParams(5), Collected(), 3),
        Sequence([8, 9], SamplingParams(8), Collected()),
    ]
    scheduler._waiting.extend(sequences)
    group = scheduler._claim(decoder)  # type: ignore[arg-type]
    assert group == sequences[:grouped] and list(scheduler._waiting) == sequences[grouped:]
