"""The paged KV cache's bookkeeping (``standby.kvpool``): how many blocks a sequence takes, the free list, the pool's
automatic sizes and refusals, as tables. No torch."""

from __future__ import annotations

import pytest

from hotweights.standby.kvpool import (
    BLOCK_SIZE,
    CPU_POOL_TOKENS,
    MAX_AUTO_BATCH,
    NULL_BLOCK,
    BlockPool,
    auto_max_batch,
    auto_pool_tokens,
    blocks_for,
    cells,
    pool_blocks,
    pool_refusal,
    sequence_blocks,
    shortfall,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "expected"),
    [
        (1, 1, 1),  # the prompt's one position; the token generated is never fed back
        (16, 1, 1),
        (16, 2, 2),  # the first generated token is fed at position 16
        (17, 1, 2),
        (5, 12, 1),  # positions 0 .. 15
        (5, 13, 2),
        (100, 256, blocks_for(355)),
        (4000, 96, 256),  # the most of a 4096-position row
    ],
)
def test_a_sequence_takes_the_blocks_of_its_prompt_and_every_token_fed_back(
    prompt: int, max_tokens: int, expected: int
) -> None:
    assert sequence_blocks(prompt, max_tokens) == expected


@pytest.mark.parametrize(("tokens", "blocks"), [(1, 1), (BLOCK_SIZE, 1), (BLOCK_SIZE + 1, 2), (4096, 256)])
def test_blocks_hold_their_positions_and_a_pool_adds_the_null_block(tokens: int, blocks: int) -> None:
    assert blocks_for(tokens) == blocks and pool_blocks(tokens) == blocks + 1


def test_blocks_are_handed_out_lowest_first_never_the_null_one_and_taken_again_once_given_back() -> None:
    pool = BlockPool(6)
    assert (pool.total, pool.free, pool.used) == (5, 5, 0)
    first, second = pool.take(2), pool.take(2)
    assert (first, second, pool.used) == ([1, 2], [3, 4], 4)
    assert pool.take(2) is None and pool.free == 1, "a request that does not fit takes nothing"
    pool.give(first)
    assert pool.take(3) == [1, 2, 5] and pool.free == 0
    assert NULL_BLOCK not in first + second
    pool.give([1, 2, 5, 3, 4])
    assert pool.free == pool.total == 5


@pytest.mark.parametrize(
    ("memory_bytes", "token_bytes", "rows", "kv_tokens", "expected"),
    [
        (None, 2048, MAX_AUTO_BATCH, 4096, CPU_POOL_TOKENS),  # CPU: the fixed pool
        (None, 2048, 2, 4096, 8192),  # never more than every row at its longest
        (8 << 30, 196608, MAX_AUTO_BATCH, 4096, 43690 // BLOCK_SIZE * BLOCK_SIZE),  # xl: 192 KiB a position
        (1 << 30, 1024, MAX_AUTO_BATCH, 4096, MAX_AUTO_BATCH * 4096),  # tiny on a GPU: capped by the rows
        (1000, 100, 4, 4096, 0),  # less than a block
    ],
)
def test_the_automatic_pool_holds_what_its_memory_does_in_whole_blocks_at_most_every_row_at_its_longest(
    memory_bytes: int | None, token_bytes: int, rows: int, kv_tokens: int, expected: int
) -> None:
    assert auto_pool_tokens(memory_bytes, token_bytes, rows, kv_tokens) == expected


@pytest.mark.parametrize(
    ("pool_tokens", "expected"),
    [(CPU_POOL_TOKENS, 32), (43680, MAX_AUTO_BATCH), (1 << 20, MAX_AUTO_BATCH), (1024, 2), (16, 1)],
)
def test_the_automatic_batch_is_the_typical_sequences_the_pool_holds_up_to_its_ceiling(
    pool_tokens: int, expected: int
) -> None:
    assert auto_max_batch(pool_tokens) == expected


@pytest.mark.parametrize(
    ("pool_tokens", "kv_tokens", "refused"),
    [(4096, 4096, False), (4090, 4096, False), (4080, 4096, True), (16, 2, False), (0, 2, True)],
)
def test_a_pool_must_hold_one_sequence_at_its_longest(pool_tokens: int, kv_tokens: int, refused: bool) -> None:
    refusal = pool_refusal(pool_tokens, kv_tokens)
    assert (refusal is not None) == refused
    if refusal:
        assert refusal == f"a KV pool of {pool_tokens} positions cannot hold one sequence of {kv_tokens} positions"


@pytest.mark.parametrize(("needed", "pool", "refused"), [(10, 10, False), (11, 10, True), (1, 0, True)])
def test_a_request_that_needs_more_than_the_whole_pool_is_refused_naming_the_numbers(
    needed: int, pool: int, refused: bool
) -> None:
    reason = shortfall(needed, pool)
    assert (reason is not None) == refused
    if reason:
        assert f"need {needed} KV blocks" in reason and f"pool of {pool} blocks" in reason


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        ({"block_tokens": 16, "blocks": 1024, "used": 40, "running": 3, "waiting": 1}, ("40/1024", "3", "1")),
        (None, ("-", "-", "-")),  # vLLM, SGLang, or no answer yet
        ("junk", ("-", "-", "-")),
    ],
)
def test_a_reported_pool_reads_as_blocks_in_use_of_all_and_sequences_running_and_waiting(
    report: object, expected: tuple[str, str, str]
) -> None:
    assert cells(report) == expected
