"""The inference thread's progress check as a table: when work pending and no progress make an engine stalled,
the bound each operation gets, what a prefill is expected to take (``standby.progress``). The stalls themselves,
with an engine and a controller, are in ``tests/test_stall.py``."""

from __future__ import annotations

import pytest

from hotweights.standby.progress import (
    STALL_FACTOR,
    STALL_FLOOR_S,
    Progress,
    Step,
    expected_prefill_s,
    padded,
    stall_bound_s,
    stall_refusal,
)


def step(expected_s: float | None, what: str = "a decode step of 1 row(s)") -> Step:
    return Step(what, 100.0, expected_s)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("progress", "now", "stalled"),
    [
        (Progress(0, 0.0, None, 0.01), 100.0, None),  # nothing pending: idle, never stalled
        (Progress(2, 100.0, None, 0.01), 100.9, None),  # between operations: the floor
        (Progress(2, 100.0, None, 0.01), 101.1, "no progress for 1.1 s with 2 sequence(s) pending (its bound: 1.0 s)"),
        (Progress(2, 100.0, None, 0.01, waited_s=0.5), 101.1, None),  # half a second of it waiting for a core
        (Progress(2, 100.0, None, 0.01, waited_s=0.3), 101.5, "no progress for 1.2 s, 0.3 s more waiting for a core"),
        (Progress(1, 100.0, None, 0.5), 104.9, None),  # slow steps: ten of them
        (Progress(1, 100.0, None, 0.5), 105.1, "no progress for 5.1 s with 1 sequence(s) pending (its bound: 5.0 s)"),
        (Progress(1, 100.0, step(1.0), 0.01), 109.9, None),  # the step in flight expects a second
        (Progress(1, 100.0, step(1.0), 0.01), 110.5, "in a decode step of 1 row(s) for 10.5 s (its bound: 10.0"),
        (Progress(1, 100.0, step(0.01, "a prefill of 1 x 16 tokens"), 0.01), 101.2, "in a prefill of 1 x 16 tokens"),
        (Progress(1, 100.0, step(None, "a prefill of 1 x 4096 tokens"), 0.01), 900.0, None),  # nothing to expect by
    ],
)
def test_a_worker_with_work_pending_and_no_progress_past_its_bound_is_stalled(
    progress: Progress, now: float, stalled: str | None
) -> None:
    reason = stall_refusal(progress, now)
    assert reason == stalled if stalled is None else stalled in reason


@pytest.mark.unit
@pytest.mark.parametrize(
    ("progress", "bound"),
    [
        (Progress(1, 0.0, None, 0.0), None),  # nothing measured yet: nothing to expect by
        (Progress(1, 0.0, None, 1.0), STALL_FACTOR),
        (Progress(1, 0.0, step(0.001), 1.0), STALL_FLOOR_S),  # the step in flight, not the average, counts
        (Progress(1, 0.0, step(None), 1.0), None),
    ],
)
def test_the_bound_is_a_multiple_of_the_expected_time_above_a_floor(progress: Progress, bound: float | None) -> None:
    assert stall_bound_s(progress) == bound


@pytest.mark.unit
@pytest.mark.parametrize(
    ("measured", "shape", "expected"),
    [
        ({}, (1, 16), None),
        ({(1, 64): 0.5, (1, 16): 0.001}, (1, 64), 0.5),  # its own time, however the others scale
        ({(1, 16): 0.01}, (1, 32), 0.04),  # twice the tokens, four times the attention
        ({(1, 16): 0.01, (1, 1024): 0.1}, (1, 2048), 0.4),  # the least bound: from the nearest
        ({(4, 16): 0.02}, (1, 64), 0.08),  # as many tokens, four times the attention
        ({(1, 64): 0.02}, (4, 16), 0.02),  # as many tokens, less attention: never below the measured time
        ({(1, 1024): 0.1}, (1, 16), 0.1),  # a smaller shape: the larger one's time bounds it
    ],
)
def test_a_prefill_is_expected_to_take_its_shapes_time_or_a_measured_one_scaled_up(
    measured: dict[tuple[int, int], float], shape: tuple[int, int], expected: float | None
) -> None:
    assert expected_prefill_s(measured, shape) == pytest.approx(expected)


@pytest.mark.unit
@pytest.mark.parametrize(("longest", "length"), [(1, 16), (16, 16), (17, 32), (64, 64), (65, 65)])
def test_a_prompt_is_padded_to_the_prefill_length_that_holds_it(longest: int, length: int) -> None:
    assert padded([16, 32, 64], longest) == length
