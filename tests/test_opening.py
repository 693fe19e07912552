"""The line an engine logs about its first seconds of serving (``standby.opening``), with no engine."""

from __future__ import annotations

import pytest

from hotweights.standby.opening import OPENING_S, Opening

pytestmark = pytest.mark.unit


def test_the_line_comes_once_after_the_opening_and_nothing_is_counted_outside_one() -> None:
    idle = Opening()
    idle.arrived(1.0)
    idle.stepped(1, 0.01)
    assert idle.ended(100.0) is None and not idle.steps and idle.first_arrival is None
    opening = Opening(100.0)
    assert opening.ended(100.0 + OPENING_S / 2) is None
    assert opening.ended(100.0 + OPENING_S) == f"first {OPENING_S:g} s of serving: no request"
    assert opening.ended(200.0) is None
    opening.prefilled(4, 0.01)
    assert not opening.prefills


@pytest.mark.parametrize(
    ("prefills", "adoptions", "steps", "expected"),
    [
        (
            [(8, 0.030), (4, 0.020)],
            [],
            [(12, 0.013), (12, 0.014), (16, 0.040)],
            "2 prefill(s) of 12 prompt(s) in 50.0 ms (longest 30.0); 3 decode step(s) of 12-16 rows: median 14.0 ms, "
            "longest 40.0, 67.0 ms in all",
        ),
        ([], [0.045, 0.002], [(2, 0.012)], "2 continuation(s) adopted in 47.0 ms (longest 45.0); 1 decode step(s)"),
    ],
)
def test_the_line_names_every_count_and_time(
    prefills: list[tuple[int, float]], adoptions: list[float], steps: list[tuple[int, float]], expected: str
) -> None:
    """Only the first arrival and token count (later ones leave them as they were); every part is named."""
    opening = Opening(10.0)
    for rows, seconds in prefills:
        opening.prefilled(rows, seconds)
    for seconds in adoptions:
        opening.adopted(seconds)
    for rows, seconds in steps:
        opening.stepped(rows, seconds)
    opening.received(10.03)
    opening.received(10.04)
    opening.arrived(10.05)
    opening.arrived(10.5)
    opening.emitted(10.2)
    opening.emitted(10.9)
    line = opening.ended(10.0 + OPENING_S)
    head = f"first {OPENING_S:g} s of serving: first request 50 ms after the start (at the server 30 ms); "
    head += "first token 200 ms; "
    assert line is not None and line.startswith(head)
    assert expected in line


def test_the_line_says_why_continuations_were_not_adopted() -> None:
    opening = Opening(10.0)
    opening.arrived(10.01)
    none = "none of 1 deposits holds its prompt"
    for why in [none, "no shared KV cache here", none]:
        opening.not_adopted(why)
    line = opening.ended(10.0 + OPENING_S)
    assert line is not None
    assert "3 continuation(s) not adopted (none of 1 deposits holds its prompt: 2, no shared KV cache here: 1)" in line
