"""Batched sampling: each row's token depends on its own logits, parameters and draw only."""

from __future__ import annotations

import math

import pytest

# Sampling is arithmetic on torch's tensors, no decision of the controller's: the fast tier where torch is not
# installed skips it.
torch = pytest.importorskip("torch")

from hotweights.standby.sampling import sample_rows, sample_token, token_seed, uniform  # noqa: E402

pytestmark = pytest.mark.unit

PROBS = [0.5, 0.3, 0.2]  # tokens 2, 0, 1 in the logits below, most likely first
LOGITS = torch.tensor([math.log(PROBS[1]), math.log(PROBS[2]), math.log(PROBS[0])], dtype=torch.float32)
N = 1000


def counts(top_p: float, temperature: float = 1.0) -> dict[int, int]:
    """How often each token is drawn at N evenly spread uniform draws."""
    draws = [(i + 0.5) / N for i in range(N)]
    tokens = sample_rows(LOGITS.expand(N, -1), [temperature] * N, [top_p] * N, draws)
    return {token: tokens.count(token) for token in set(tokens)}


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (1.0, {2: 500, 0: 300, 1: 200}),  # the whole distribution, by inverse CDF in token order
        (0.999, {2: 500, 0: 300, 1: 200}),  # the same, by inverse CDF over the tokens sorted
        (0.7, {2: 625, 0: 375}),  # the nucleus: 0.5 < 0.7 <= 0.8, renormalised
        (0.5, {2: 1000}),  # the most likely token's mass already reaches top_p
        (1e-9, {2: 1000}),  # the most likely token always stays
    ],
)
def test_draws_follow_the_nucleus(top_p: float, expected: dict[int, int]) -> None:
    assert counts(top_p) == expected


def test_a_tiny_temperature_saturates_to_the_argmax() -> None:
    assert counts(1.0, temperature=1e-6) == {2: N}


def test_greedy_rows_are_the_argmax_whatever_the_draw() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert sample_rows(logits, [0.0] * 5, [1.0] * 5, [0.99] * 5) == logits.argmax(-1).tolist()


def test_a_rows_token_does_not_depend_on_the_rows_beside_it() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 200, generator=g)
    temperature, top_p = [0.0, 0.7, 1.0, 1.3, 0.0, 0.9], [1.0, 0.9, 0.5, 1.0, 0.3, 0.95]
    draws = [uniform(seed, 7) for seed in range(6)]
    together = sample_rows(logits, temperature, top_p, draws)
    alone = [
        sample_rows(logits[i : i + 1], temperature[i : i + 1], top_p[i : i + 1], draws[i : i + 1])[0] for i in range(6)
    ]
    assert together == alone
    assert together[0] == int(logits[0].argmax()) and together[4] == int(logits[4].argmax())


def test_sample_token_is_one_row_drawn_from_its_seed_and_position() -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(2))
    tokens = [sample_token(logits, 1.0, 1.0, 5, position) for position in range(40)]
    assert tokens == [sample_token(logits, 1.0, 1.0, 5, position) for position in range(40)]
    assert len(set(tokens)) > 10, "draws at different positions repeat"
    assert tokens != [sample_token(logits, 1.0, 1.0, 6, position) for position in range(40)]


def test_uniform_draws_lie_in_the_unit_interval_and_spread() -> None:
    draws = [uniform(seed, position) for seed in (0, 1, 2**62) for position in range(200)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert 0.45 < sum(draws) / len(draws) < 0.55


def test_token_seeds_differ_by_position_and_by_seed() -> None:
    seeds = {token_seed(seed, position) for seed in (0, 1, 2**62) for position in range(100)}
    assert len(seeds) == 300 and all(0 <= s < 2**63 for s in seeds)
